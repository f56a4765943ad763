#!/usr/bin/env bash
# Create .venv and install shoal into it, keeping a torch the machine already has.
#
# Why: an unpinned `pip install torch` pulls a multi-GB CUDA build. A user with a CUDA torch
# already installed keeps it (the venv sees system site-packages); everyone else gets the
# pinned CPU build, which these machines serve from local disk.
set -euo pipefail
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="${SHOAL_TORCH_PIN:-torch==2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "setup: keeping the installed torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup: no torch found, installing $TORCH_PIN"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$TORCH_PIN"
fi
# shoal and its extras. uv resolves and installs them several times faster than pip (about 30 s
# against 100 s for a fresh venv here); it sees only the venv's own packages, not system ones, so a
# venv that borrows the machine's torch (--system-site-packages) installs with pip, which sees that
# torch, instead of letting uv fetch a multi-GB CUDA build. No uv (offline, say): pip does it all.
EXTRAS=".[dev,hf,logs]"
if ! grep -q "include-system-site-packages = true" "$VENV/pyvenv.cfg" \
    && "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check uv >/dev/null 2>&1 \
    && "$VENV/bin/python" -m uv pip install --quiet --python "$VENV/bin/python" -e "$EXTRAS"; then
  :
else
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$EXTRAS"
fi
echo "setup: $("$VENV/bin/python" -c 'import torch, hivemind; print("torch", torch.__version__, "| hivemind", hivemind.__version__)')"

"""Atomic, self-verifying checkpoints of the shared (anchor) state.

Layout: ``<checkpoint_dir>/round-<NNNNNNNN>/`` holding ``model.safetensors`` (anchor params by
name), ``outer.safetensors`` (outer optimizer state), optionally ``local.safetensors`` (this
peer's own state, e.g. its inner AdamW moments) and ``meta.json`` (round, run_id, created,
shoal_version, sha256 + size of each tensor file, then the caller's extras).

Why so careful: a node is killed whenever its owner closes a laptop. A checkpoint directory
only ever appears under its final name complete and fsynced (written under ``.tmp-*`` and
renamed), and loading re-verifies every byte, so a torn or bit-rotted checkpoint is reported
and skipped instead of silently resuming from garbage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from protocols.errors import CheckpointError
from protocols.version import shoal_version

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
OUTER_FILE = "outer.safetensors"
LOCAL_FILE = "local.safetensors"  # optional: this peer's own state (e.g. inner AdamW), never shared
META_FILE = "meta.json"
TMP_PREFIX = ".tmp-"
_ROUND_DIR = re.compile(r"round-(\d{8,})")
_RESERVED_META = ("round", "created", "shoal_version", "files")
_HASH_CHUNK = 1 << 20

# One save at a time per process: a save deletes stale .tmp- dirs, which must never include
# the one a concurrent save (e.g. the Ctrl+C save racing a periodic one) is still writing.
_SAVE_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A verified checkpoint, loaded onto the CPU."""

    path: Path
    round: int
    params: dict[str, Tensor]
    outer_state: dict[str, Tensor]
    meta: dict
    local_state: dict[str, Tensor]  # empty when the checkpoint holds none (older checkpoints)


def round_dir_name(round: int) -> str:
    return f"round-{round:08d}"


def _fsync_path(path: Path) -> None:
    # Directories need O_RDONLY too: fsync on a dir fd persists the entries (renames) in it.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _cpu_copies(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    # Copies, not views: save_file rejects tensors sharing storage (tied weights) and
    # non-contiguous ones, and a copy cannot change under us while the trainer keeps going.
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}


def _write_tensors(path: Path, tensors: dict[str, Tensor]) -> dict:
    try:
        save_file(_cpu_copies(tensors), str(path))
    except SafetensorError as e:
        # safetensors reports a failed write as its own error ("I/O error: No space left on device
        # (os error 28)"): raised as the OSError it is, so callers handle a full disk in one place.
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from e
    _fsync_path(path)
    return {"sha256": _sha256(path), "size": path.stat().st_size}


def _remove_dir(path: Path) -> None:
    """Delete a directory so that a crash midway leaves only a .tmp- dir, never a torn round."""
    doomed = path.with_name(f"{TMP_PREFIX}rm-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _clean_stale_tmp(checkpoint_dir: Path) -> None:
    for entry in checkpoint_dir.iterdir():
        if entry.name.startswith(TMP_PREFIX):
            log.info("removing leftover %s from an interrupted save", entry)
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def save_checkpoint(
    checkpoint_dir: Path,
    *,
    round: int,
    params: dict[str, Tensor],
    outer_state: dict[str, Tensor],
    meta: dict,
    keep_last: int = 3,
    local_state: dict[str, Tensor] | None = None,
) -> Path:
    """Write checkpoint ``round`` atomically and prune to the newest ``keep_last``; return its path.

    ``meta`` holds the caller's extras (``run_id`` is expected there and recorded as null if
    absent); the reserved keys round/created/shoal_version/files are ours.
    """
    if round < 0:
        raise ValueError(f"round must be >= 0, got {round}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if clash := [key for key in _RESERVED_META if key in meta]:
        raise ValueError(f"meta keys {clash} are reserved; save_checkpoint fills them in")
    checkpoint_dir = Path(checkpoint_dir)
    final = checkpoint_dir / round_dir_name(round)

    with _SAVE_LOCK:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        _clean_stale_tmp(checkpoint_dir)  # a crash in an earlier save leaves only .tmp- entries behind
        staging = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=checkpoint_dir))
        try:
            _write_staged(staging, round=round, params=params, outer_state=outer_state, meta=meta,
                          local_state=local_state)
            _publish(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _prune(checkpoint_dir, keep_last=keep_last, keep=final)
    log.info("saved checkpoint %s", final)
    return final


def _write_staged(staging: Path, *, round: int, params: dict[str, Tensor], outer_state: dict[str, Tensor],
                  meta: dict, local_state: dict[str, Tensor] | None) -> None:
    """Write and fsync every file of the checkpoint inside its private temp dir."""
    files = {
        MODEL_FILE: _write_tensors(staging / MODEL_FILE, params),
        OUTER_FILE: _write_tensors(staging / OUTER_FILE, outer_state),
    }
    if local_state:
        files[LOCAL_FILE] = _write_tensors(staging / LOCAL_FILE, local_state)
    record = {
        "round": round,
        "run_id": meta.get("run_id"),
        "created": time.time(),
        "shoal_version": shoal_version(),
        "files": files,
        **{key: value for key, value in meta.items() if key != "run_id"},
    }
    meta_path = staging / META_FILE
    meta_path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    _fsync_path(meta_path)
    _fsync_path(staging)


def _publish(staging: Path, final: Path) -> None:
    """Rename the staged dir to its final name. rename() cannot replace a non-empty dir, so an
    existing checkpoint of this round is first moved aside under .tmp-: a crash between the two
    renames loses only this round's old copy (cleaned up later), never leaves a torn one."""
    if final.exists():
        displaced = final.with_name(f"{TMP_PREFIX}old-{final.name}-{time.monotonic_ns()}")
        os.rename(final, displaced)
        os.rename(staging, final)
        shutil.rmtree(displaced, ignore_errors=True)
    else:
        os.rename(staging, final)
    _fsync_path(final.parent)


def _prune(checkpoint_dir: Path, *, keep_last: int, keep: Path) -> None:
    """Remove the oldest beyond ``keep_last``; never ``keep`` (the one just written), even if newer
    rounds exist (e.g. after resuming from an older checkpoint because the newer ones were corrupt)."""
    for old in list_checkpoints(checkpoint_dir)[keep_last:]:
        if old != keep:
            _remove_dir(old)


def _bad(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is {problem}; delete it or use an older checkpoint")


def _read_meta(path: Path) -> dict:
    meta_path = path / META_FILE
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _bad(meta_path, "missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(meta_path, f"corrupt (unreadable JSON: {type(exc).__name__})") from exc
    if not isinstance(meta, dict):
        raise _bad(meta_path, "corrupt (not a JSON object)")
    round_ = meta.get("round")
    if not isinstance(round_, int) or isinstance(round_, bool) or round_ < 0:
        raise _bad(meta_path, "corrupt (no valid 'round')")
    files = meta.get("files")
    if not isinstance(files, dict):
        raise _bad(meta_path, "corrupt (no 'files' map)")
    for name in (MODEL_FILE, OUTER_FILE, *([LOCAL_FILE] if LOCAL_FILE in files else [])):
        entry = files.get(name)
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and isinstance(entry.get("size"), int)
        ):
            raise _bad(meta_path, f"corrupt (no sha256/size recorded for {name})")
    return meta


def _load_verified(file_path: Path, expected: dict) -> dict[str, Tensor]:
    try:
        size = file_path.stat().st_size
    except FileNotFoundError:
        raise _bad(file_path, "missing") from None
    if size != expected["size"]:
        problem = "truncated" if size < expected["size"] else "corrupt"
        raise _bad(file_path, f"{problem} ({size} bytes, expected {expected['size']})")
    if _sha256(file_path) != expected["sha256"]:
        raise _bad(file_path, "corrupt (sha256 mismatch)")
    try:
        return load_file(str(file_path), device="cpu")
    except Exception as exc:  # the hash matched, so this is a file we wrote badly
        raise _bad(file_path, f"unreadable ({type(exc).__name__})") from exc


def load_checkpoint(path: Path) -> Checkpoint:
    """Load and fully verify one checkpoint dir; any problem raises a one-line ``CheckpointError``."""
    path = Path(path)
    if not path.is_dir():
        raise _bad(path, "missing (not a directory)")
    meta = _read_meta(path)
    params = _load_verified(path / MODEL_FILE, meta["files"][MODEL_FILE])
    outer_state = _load_verified(path / OUTER_FILE, meta["files"][OUTER_FILE])
    local_state = _load_verified(path / LOCAL_FILE, meta["files"][LOCAL_FILE]) if LOCAL_FILE in meta["files"] else {}
    return Checkpoint(path=path, round=meta["round"], params=params, outer_state=outer_state, meta=meta,
                      local_state=local_state)


def list_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Checkpoint dirs, newest round first; temp dirs and anything not named round-N are ignored."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    found = []
    for entry in checkpoint_dir.iterdir():
        match = _ROUND_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return [entry for _, entry in sorted(found, key=lambda item: item[0], reverse=True)]


def load_latest_valid(
    checkpoint_dir: Path, on_invalid: Callable[[CheckpointError], None] | None = None
) -> Checkpoint | None:
    """The newest checkpoint that verifies, reporting each newer broken one to ``on_invalid``."""
    for path in list_checkpoints(checkpoint_dir):
        try:
            return load_checkpoint(path)
        except CheckpointError as err:
            if on_invalid is not None:
                on_invalid(err)
    return None

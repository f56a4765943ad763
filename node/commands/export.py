"""``shoal export``: the newest valid checkpoint as a Hugging Face model directory.

The model and tokenizer come from the checkpoint's own record (meta.json ``run_config``), or from
``--config`` for checkpoints written before shoal kept it. torch and transformers load only when
the command runs, not for ``shoal --help``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from node.commands.common import fail
from protocols.errors import CheckpointError, ConfigError, ShoalError

if TYPE_CHECKING:
    from node.library.checkpoint import Checkpoint
    from node.training.model import ModelConfig


def export(
    checkpoint_dir: Path = typer.Option(..., "--checkpoint-dir", envvar="SHOAL_CHECKPOINT_DIR", metavar="DIR", help="A shoal run's --checkpoint-dir: its newest valid checkpoint is exported."),
    output: Path = typer.Option(..., "-o", "--output", metavar="DIR", help="The directory to write (config.json, model.safetensors, tokenizer files)."),
    config: Path = typer.Option(None, "--config", envvar="SHOAL_CONFIG", metavar="PATH", help="The run's config (TOML), for checkpoints that do not record their model. Default: the checkpoint's record."),
    force: bool = typer.Option(False, "--force", help="Replace --output if it is not empty."),
) -> None:
    """Export the newest valid checkpoint to the Hugging Face format (AutoModelForCausalLM loads it)."""
    try:
        from node.training.export import export_hf

        checkpoint, model_config, tokenizer_spec, vocab_size = load_trained_checkpoint(checkpoint_dir, config)
        quiet_transformers()
        written = export_hf(checkpoint.params, model_config, tokenizer_spec, output, vocab_size=vocab_size, force=force)
    except ShoalError as e:
        fail(e)
    except ImportError as e:
        fail(ConfigError(f"shoal export needs transformers ({e.name or e} is missing): pip install 'shoal[hf]'"))
    target = written[0].parent if written else output
    typer.echo(f"wrote {target} from {checkpoint.path} (round {checkpoint.round}): {', '.join(p.name for p in written)}")
    typer.echo(f"load it: AutoModelForCausalLM.from_pretrained({str(target)!r}); "
               f"AutoTokenizer.from_pretrained({str(target)!r})")


def load_trained_checkpoint(checkpoint_dir: Path, config_path: Path | None) -> tuple[Checkpoint, ModelConfig, str, int]:
    """The newest valid checkpoint of ``checkpoint_dir`` and what its model is: (checkpoint, model
    config, tokenizer spec, vocab size), from ``config_path`` when given, else the checkpoint's record.
    Newer broken checkpoints are skipped with a line on stderr; none valid is a CheckpointError."""
    from node.library.checkpoint import list_checkpoints, load_latest_valid
    from node.training.export import model_config_from_meta

    checkpoint_dir = Path(checkpoint_dir).expanduser()
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"--checkpoint-dir {checkpoint_dir} is not a directory; give a shoal run's --checkpoint-dir")
    broken: list[CheckpointError] = []
    checkpoint = load_latest_valid(checkpoint_dir, on_invalid=broken.append)
    if checkpoint is None:
        if broken:
            raise CheckpointError(f"no valid checkpoint in {checkpoint_dir} ({len(list_checkpoints(checkpoint_dir))} "
                                  f"broken; the newest: {broken[0]})")
        raise CheckpointError(f"no checkpoint in {checkpoint_dir} (no round-* directory); "
                              "point --checkpoint-dir at a run's --checkpoint-dir")
    for error in broken:
        typer.echo(f"skipped: {error}", err=True)
    if config_path is None:
        try:
            model_config, tokenizer_spec, vocab_size = model_config_from_meta(checkpoint.meta)
        except CheckpointError as e:
            raise CheckpointError(f"{checkpoint.path}: {e}") from None
        return checkpoint, model_config, _tokenizer_here(tokenizer_spec, checkpoint_dir), vocab_size
    from node.process.config import load_config

    run_config = load_config(config_path)
    tokenizer_spec = run_config.data.tokenizer
    return checkpoint, run_config.model, tokenizer_spec, _vocab_size(checkpoint, run_config.model, tokenizer_spec)


def _tokenizer_here(spec: str, checkpoint_dir: Path) -> str:
    """The recorded tokenizer, or the copy ``shoal run`` keeps in the checkpoint dir when the
    recorded path does not exist on this machine (checkpoints copied elsewhere; a hub name is kept:
    it may be fetched)."""
    from node.training.export import TOKENIZER_COPY

    copy = checkpoint_dir / TOKENIZER_COPY
    recorded = Path(spec).expanduser()
    looks_local = spec.startswith(("/", "~", ".")) or spec.endswith(".json")
    if spec != "bytes" and looks_local and not recorded.exists() and (copy / "tokenizer.json").is_file():
        typer.echo(f"the run's tokenizer {spec} is not on this machine: using the copy in {copy}", err=True)
        return str(copy)
    return spec


def _vocab_size(checkpoint: Checkpoint, model_config: ModelConfig, tokenizer_spec: str) -> int:
    """Without a record: the GPT's embedding rows, or (hf) the tokenizer's vocabulary, as shoal run builds it."""
    if model_config.kind == "gpt":
        embedding = checkpoint.params.get("tok_emb.weight")
        return int(embedding.shape[0]) if embedding is not None else model_config.vocab_size
    from node.training.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_spec).vocab_size


def quiet_transformers() -> None:
    """No progress bars or advice from transformers in a command's output (errors still show)."""
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        return
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()

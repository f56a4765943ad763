"""The two experiment-log sinks: TensorBoard event files and Weights & Biases runs.

Both packages are optional (``pip install 'shoal[logs]'``): each is imported only when its sink
opens, and a missing one is a one-line ``ConfigError`` naming the extra, not a traceback.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from node.observe.experiment_log import TAG_PREFIXES, ExperimentLog, flat_config
from protocols.errors import ConfigError

logger = logging.getLogger(__name__)

# What the hparams tab compares runs by (both are scalars every run writes).
_HPARAM_METRICS = ("train/loss", "eval/loss")


def _missing(flag: str, package: str) -> ConfigError:
    return ConfigError(f"{flag} needs the {package} package: pip install 'shoal[logs]'")


def _code_block(text: str) -> str:
    """Indented: TensorBoard renders text as markdown, which would eat a JSON line's underscores."""
    return "\n".join("    " + line for line in text.splitlines())


class TensorBoardLog(ExperimentLog):
    """Event files in ``directory/<run_id>/<peer_id>/``: ``tensorboard --logdir directory`` shows
    every peer (of every run) that logged there as its own run, side by side."""

    def __init__(self, directory: Path, peer_id: str, run_id: str) -> None:
        self.path = Path(directory) / run_id / peer_id
        super().__init__(f"TensorBoard log {self.path}")
        try:
            import tensorboard  # noqa: F401  (torch's writer needs it, and says so less plainly)
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
        except ImportError:
            raise _missing("--tensorboard", "tensorboard") from None
        self._hparams = hparams
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            # flush_secs: a live run shows up within seconds, not torch's default two minutes.
            self._writer = SummaryWriter(log_dir=str(self.path), flush_secs=10)
        except OSError as e:
            raise ConfigError(f"--tensorboard {directory}: cannot write {self.path} ({e.strerror or e}); "
                              "pass a writable directory") from None
        self._session_end: Any = None  # the hparams session's end marker, written at close

    def _write_config(self, config: dict[str, Any]) -> None:
        self._writer.add_text("config", _code_block(json.dumps(config, indent=2, sort_keys=True, default=str)), 0)
        # The hparams tab, in this run's own directory (SummaryWriter.add_hparams would start another run).
        experiment, session_start, self._session_end = self._hparams(
            flat_config(config), dict.fromkeys(_HPARAM_METRICS, 0.0))
        self._writer.file_writer.add_summary(experiment)
        self._writer.file_writer.add_summary(session_start)

    def _write_scalars(self, scalars: dict[str, float], step: int, walltime: float | None) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step, walltime=walltime)

    def _write_text(self, tag: str, text: str, step: int) -> None:
        self._writer.add_text(tag, _code_block(text), step)

    def _close(self) -> None:
        if self._session_end is not None:
            self._writer.file_writer.add_summary(self._session_end)
            self._session_end = None
        self._writer.close()


class WandbLog(ExperimentLog):
    """One W&B run per peer: named by the peer id, grouped by the run id, so a swarm's peers sit
    together in the project. Every chart's x-axis is the round.

    ``WANDB_MODE=offline`` (or ``wandb offline``) writes the run under ``./wandb`` (or
    ``$WANDB_DIR``) for ``wandb sync`` later. Online without credentials is refused up front: wandb
    would otherwise ask for a key on the terminal, or leave a headless node waiting.
    """

    def __init__(self, project: str, peer_id: str, run_id: str) -> None:
        super().__init__(f"W&B run {project}/{peer_id}")
        try:
            import wandb
        except ImportError:
            raise _missing("--wandb", "wandb") from None
        settings = wandb.setup().settings  # wandb's own resolution: env, settings files, `wandb offline`
        if settings.mode == "disabled":
            self.disabled = True
            logger.info(f"{self.label}: W&B is disabled (WANDB_MODE=disabled); nothing is logged there")
            return
        self.offline = settings.mode in ("offline", "dryrun")
        if not self.offline and not _has_credentials(wandb, settings):
            raise ConfigError("--wandb: no W&B API key found; run `wandb login` (or set WANDB_API_KEY), or set "
                              "WANDB_MODE=offline to log locally and `wandb sync` the run later")
        try:
            self._run = wandb.init(
                project=project, name=peer_id, group=run_id, job_type="peer",
                config={"peer_id": peer_id, "run_id": run_id},
                reinit="create_new",  # several peers in one process (tests, the library API): a run each
                # console="off": wandb must not wrap stdout under the live dashboard.
                settings=wandb.Settings(console="off", quiet=True))
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:
            raise ConfigError(f"--wandb {project}: {e}") from None
        except Exception as e:  # W&B unreachable: the run trains without it
            self.disabled = True
            logger.warning(f"{self.label}: {type(e).__name__}: {e}; training goes on without W&B")
            return
        self._run.define_metric("round")
        for prefix in TAG_PREFIXES:
            self._run.define_metric(f"{prefix}/*", step_metric="round")
        if self.offline:
            where = self._run.settings.sync_dir
            logger.info(f"{self.label}: offline, in {where}; upload it with `wandb sync {where}`")
        else:
            logger.info(f"{self.label}: {self._run.url}")

    def _write_config(self, config: dict[str, Any]) -> None:
        self._run.config.update(config, allow_val_change=True)

    def _write_scalars(self, scalars: dict[str, float], step: int, walltime: float | None) -> None:
        # No step= here: W&B's own step must only grow, and "round" is what the charts plot against.
        self._run.log({**scalars, "round": step})

    def _close(self) -> None:
        self._run.finish()


def _has_credentials(wandb: Any, settings: Any) -> bool:
    """Whether wandb would find credentials without asking: env, .netrc or its settings files.

    Asks wandb's own lookup (no prompt, no network) where this wandb has it.
    """
    try:
        from wandb.sdk.lib.wbauth import authenticate_session
    except ImportError:  # a wandb that moved it: the places wandb 0.31 reads
        netrc = Path(os.environ.get("NETRC") or "~/.netrc").expanduser()
        return bool(os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE")
                    or settings.api_key or netrc.exists())
    try:
        return authenticate_session(host=settings.base_url, source="shoal", prompt=False,
                                    update_session=False) is not None
    except wandb.errors.AuthenticationError as e:  # a key that is there but malformed
        raise ConfigError(f"--wandb: {e}; run `wandb login --relogin`") from None

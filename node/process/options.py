"""Per-process options of ``shoal run``: how this peer connects and where it writes.

Not shared with the run (that is ``RunConfig``). Kept free of torch and hivemind imports: the CLI
builds it before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(kw_only=True, slots=True)
class PeerOptions:
    """What ``shoal run``'s flags say about this process (each field is one flag)."""

    initial_peers: list[str] = field(default_factory=list)  # --initial-peer (validated multiaddrs)
    listen: list[str] = field(default_factory=list)  # --listen
    announce: list[str] = field(default_factory=list)  # --announce
    max_rounds: int | None = None  # --max-rounds: leave after this global round
    checkpoint_dir: Path | None = None  # --checkpoint-dir
    metrics_file: Path | None = None  # --metrics-file
    ui: bool = True  # live panel (else plain log lines)
    bootstrap_timeout: float = 30.0  # --bootstrap-timeout
    identity: Path | None = None  # --identity
    client_mode: bool = False  # --client-mode
    use_relay: bool = False  # --use-relay
    metrics_port: int | None = None  # --metrics-port
    metrics_host: str = "127.0.0.1"  # --metrics-host
    run_key: bytes | None = None  # --run-key: the organiser key whose manifests this peer follows
    swarm_key: bytes | None = None  # --swarm-key FILE's contents: a private swarm's admission key
    tensorboard: Path | None = None  # --tensorboard DIR: TensorBoard event files of the round records
    wandb_project: str | None = None  # --wandb PROJECT: a Weights & Biases run of the round records

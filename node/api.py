"""The library: DiLoCo over a shoal swarm for your own model and training loop. Import from here.

    from node.api import DiLoCoSwarm, RoundConfig, AveragingConfig, OuterConfig

    swarm = DiLoCoSwarm(model, run_id="my-run", initial_peers=[...],     # before model.cuda() if you can
                        rounds=RoundConfig(seconds=60))
    model.cuda(); opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    swarm.start()
    while swarm.round <= 100:
        t0 = time.perf_counter()
        loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
        for finished in swarm.step(tokens=x.numel(), seconds=time.perf_counter() - t0, loss=loss.item()):
            print(finished.round, finished.group_size, finished.applied)
    swarm.save_checkpoint("checkpoints/")
    swarm.close()

To average the inner optimizer's moments with every round (``averaging.average_inner_state``):
plan them before the optimizer exists, bind it once it does (the averager needs their size first)::

    inner = InnerStateSync(model)                    # AdamW's moments; muon=[...] for Muon's params
    swarm = DiLoCoSwarm(model, ..., averaging=AveragingConfig(average_inner_state=True), inner_state=inner)
    model.cuda(); opt = torch.optim.AdamW(model.parameters(), lr=3e-4); inner.bind([opt])

Everything here is the public surface: ``shoal run`` itself uses nothing else of ``node.library``.
"""

from __future__ import annotations

from averaging.engine.config import SyncMode
from averaging.engine.inner_sync import InnerStateSync
from averaging.engine.policy import round_advice
from averaging.engine.stats import RoundStats
from averaging.math.outer_step import OuterConfig
from averaging.state.verdict import Applied
from node.library.bootstrap import expand_initial_peers
from node.library.config import AveragingConfig, RoundConfig
from node.library.network import Network
from node.library.shards import choose_shard
from node.library.swarm import DiLoCoSwarm, Heartbeat, LiveRound, Resumed
from protocols.errors import AddressError, CheckpointError, ConfigError, NetworkError, ShoalError
from protocols.progress import ProgressRecord

__all__ = [
    "AddressError",
    "Applied",
    "AveragingConfig",
    "CheckpointError",
    "ConfigError",
    "InnerStateSync",
    "DiLoCoSwarm",
    "Heartbeat",
    "LiveRound",
    "Network",
    "NetworkError",
    "OuterConfig",
    "ProgressRecord",
    "Resumed",
    "RoundConfig",
    "RoundStats",
    "ShoalError",
    "SyncMode",
    "choose_shard",
    "expand_initial_peers",
    "round_advice",
]

"""The shoal node. Layers, each importing only the ones below it (tests/unit/test_layers.py):

    commands  (node.cli, node.commands)          the `shoal` CLI, one module per command
    process   (node.process)                     one `shoal run` process: config, lifecycle, signals
    training  (node.training) | observe (node.observe)   model, data, inner steps | view, metrics, exporter
    library   (node.library, node.api)           DiLoCoSwarm: DHT, run record, peer monitor, checkpoints
    averaging (averaging)                        pseudo-gradients, outer step, background sync
    protocols (protocols)                        what crosses the network, validated

Library users import ``node.api``.
"""

# Before anything below imports hivemind: its averager imports scipy.optimize, which shoal never
# calls (node.library.deferred_imports; SHOAL_DEFER_IMPORTS=0 turns it off).
import os  # noqa: E402

from node.library.deferred_imports import defer_unused_imports  # noqa: E402

if os.environ.get("SHOAL_DEFER_IMPORTS", "1") != "0":
    defer_unused_imports()

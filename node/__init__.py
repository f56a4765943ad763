"""The shoal node. Layers, each importing only the ones below it (tests/unit/test_layers.py):

    commands  (node.cli, node.commands)          the `shoal` CLI, one module per command
    process   (node.process)                     one `shoal run` process: config, lifecycle, signals
    training  (node.training) | observe (node.observe)   model, data, inner steps | view, metrics, exporter
    library   (node.library, node.api)           DiLoCoSwarm: DHT, run record, peer monitor, checkpoints
    averaging (averaging)                        pseudo-gradients, outer step, background sync
    protocols (protocols)                        what crosses the network, validated

Library users import ``node.api``.
"""

"""The library layer behind `node.api`: DiLoCoSwarm, the DHT, the run record, the peer monitor,
checkpoints and process/socket clean-up. Never imports the CLI, the process or the observers."""

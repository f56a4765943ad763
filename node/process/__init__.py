"""One `shoal run` process: its config, its lifecycle (build, train, close) and its signals."""

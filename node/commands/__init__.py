"""The `shoal` commands, one module each; `node.cli` registers them."""

"""shoal: node."""

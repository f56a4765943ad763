"""shoal: averaging."""

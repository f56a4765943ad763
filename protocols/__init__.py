"""shoal: protocols."""

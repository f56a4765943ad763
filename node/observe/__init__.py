"""What people and tools see: the live view, the metrics file, the Prometheus exporter, plots."""

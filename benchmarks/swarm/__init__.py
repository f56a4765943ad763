"""Real swarms: ``shoal run`` peers, entry peers and DDP ranks as processes on this machine (loopback, or
network namespaces with capped links when run as root)."""

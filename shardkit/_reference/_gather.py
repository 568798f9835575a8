"""Pure-Python twin of shardkit._kernels._gather."""

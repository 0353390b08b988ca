"""trainjobs data plane: the RQ worker, the supervisor and (under train/) the torchrun runtime."""

"""trainjobs control plane: API, database, queue and CLI. Never imports torch or worker/."""

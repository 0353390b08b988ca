"""The training runtime; runs inside torchrun: `python -m worker.train RUN_DIR`."""

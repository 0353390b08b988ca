"""trainjobs: run PyTorch training jobs on a shared pool. What users, the CLI, the service and the ranks share.

    from trainjobs import report, summary        # inside a training script (no torch, no network)
    from trainjobs import Client, JobSpec        # anywhere: the SDK and the job's contract

Light by rule: pydantic and httpx, never SQLAlchemy or torch (tests/test_layout.py). A training rank
imports the reporter alone; Client and JobSpec load on first use.
"""

from trainjobs.checkpoints import checkpoint_path, complete_checkpoint, latest_checkpoint
from trainjobs.reporting import artifacts_dir, checkpoint_dir, report, summary

__all__ = ["APIError", "Client", "JobSpec", "artifacts_dir", "checkpoint_dir", "checkpoint_path", "complete_checkpoint",
           "latest_checkpoint", "report", "summary"]

_LAZY = {"Client": "trainjobs.client", "APIError": "trainjobs.client", "JobSpec": "trainjobs.spec"}


def __getattr__(name: str):
    """Client and JobSpec on first use, so a rank's `from trainjobs import report` loads neither httpx nor pydantic."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainjobs' has no attribute {name!r}")

"""Kept for scripts written before the public package: `from worker.report import report` still works.

New scripts write `from trainjobs import report, summary` (trainjobs/reporting.py).
"""

from trainjobs.reporting import artifacts_dir, checkpoint_dir, report, summary

__all__ = ["artifacts_dir", "checkpoint_dir", "report", "summary"]

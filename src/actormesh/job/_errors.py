"""Errors of the job layer."""

from __future__ import annotations

__all__ = ["JobError"]


class JobError(RuntimeError):
    """Hosts could not be allocated or reached: a scheduler refused the job, it
    did not start in time, or host agents did not join. The message names the
    job, the hosts concerned and what to do."""

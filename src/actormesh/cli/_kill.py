"""``actormesh kill``: release the applied job (Monarch's ``monarch kill``)."""

from __future__ import annotations

import os

import click


@click.command("kill")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="seconds to wait for the keeper to release the job before killing it")
def command(timeout_s: float) -> None:
    """Kill the job applied in this directory and stop its keeper.

    If the keeper is gone but left the job's cached state
    (.actormesh/applied/job_state.pkl), the job is killed from that.
    """
    from ..job import APPLIED_DIR, applied_job, job_load
    from ._hosts import applied_or_fail

    job = applied_job()
    if job is None:
        cached = os.path.join(APPLIED_DIR, "job_state.pkl")
        if os.path.exists(cached):
            stale = job_load(cached)
            stale.kill()
            for name in ("job_state.pkl", "record.json", "credentials", "request.json"):
                try:
                    os.unlink(os.path.join(APPLIED_DIR, name))
                except FileNotFoundError:
                    pass
            click.echo(f"killed {stale!r} (from its cached state: its keeper was gone)")
            return
        applied_or_fail()  # raises, saying what to do
        return
    job.kill_timeout_s = timeout_s
    what = job.record.get("job")
    job.kill()
    click.echo(f"killed {what}")

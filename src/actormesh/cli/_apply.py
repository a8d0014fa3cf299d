"""``actormesh apply``: apply a job and hold it in the background (Monarch's ``monarch apply``)."""

from __future__ import annotations

import os
import sys

import click


def _as_current_spec(target: str, attr: str | None) -> str | None:
    """``module.attribute`` for ``set_current_job`` when the job file is importable from here."""
    if not target.endswith(".py"):
        return target
    rel = os.path.relpath(os.path.abspath(target), os.getcwd())
    parts = rel[:-3].split(os.sep)
    if rel.startswith("..") or not all(p.isidentifier() for p in parts):
        return None
    return ".".join([*parts, attr or "job"])


@click.command("apply")
@click.argument("target")
@click.option("--attr", help="the attribute of the job file that holds the job (default: job)")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=300.0, show_default=True,
              help="seconds to wait for every host to be up")
def command(target: str, attr: str | None, timeout_s: float) -> None:
    """Apply the job TARGET describes, hold it in the background, make it current.

    TARGET is a Python file that defines `job` (a Job such as
    ProcessJob({"trainers": 2}), or a function returning one; --attr names
    another attribute), or 'package.module.attribute'. A keeper process
    applies it and holds the hosts until `actormesh kill`; later commands
    (info, exec, sync, shell) and scripts calling load_current_job() in this
    directory use it. Applying the same job again is a no-op.
    """
    from ..job import JobError, applied_job, load_job, set_current_job, start_keeper
    from ._hosts import hosts_table

    running = applied_job()
    request = {"target": os.path.abspath(target) if target.endswith(".py") else target, "attr": attr}
    if running is not None:
        held = {"target": running.record.get("target"), "attr": running.record.get("attr")}
        if held != request:
            raise click.ClickException(f"{running.record.get('job')} from {held['target']} is already applied here; "
                                       "run `actormesh kill` first to apply another job")
        click.echo("already applied (a no-op):", err=True)
        _print(hosts_table(running.record))
        return
    sys.path.insert(0, os.getcwd())
    try:
        load_job(target, attr)  # fail here, with the file's own error, before a keeper starts
        record = start_keeper(request, timeout_s=timeout_s)
    except JobError as exc:
        raise click.ClickException(str(exc)) from None
    spec = _as_current_spec(target, attr)
    if spec is not None:
        try:
            set_current_job(spec)
        except Exception as exc:  # the job is applied; only the fallback record could not be made
            click.echo(f"note: could not record {spec} as the current job: {exc}", err=True)
    _print(hosts_table(record))


def _print(renderable: object) -> None:
    from rich.console import Console

    Console().print(renderable)

"""``actormesh debug``: the debug console of a running controller, in this terminal.

It finds the controller through its job directory (``$TMPDIR/actormesh-*``,
this user's only) where the debug controller listens on ``debug.sock``, and
authenticates with the console key beside it (docs/debugging.md).
"""

from __future__ import annotations

import click


@click.command("debug")
@click.option("--pid", type=int, help="the controller's process id (when several controllers run)")
@click.option("--job-dir", type=click.Path(file_okay=False), help="the controller's job directory (instead of --pid)")
@click.option("--connect-timeout", type=float, default=10.0, show_default=True, help="seconds to connect and authenticate")
def command(pid: int | None, job_dir: str | None, connect_timeout: float) -> None:
    """Attach to the debug console of a running controller: list, attach, cast, continue, quit."""
    from ..config import get_config
    from ..debug import DebugClientError, find_debug_servers, run_client

    if job_dir is None:
        servers = find_debug_servers()
        if pid is not None:
            servers = [s for s in servers if s.pid == pid]
        if not servers:
            which = f"controller pid {pid}" if pid is not None else "running controller of yours"
            raise click.ClickException(
                f"no {which} has a debug console to attach to; one starts at the first breakpoint() in an actor, "
                "or when the script calls debug_controller()")
        if len(servers) > 1:
            rows = "\n".join(f"  --pid {s.pid}: {s.command}" for s in servers)
            raise click.UsageError(f"several controllers have a debug console; choose one:\n{rows}")
        job_dir = servers[0].job_dir
    idle = get_config().debug_attach_timeout + 30.0
    try:
        code = run_client(job_dir, connect_timeout_s=connect_timeout, idle_timeout_s=idle)
    except DebugClientError as exc:
        raise click.ClickException(str(exc)) from exc
    raise click.exceptions.Exit(code)

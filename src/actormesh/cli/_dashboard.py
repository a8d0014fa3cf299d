"""``actormesh dashboard``: run a script with the dashboard on, or show running dashboards.

``actormesh dashboard train.py --epochs 3`` runs ``python train.py --epochs 3``
with ``ACTORMESH_DASHBOARD_PORT`` set, so its controller serves the page.
Without a script it lists this user's running dashboards on this machine
(URLs only; a token is never printed) and ``--open`` opens one in a browser.
"""

from __future__ import annotations

import os
import subprocess
import sys

import click

__all__ = ["command"]


@click.command("dashboard", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--port", type=int, default=8265, show_default=True, help="port for the script's dashboard")
@click.option("--host", default="127.0.0.1", show_default=True, help="interface to bind (not loopback: the job's token is required)")
@click.option("--open", "open_browser", is_flag=True, help="open the dashboard in a web browser")
@click.argument("script", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def command(port: int, host: str, open_browser: bool, script: str | None, args: tuple[str, ...]) -> None:
    """Run SCRIPT [ARGS] with the dashboard on, or list the running dashboards."""
    if script is None:
        _list(open_browser)
        return
    if not os.path.exists(script):
        raise click.UsageError(f"no script {script!r}: give a Python file to run with the dashboard on")
    if not 0 < port < 65536:
        raise click.UsageError(f"--port {port} is not a TCP port (1-65535)")
    env = dict(os.environ, ACTORMESH_DASHBOARD_PORT=str(port), ACTORMESH_DASHBOARD_HOST=host)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"actormesh dashboard: http://{shown}:{port}/ while {script} runs", err=True)
    if open_browser:
        import webbrowser

        webbrowser.open(f"http://{shown}:{port}/")
    raise click.exceptions.Exit(subprocess.call([sys.executable, script, *args], env=env))


def _list(open_browser: bool) -> None:
    from ..dashboard import find_dashboards

    found = find_dashboards()
    if not found:
        raise click.ClickException("no running actormesh dashboard found for this user on this machine; "
                                   "run a script with `actormesh dashboard script.py` or configure(dashboard_port=8265)")
    for d in sorted(found, key=lambda d: d["url"]):
        note = "  (needs the job's token: see docs/dashboard.md)" if d.get("token") else ""
        click.echo(f"{d['url']}  pid {d['pid']}{note}")
    if open_browser:
        import webbrowser

        webbrowser.open(found[0]["url"])

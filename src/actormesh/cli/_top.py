"""``actormesh top``: the dashboard's view in a terminal (rich), for machines without a browser.

It reads the controller's dashboard JSON API (``/api/state``): the controller
must serve one (``configure(dashboard_port=...)`` or ``actormesh dashboard
script.py``). Without ``--url`` it finds this user's running controller on
this machine through its job directory.
"""

from __future__ import annotations

import time
from typing import Any

import click

__all__ = ["command", "render"]


def _fmt(x: Any, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def render(state: dict[str, Any], max_actors: int = 60) -> Any:
    """A rich renderable of the job's state: totals, failures, procs with their actors."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    t = state.get("totals", {})
    head = Text(f"actormesh top  ·  {t.get('hosts', 0)} hosts  {t.get('procs', 0)} procs  {t.get('actors', 0)} actors  "
                f"{t.get('failed', 0)} failed  ·  v{state.get('version', 0)}", style="bold")
    parts: list[Any] = [head]
    for f in state.get("failures", [])[:5]:
        cause = (f.get("cause") or "").strip().splitlines()
        parts.append(Panel("\n".join(cause[-6:]), title=" → ".join(f["path"]), border_style="red", title_align="left"))
    procs = Table(title="procs", title_justify="left", expand=True)
    for col in ("host", "proc", "pid", "status", "RSS MB", "CPU %", "out msg/s"):
        procs.add_column(col, justify="right" if col in ("pid", "RSS MB", "CPU %", "out msg/s") else "left")
    actors = Table(title="actors", title_justify="left", expand=True)
    for col in ("actor", "status", "msg/s", "latency ms", "p99 ms", "mailbox", "handled", "errors", "restarts"):
        actors.add_column(col, justify="left" if col in ("actor", "status") else "right")
    shown = 0
    for host in state.get("hosts", []):
        for p in host["procs"]:
            style = "green" if p["status"] == "running" else "red"
            rss = None if p["rss_bytes"] is None else p["rss_bytes"] / 1e6
            procs.add_row(host["hostname"], p["name"], str(p["pid"]), Text(p["status"], style=style), _fmt(rss, 0), _fmt(p["cpu_pct"], 0), _fmt(p["msgs_out_per_s"]))
            for a in p["actors"]:
                if shown >= max_actors:
                    continue
                shown += 1
                astyle = {"running": "green", "failed": "bold red"}.get(a["status"], "dim")
                actors.add_row(a["display"], Text(a["status"], style=astyle), _fmt(a["msgs_per_s"]), _fmt(a["latency_ms"], 3),
                               _fmt(a["p99_ms"], 2), str(a["mailbox"]), str(a["messages_in"]), str(a["errors"]), str(a["restarts"]))
    parts += [procs, actors]
    if shown < t.get("actors", 0):
        parts.append(Text(f"... {t['actors'] - shown} more actors (--max-actors)", style="dim"))
    logs = state.get("logs", [])[-8:]
    if logs:
        parts.append(Panel("\n".join(logs), title="log tail", title_align="left"))
    return Group(*parts)


@click.command("top")
@click.option("--url", help="the dashboard's URL (default: this user's running controller on this machine)")
@click.option("--token", help="the job's dashboard token, for a dashboard off loopback (or ACTORMESH_DASHBOARD_TOKEN)")
@click.option("--interval", type=float, default=1.0, show_default=True, help="seconds between refreshes")
@click.option("--once", is_flag=True, help="print the state once and exit")
@click.option("--max-actors", type=int, default=60, show_default=True, help="actor rows to show")
def command(url: str | None, token: str | None, interval: float, once: bool, max_actors: int) -> None:
    """Live view of a running job: hosts, procs, actors, failures, log tail."""
    from rich.console import Console
    from rich.live import Live

    from ..dashboard import DashboardNotFound, fetch_state, locate

    try:
        base, tok = locate(url, token)
        state = fetch_state(base, tok)
    except DashboardNotFound as exc:
        raise click.ClickException(str(exc)) from None
    console = Console()
    if once:
        console.print(render(state, max_actors))
        return
    with Live(render(state, max_actors), console=console, refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(max(0.1, interval))
                try:
                    live.update(render(fetch_state(base, tok), max_actors))
                except DashboardNotFound as exc:
                    live.update(f"[red]{exc}[/red]")
        except KeyboardInterrupt:
            pass

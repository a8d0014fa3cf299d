"""``actormesh info``: the applied job's hosts."""

from __future__ import annotations

import json

import click


@click.command("info")
@click.option("--json", "as_json", is_flag=True, help="print the job's record as JSON")
def command(as_json: bool) -> None:
    """Show the job applied in this directory: its meshes, hosts and agents."""
    from rich.console import Console

    from ._hosts import applied_or_fail, hosts_table

    job = applied_or_fail()
    if as_json:
        click.echo(json.dumps(job.record, indent=1))
    else:
        Console().print(hosts_table(job.record))

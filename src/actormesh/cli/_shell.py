"""``actormesh shell``: an interactive shell on one host of the current job."""

from __future__ import annotations

import click


@click.command("shell")
@click.option("--job", "job_spec", help="module.attribute of the job (default: the current job, see set_current_job)")
@click.option("--mesh", help="host mesh name (default: the job's first)")
@click.option("--host", type=int, default=0, show_default=True, help="host index in that mesh")
@click.option("--workdir", help="working directory on the host (default: this one, if it exists there)")
def command(job_spec: str | None, mesh: str | None, host: int, workdir: str | None) -> None:
    """Open an interactive shell on host HOST of mesh MESH of the current job."""
    from ..job import job_from_spec, load_current_job, shell

    job = job_from_spec(job_spec) if job_spec else load_current_job()
    state = job.state()
    names = state.names()
    mesh = mesh or (names[0] if names else None)
    if mesh is None or mesh not in state:
        raise click.UsageError(f"the job has no mesh {mesh!r}; it has {', '.join(names) or 'none'}")
    hosts = state[mesh]
    if not 0 <= host < hosts.size():
        raise click.UsageError(f"--host {host} is out of range: mesh {mesh!r} has {hosts.size()} hosts")
    target = hosts.slice(hosts=host) if "hosts" in hosts.extent else hosts
    raise click.exceptions.Exit(shell(target, workdir=workdir))

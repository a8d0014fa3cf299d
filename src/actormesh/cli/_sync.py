"""``actormesh sync``: ship directories to every host of the applied job (HostMesh.sync_workspace)."""

from __future__ import annotations

import click


@click.command("sync")
@click.argument("paths", nargs=-1, type=click.Path(exists=True, file_okay=False))
@click.option("--mesh", "meshes", multiple=True, help="only this mesh's hosts (repeatable; default: every mesh)")
@click.option("--dest", help="workspace root on the hosts (default: each host's ACTORMESH_WORKSPACE_DIR or a temp dir)")
def command(paths: tuple[str, ...], meshes: tuple[str, ...], dest: str | None) -> None:
    """Sync PATHS (default: this directory) to the hosts of the current job.

    Only files whose content changed travel; each directory is swapped in
    atomically on each host. Procs started afterwards import from it.
    """
    from ._exec import _current_job

    state = _current_job().state()
    names = list(meshes) or state.names()
    unknown = [m for m in names if m not in state]
    if unknown:
        raise click.BadParameter(f"the job has no mesh {unknown[0]!r}; its meshes are {', '.join(state.names())}", param_hint="--mesh")
    done: set[str] = set()
    for name in names:
        report = state[name].sync_workspace(list(paths) or ["."], dest=dest).get(timeout=600)
        for host, where in report.paths.items():
            if host in done:
                continue
            done.add(host)
            changed = sum(len(v) for v in report.changed.values())
            click.echo(f"{name} {host}: {', '.join(where.values())} ({changed} paths changed)")
        click.echo(f"{name}: sent {report.files_sent} files, {report.bytes_sent} bytes")

"""``actormesh`` console script: ``actormesh shell`` (an interactive shell on a job host).

``actormesh shell [--job module.attr] [--mesh NAME] [--host I] [--workdir DIR]``
uses the project's current job (``set_current_job``) unless ``--job`` names
one, applies it if needed, and opens a shell on host ``I`` (default 0) of mesh
``NAME`` (default: the job's first mesh).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``actormesh`` console script."""
    ap = argparse.ArgumentParser(prog="actormesh", description="actormesh command line")
    sub = ap.add_subparsers(dest="command", required=True)
    sh = sub.add_parser("shell", help="interactive shell on one host of the current job")
    sh.add_argument("--job", help="module.attribute of the job (default: the current job, see set_current_job)")
    sh.add_argument("--mesh", help="host mesh name (default: the job's first)")
    sh.add_argument("--host", type=int, default=0, help="host index in that mesh (default 0)")
    sh.add_argument("--workdir", help="working directory on the host (default: this one, if it exists there)")
    args = ap.parse_args(argv)
    from ._current import _import_spec, load_current_job
    from ._shell import shell

    job = _import_spec(args.job) if args.job else load_current_job()
    state = job.state()
    names = state.names()
    mesh = args.mesh or (names[0] if names else None)
    if mesh not in state:
        ap.error(f"the job has no mesh {mesh!r}; it has {', '.join(names) or 'none'}")
    hosts = state[mesh]
    if not 0 <= args.host < hosts.size():
        ap.error(f"--host {args.host} is out of range: mesh {mesh!r} has {hosts.size()} hosts")
    target = hosts.slice(hosts=args.host) if "hosts" in hosts.extent else hosts
    return shell(target, workdir=args.workdir)


if __name__ == "__main__":
    sys.exit(main())

"""The ``actormesh`` console script: one click group, subcommands loaded lazily.

Each subcommand lives in its own module as a ``click.Command`` named ``command``;
``SUBCOMMANDS`` maps the name a user types to ``"module:attribute"``. Loading is
lazy so that ``actormesh --help`` does not import torch, FastAPI or the runtime.

Example::

    $ actormesh --help
    $ actormesh apply job.py
    $ actormesh exec trainers -- hostname
    $ actormesh shell --host 1
    $ actormesh kill
"""

from __future__ import annotations

import importlib
import os
import sys

import click

#: subcommand name -> (module path, attribute, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "shell": ("actormesh.cli._shell", "command", "interactive shell on one host of the current job"),
    "apply": ("actormesh.cli._apply", "command", "apply a job (job.py or module.attr) and hold it in the background"),
    "info": ("actormesh.cli._info", "command", "the applied job's meshes and hosts"),
    "kill": ("actormesh.cli._kill", "command", "kill the applied job"),
    "exec": ("actormesh.cli._exec", "command", "run a command on hosts of the job, streaming output"),
    "sync": ("actormesh.cli._sync", "command", "sync directories to the job's hosts"),
    "debug": ("actormesh.cli._debug", "command", "debug console of a running controller (breakpoint() in actors)"),
    "top": ("actormesh.cli._top", "command", "live view of a running job in the terminal"),
    "dashboard": ("actormesh.cli._dashboard", "command", "run a script with the web dashboard on, or list running dashboards"),
    "serve": ("actormesh.serve.__main__", "command", "serve a Hugging Face model directory over OpenAI's API"),
}


class _LazyGroup(click.Group):
    """A click group whose subcommands are imported only when used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = SUBCOMMANDS.get(cmd_name)
        if spec is None:
            return None
        module, attr, _ = spec
        cmd = getattr(importlib.import_module(module), attr)
        if not isinstance(cmd, click.Command):
            raise TypeError(f"{module}.{attr} is not a click command")
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listing help must not import every subcommand's module.
        rows = [(name, SUBCOMMANDS[name][2]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """actormesh command line: jobs, shells, debugging and monitoring."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``actormesh`` console script; returns the exit code."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as with ``python -m``: the project's modules (its jobs) import
    try:
        # With standalone_mode off, click returns a command's Exit code instead of exiting.
        rv = cli.main(args=argv, prog_name="actormesh", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return int(exc.exit_code or 0)
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())

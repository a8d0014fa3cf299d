"""``actormesh exec SELECTOR -- CMD``: run a command on hosts of the current job and
stream its output, each line prefixed with the host it came from."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import click

from ..runtime import Actor, Port, endpoint


class LineRunner(Actor):
    """Runs one command in its proc, sending every output line to a port."""

    @endpoint
    def run(self, argv: list[str], env: dict[str, str], workdir: str, required: bool, out: Port[Any], label: str,
            timeout_s: float | None) -> int:
        """Run ``argv`` in ``workdir`` (if it exists here; ``required``: else fail); send
        ``(label, stream, line)`` per output line, then ``(label, "exit", code)``."""
        if not os.path.isdir(workdir):
            if required:
                raise FileNotFoundError(f"--workdir {workdir} does not exist on this host")
            workdir = None  # type: ignore[assignment]
        try:
            child = subprocess.Popen(argv, cwd=workdir, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            out.send((label, "stderr", f"cannot start {argv[0]!r}: {exc}"))
            out.send((label, "exit", 127))
            return 127

        def pump(pipe: Any, stream: str) -> None:
            for raw in iter(pipe.readline, b""):
                out.send((label, stream, raw.decode(errors="replace").rstrip("\n")))
            pipe.close()

        pumps = [threading.Thread(target=pump, args=(child.stdout, "stdout")), threading.Thread(target=pump, args=(child.stderr, "stderr"))]
        for t in pumps:
            t.start()
        try:
            code = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            code = child.wait(timeout=10)
            out.send((label, "stderr", f"killed after --timeout {timeout_s}s"))
        for t in pumps:
            t.join(timeout=10)
        out.send((label, "exit", code))
        return code


def _parse_env(pairs: tuple[str, ...]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--env")
        env[key] = value
    return env


@click.command("exec", context_settings={"ignore_unknown_options": False})
@click.argument("selector")
@click.argument("cmd", nargs=-1, required=True)
@click.option("-e", "--env", "env_pairs", multiple=True, metavar="KEY=VALUE", help="set an environment variable (repeatable)")
@click.option("--workdir", help="working directory on the hosts (default: this one where it exists, else the proc's)")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), help="kill the command after this many seconds")
def command(selector: str, cmd: tuple[str, ...], env_pairs: tuple[str, ...], workdir: str | None, timeout_s: float | None) -> None:
    """Run CMD on the hosts SELECTOR names and stream the output.

    SELECTOR: all, MESH, MESH[i], MESH[i:j], MESH[i,j], or several joined by
    commas (e.g. trainers[0],eval). Put -- before CMD when it has options:

        actormesh exec trainers[0] -- nvidia-smi -L

    Each output line is prefixed with [MESH/HOST]. The exit status is the
    largest of the hosts' exit statuses.
    """
    from ._hosts import parse_selector

    env = _parse_env(env_pairs)
    job = _current_job()
    state = job.state()
    sizes = {name: state[name].size() for name in state.names()}
    try:
        chosen = parse_selector(selector, sizes)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="SELECTOR") from None
    raise click.exceptions.Exit(_run(state, chosen, list(cmd), env, workdir, timeout_s))


def _current_job() -> Any:
    from ..job import JobError, load_current_job

    try:
        return load_current_job()
    except (FileNotFoundError, JobError) as exc:
        raise click.ClickException(str(exc)) from None


def _run(state: Any, chosen: list[tuple[str, int]], cmd: list[str], env: dict[str, str], workdir: str | None, timeout_s: float | None) -> int:
    from ..runtime import Channel

    port, receiver = Channel.open()
    procs, calls = [], []
    try:
        for mesh, index in chosen:
            hosts = state[mesh]
            view = hosts.slice(hosts=index) if "hosts" in hosts.extent else hosts
            pm = view.spawn_procs(name="exec")
            procs.append(pm)
            runner = pm.spawn("exec_lines", LineRunner)
            calls.append((f"{mesh}/{index}", runner.run.call_one(cmd, env, workdir or os.getcwd(), workdir is not None, port, f"{mesh}/{index}", timeout_s)))
        return _stream(receiver, calls)
    finally:
        for pm in procs:
            try:
                pm.stop().get(timeout=60)
            except Exception as exc:
                click.echo(f"warning: stopping an exec proc: {exc}", err=True)


def _stream(receiver: Any, calls: list[tuple[str, Any]]) -> int:
    """Print lines until every host reported its exit (or its call failed); return the largest status."""
    codes: dict[str, int] = {}
    pending = receiver.recv()
    while len(codes) < len(calls):
        try:
            label, stream, value = pending.get(timeout=0.5)
        except TimeoutError:
            for label, fut in calls:
                if label not in codes and fut.done():
                    try:
                        fut.get(timeout=0)
                    except Exception as exc:
                        click.echo(f"[{label}] failed: {exc}", err=True)
                        codes[label] = 255
            continue
        pending = receiver.recv()
        if stream == "exit":
            codes[label] = int(value)
            if value:
                click.echo(f"[{label}] exited with status {value}", err=True)
        else:
            click.echo(f"[{label}] {value}", err=stream == "stderr")
            sys.stdout.flush()
    return max(codes.values(), default=0)

"""The console's behaviour against scripted sessions (no job, no pdb): every wait is bounded."""

from __future__ import annotations

import asyncio
import re
from typing import Optional

from actormesh.debug import SessionInfo
from actormesh.debug._commands import RESUME
from actormesh.debug._console import Console, Session


class ScriptedIO:
    """A person who types ``lines`` in order (then leaves) and whose screen is ``out``."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = list(lines)
        self.out: list[str] = []

    async def read_line(self, prompt: str) -> Optional[str]:
        self.out.append(prompt)
        return self.lines.pop(0) if self.lines else None

    async def write(self, text: str) -> None:
        self.out.append(text)

    @property
    def screen(self) -> str:
        return "".join(self.out)


class FakePdb:
    """Stands in for a paused actor's inbox port: answers commands like pdb would, or never (``silent``)."""

    def __init__(self, silent: frozenset[str] = frozenset()) -> None:
        self.session: Optional[Session] = None
        self.silent = silent
        self.received: list[str] = []

    def send(self, line: str) -> None:
        self.received.append(line)
        if line in self.silent:
            return
        assert self.session is not None
        if line in (RESUME, "c"):
            asyncio.ensure_future(self.session.on_end())
        else:
            asyncio.ensure_future(self.session.on_output(f"ran {line}\n(Pdb) ", True, "step", "/x/t.py", 7))


def make_session(actor: str, rank: int, pdb: FakePdb, waiting: bool = True) -> Session:
    session = Session(SessionInfo(actor, rank, {"gpus": rank}, "h", 100 + rank, "step", "/x/t.py", 5), pdb)
    session.waiting = waiting
    session._output.append("> /x/t.py(5)step()\n(Pdb) ")
    pdb.session = session
    return session


def run_console(lines: list[str], sessions: dict, timeout_s: float = 5.0) -> str:
    io = ScriptedIO(lines)

    async def main() -> None:
        await asyncio.wait_for(Console(sessions, io, timeout_s).run(), 30)

    asyncio.run(main())
    return io.screen


def test_attach_runs_pdb_commands_and_detaches() -> None:
    pdb = FakePdb()
    sessions = {("t", 0): make_session("t", 0, pdb)}
    screen = run_console(["attach t 0", "p y", "", "detach", "quit"], sessions)
    assert pdb.received == ["p y", ""]  # an empty line goes too: pdb repeats its last command
    assert "> /x/t.py(5)step()\n" in screen and "ran p y\n" in screen
    assert screen.count("(Pdb) ") == 3 and screen.endswith("actormesh_dbg> ")


def test_a_command_that_outlasts_the_timeout_returns_to_the_console() -> None:
    pdb = FakePdb(silent=frozenset({"n"}))
    sessions = {("t", 0): make_session("t", 0, pdb)}
    screen = run_console(["attach t 0", "n", "list", "quit"], sessions, timeout_s=0.2)
    assert "t rank 0 is still running its last command after 0.2s; detached" in screen
    assert re.search(r"^t\s+0\s.*\srunning$", screen, re.M), screen  # `list` shows it still running
    assert sessions[("t", 0)].state == "running"


def test_cast_sends_to_paused_ranks_only_and_shows_each_answer() -> None:
    pdbs = [FakePdb(), FakePdb(), FakePdb()]
    sessions = {("t", r): make_session("t", r, pdbs[r], waiting=r != 2) for r in range(3)}
    screen = run_console(["cast t ranks(0:3) p x", "cast other ranks(0) p x", "quit"], sessions)
    assert pdbs[0].received == pdbs[1].received == ["p x"] and pdbs[2].received == []
    assert "[t rank 0]\nran p x\n" in screen and "[t rank 1]\nran p x\n" in screen
    assert "[t rank 2] is running a command; not sent" in screen
    assert "no session matches actor 'other'" in screen


def test_continue_resumes_all_and_names_the_ones_that_did_not() -> None:
    quick, stuck = FakePdb(), FakePdb(silent=frozenset({RESUME}))
    sessions = {("t", 0): make_session("t", 0, quick), ("t", 1): make_session("t", 1, stuck)}
    screen = run_console(["continue", "quit"], sessions, timeout_s=0.2)
    assert quick.received == [RESUME] and stuck.received == [RESUME]
    assert "continued 1 session(s)" in screen and "not yet resumed (still running a command): t rank 1" in screen


def test_attach_shows_the_end_of_a_session_and_errors_say_what_to_type() -> None:
    pdb = FakePdb()
    sessions = {("t", 0): make_session("t", 0, pdb)}
    screen = run_console(["attach t 0", "c", "attach t 9", "bogus", "cast t p"], sessions)  # then end of input
    assert "t rank 0 continued: its session is over" in screen
    assert "no session for actor 't' rank 9; 'list' shows the paused actors" in screen
    assert "error: unknown command 'bogus'; type 'help'" in screen
    assert "error: usage: cast <actor> ranks(...) <pdb command>" in screen

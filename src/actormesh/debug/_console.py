"""The debug console: ``list``, ``attach``, ``cast``, ``continue`` over the paused sessions.

It runs in the controller, on the debug controller's event loop, and talks to a
person through a :class:`ConsoleIO`: the controller's own terminal
(:class:`StdIO`, ``debug_controller().enter``) or an ``actormesh debug``
process on the other end of the debug socket (``_server.ConnIO``). Every wait
on a paused actor is bounded by ``debug_attach_timeout``: a command an actor is
still running after that returns the person to the console prompt.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Optional, Protocol

from ._commands import (
    HELP,
    RESUME,
    Attach,
    Cast,
    Continue,
    DebugCommandError,
    Help,
    ListSessions,
    Quit,
    SessionInfo,
    format_sessions,
    parse_command,
)

__all__ = ["ConsoleIO", "StdIO", "Session", "Console", "PROMPT", "PDB_PROMPT"]

PROMPT = "actormesh_dbg> "
PDB_PROMPT = "(Pdb) "
BANNER = ("\n*** actormesh debugger ***\n"
          "Enter 'list' to show the paused actors, 'help' for the commands.\n")


class ConsoleIO(Protocol):
    """Where the console reads lines and writes text."""

    async def read_line(self, prompt: str) -> Optional[str]:
        """The next line the person typed (without newline); None when they are gone (EOF)."""

    async def write(self, text: str) -> None:
        """Show ``text``."""


class StdIO:
    """The controller process's own terminal.

    Each read runs ``input()`` on a daemon thread, so a console left waiting for
    a line never keeps the process from exiting.
    """

    async def read_line(self, prompt: str) -> Optional[str]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Optional[str]] = loop.create_future()

        def settle(line: Optional[str]) -> None:
            if not fut.done():
                fut.set_result(line)

        def read() -> None:
            try:
                line: Optional[str] = input(prompt)
            except (EOFError, KeyboardInterrupt, OSError, ValueError):
                line = None
            try:
                loop.call_soon_threadsafe(settle, line)
            except RuntimeError:
                pass  # the loop closed meanwhile

        threading.Thread(target=read, name="actormesh-debug-stdin", daemon=True).start()
        return await fut

    async def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()


class Session:
    """The controller's view of one paused actor (lives on the controller's loop)."""

    def __init__(self, info: SessionInfo, inbox: object) -> None:
        self.info = info
        self.inbox = inbox
        self._output: list[str] = []
        self.waiting = False  # pdb is at its prompt, waiting for a command
        self.ended = False
        self.lost: Optional[str] = None  # why its proc is gone
        self._changed = asyncio.Condition()

    @property
    def state(self) -> str:
        """``paused`` (at the pdb prompt), ``running`` (a command) or ``ended``."""
        return "ended" if self.ended else "paused" if self.waiting else "running"

    async def on_output(self, text: str, waiting: bool, function: str, filename: str, lineno: int) -> None:
        """pdb output arrived; ``waiting``: pdb is at its prompt again."""
        if text:
            self._output.append(text)
        if function:
            self.info = SessionInfo(self.info.actor, self.info.rank, self.info.coords, self.info.host, self.info.pid,
                                    function, filename, lineno)
        self.waiting = waiting
        async with self._changed:
            self._changed.notify_all()

    async def on_end(self) -> None:
        """The actor continued: the session is over."""
        self.ended, self.waiting = True, False
        async with self._changed:
            self._changed.notify_all()

    async def on_lost(self, reason: str) -> None:
        """The actor's proc is gone: the session is over."""
        self.lost = reason
        await self.on_end()

    def over(self) -> str:
        """Why the session ended, for the console."""
        who = f"{self.info.actor} rank {self.info.rank}"
        return f"{who}: its proc is gone ({self.lost})" if self.lost else f"{who} continued: its session is over"

    def send(self, line: str) -> None:
        """Hand pdb one command line (or ``RESUME``)."""
        self.waiting = False
        self.inbox.send(line)  # type: ignore[attr-defined]

    async def answered(self, timeout_s: float) -> bool:
        """Wait until pdb is at its prompt again or the session ended; False after ``timeout_s``."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.waiting or self.ended), timeout_s)
            except asyncio.TimeoutError:
                return False
        return True

    def take_output(self) -> tuple[str, str]:
        """(pdb's output so far, its trailing prompt or "")."""
        text, self._output = "".join(self._output), []
        if text.endswith(PDB_PROMPT):
            return text[: -len(PDB_PROMPT)], PDB_PROMPT
        return text, ""


class Console:
    """One person's console session over ``sessions`` (see the module doc)."""

    def __init__(self, sessions: dict[tuple[str, int], Session], io: ConsoleIO, timeout_s: float) -> None:
        self.sessions = sessions
        self.io = io
        self.timeout_s = timeout_s

    async def run(self) -> None:
        """Read and run commands until ``quit`` or end of input."""
        await self.io.write(BANNER)
        while True:
            line = await self.io.read_line(PROMPT)
            if line is None:
                return
            if not line.strip():
                continue
            try:
                command = parse_command(line)
            except DebugCommandError as exc:
                await self.io.write(f"error: {exc}\n")
                continue
            if isinstance(command, Quit):
                return
            if not await self._run(command):
                return

    async def _run(self, command: object) -> bool:
        """Run one command; False when the person went away meanwhile."""
        if isinstance(command, ListSessions):
            states = {k: s.state for k, s in self.sessions.items()}
            await self.io.write(format_sessions([s.info for s in self.sessions.values()], states))
        elif isinstance(command, Help):
            await self.io.write(HELP)
        elif isinstance(command, Attach):
            return await self._attach(command.actor, command.rank)
        elif isinstance(command, Cast):
            await self._cast(command)
        elif isinstance(command, Continue):
            await self._continue_all()
        return True

    async def _attach(self, actor: str, rank: int) -> bool:
        session = self.sessions.get((actor, rank))
        if session is None:
            await self.io.write(f"no session for actor {actor!r} rank {rank}; 'list' shows the paused actors\n")
            return True
        await self.io.write(f"attached to {actor} rank {rank}: pdb commands go to it; 'detach' returns to the console\n")
        while True:
            if not session.waiting and not session.ended and not await session.answered(self.timeout_s):
                await self.io.write(f"{actor} rank {rank} is still running its last command after {self.timeout_s:g}s; "
                                    "detached (attach again to see its output)\n")
                return True
            text, prompt = session.take_output()
            await self.io.write(text)
            if session.ended:
                await self.io.write(session.over() + "\n")
                return True
            line = await self.io.read_line(prompt or PDB_PROMPT)
            if line is None:
                return False
            if line.strip() == "detach":
                return True
            session.send(line)

    async def _cast(self, command: Cast) -> None:
        chosen = sorted((k, s) for k, s in self.sessions.items()
                        if k[0] == command.actor and (command.ranks is None or k[1] in command.ranks))
        if not chosen:
            await self.io.write(f"no session matches actor {command.actor!r} and those ranks; 'list' shows the paused actors\n")
            return
        sent = []
        for (_, rank), session in chosen:
            if session.waiting:
                session.take_output()  # the prompt it showed before; the answer follows
                session.send(command.command)
                sent.append((rank, session))
            else:
                await self.io.write(f"[{command.actor} rank {rank}] is running a command; not sent\n")
        answers = await asyncio.gather(*(s.answered(self.timeout_s) for _, s in sent))
        for (rank, session), ok in zip(sent, answers):
            text, _ = session.take_output()
            note = "" if ok else f"(no answer within {self.timeout_s:g}s)\n"
            if session.ended:
                note += f"({session.over()})\n"
            await self.io.write(f"[{command.actor} rank {rank}]\n{text}{note}")

    async def _continue_all(self) -> None:
        live = [s for s in self.sessions.values() if not s.ended]
        for session in live:
            session.send(RESUME)
        answers = await asyncio.gather(*(self._ended(s) for s in live))
        slow = [f"{s.info.actor} rank {s.info.rank}" for s, ok in zip(live, answers) if not ok]
        await self.io.write(f"continued {len(live) - len(slow)} session(s)\n")
        if slow:
            await self.io.write(f"not yet resumed (still running a command): {', '.join(slow)}\n")

    async def _ended(self, session: Session) -> bool:
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while not session.ended:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0 or not await session.answered(left):
                return session.ended
            if not session.ended:
                session.take_output()
                session.send(RESUME)  # stopped again at a breakpoint set meanwhile
        return True

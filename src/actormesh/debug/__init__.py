"""Debugger layer (a tool over a running job): ``breakpoint()`` in actors, driven from one console.

``breakpoint()`` or ``pdb.set_trace()`` inside any endpoint pauses that actor
only and registers a session with the job's debug controller; the console
(``actormesh debug``, or ``debug_controller().enter`` on the controller's own
terminal) lists the sessions, attaches a full pdb prompt to one, casts a pdb
command to several ranks and continues them all. With nobody to debug, the
breakpoint is skipped with a logged warning. See docs/debugging.md.
"""

from ._commands import DebugCommandError, SessionInfo, parse_command, parse_ranks
from ._controller import CONTROLLER_NAME, DebugController, controller_is_interactive, debug_controller
from ._hook import RemotePdb, breakpoint_hook, install_breakpoint_hook
from ._server import DebugClientError, DebugServerInfo, find_debug_servers, run_client

__all__ = [
    "CONTROLLER_NAME",
    "DebugClientError",
    "DebugCommandError",
    "DebugController",
    "DebugServerInfo",
    "RemotePdb",
    "SessionInfo",
    "breakpoint_hook",
    "controller_is_interactive",
    "debug_controller",
    "find_debug_servers",
    "install_breakpoint_hook",
    "parse_command",
    "parse_ranks",
    "run_client",
]

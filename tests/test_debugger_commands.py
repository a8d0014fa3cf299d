"""The debug console's command language, parsed without a job."""

from __future__ import annotations

import pytest

from actormesh.debug import DebugCommandError, SessionInfo, parse_command, parse_ranks
from actormesh.debug._commands import Attach, Cast, Continue, Help, ListSessions, Quit, format_sessions


@pytest.mark.parametrize(
    "line, expected",
    [
        ("list", ListSessions()),
        ("attach trainer 1", Attach("trainer", 1)),
        ("cast trainer ranks(0,2) p x + 1", Cast("trainer", [0, 2], "p x + 1")),
        ("cast trainer ranks(1:4) n", Cast("trainer", range(1, 4), "n")),
        ("cast trainer ranks(*) where", Cast("trainer", None, "where")),
        ("continue", Continue()),
        ("help", Help()),
        ("quit", Quit()),
    ],
)
def test_parse_command(line: str, expected: object) -> None:
    assert parse_command(line) == expected


@pytest.mark.parametrize(
    "line, message",
    [
        ("attach trainer", "usage: attach <actor> <rank>"),
        ("attach trainer one", "the rank must be an integer"),
        ("cast trainer p x", "usage: cast"),
        ("cast trainer ranks(a,b) p x", "comma-separated integers"),
        ("cast trainer ranks(1:) p x", "needs a stop"),
        ("frobnicate", "unknown command 'frobnicate'; type 'help'"),
    ],
)
def test_parse_errors_say_what_to_type(line: str, message: str) -> None:
    with pytest.raises(DebugCommandError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_command(line)


def test_parse_ranks_forms() -> None:
    assert parse_ranks("ranks(3)") == [3]
    assert parse_ranks("ranks( 0, 2 )") == [0, 2]
    assert parse_ranks("ranks(0:8:2)") == range(0, 8, 2)
    assert parse_ranks("ranks(:3)") == range(0, 3)
    assert parse_ranks("ranks()") is None


def test_session_table() -> None:
    infos = [
        SessionInfo("trainer", 1, {"gpus": 1}, "h", 11, "step", "/x/train.py", 42),
        SessionInfo("trainer", 0, {"gpus": 0}, "h", 10, "step", "/x/train.py", 40),
    ]
    table = format_sessions(infos, {("trainer", 1): "running"}).splitlines()
    assert table[0].split() == ["actor", "rank", "coords", "host", "pid", "function", "file:line", "state"]
    assert table[1].split() == ["trainer", "0", "gpus=0", "h", "10", "step", "/x/train.py:40", "paused"]
    assert table[2].split() == ["trainer", "1", "gpus=1", "h", "11", "step", "/x/train.py:42", "running"]
    assert "no sessions" in format_sessions([])


def test_actormesh_debug_without_a_controller_says_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    from actormesh.cli import main

    assert main(["debug", "--pid", "1"]) == 1
    err = capsys.readouterr().err
    assert "no controller pid 1 has a debug console" in err and "debug_controller()" in err

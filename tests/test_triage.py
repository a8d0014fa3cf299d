"""Supervision decisions in virtual time: no processes, sockets or sleeps."""

from __future__ import annotations

import pytest

from actormesh.runtime._triage import Decision, FailureTriage, MeshRecord, RestartPolicy


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _record(n: int = 2, policy: RestartPolicy | None = None) -> MeshRecord:
    rec = MeshRecord("m-1", "client", [f"addr{i}" for i in range(n)], "<m", describe=lambda r: f"m[{r}]")
    if policy is not None:
        rec.restart = policy
        rec.respawn = lambda rank: None
    return rec


def test_a_failure_without_policy_is_reported_once_and_marks_the_rank():
    triage = FailureTriage(_Clock())
    rec = _record()
    action = triage.on_failure(rec, 1, "boom", "addr1", "m[1]")
    assert action.decision is Decision.REPORT
    assert action.failure is not None and action.failure.crashed_ranks == [1] and action.failure.cause == "boom"
    assert action.failure.actor == "m[1]" and action.failure.mesh_name == "m-1"
    assert rec.failed == {1: "boom"}
    # The same rank again, by its process's loss this time: a duplicate.
    again = triage.on_peer_lost([rec], "addr1", "connection lost")
    assert [a.decision for a in again] == [Decision.IGNORE]
    assert again[0].why == "already reported"
    assert rec.failed == {1: "boom"}  # the first cause stays


def test_a_stopped_mesh_reports_nothing():
    triage = FailureTriage(_Clock())
    rec = _record()
    rec.stopped = "stopped by client"
    action = triage.on_failure(rec, 0, "exited", "addr0", "m[0]")
    assert action.decision is Decision.IGNORE and action.why == "the mesh was stopped"
    assert rec.failed == {} and rec.reported == set()


def test_a_lost_process_fails_every_rank_that_lived_there():
    triage = FailureTriage(_Clock())
    rec = MeshRecord("m", "client", ["a", "b", "a"], "<m")
    other = MeshRecord("n", "client", ["c"], "<n")
    actions = triage.on_peer_lost([rec, other], "a", "Killed(sig=9)")
    assert [(a.record.name, a.rank, a.decision) for a in actions] == [("m", 0, Decision.REPORT), ("m", 2, Decision.REPORT)]
    assert actions[0].failure.actor == "<m rank 0>"


def test_restarts_within_the_window_then_escalation():
    clock = _Clock()
    triage = FailureTriage(clock)
    rec = _record(policy=RestartPolicy(max_restarts=2, within_s=10.0))
    assert triage.on_failure(rec, 0, "x", "addr0", "m[0]").decision is Decision.RESTART
    clock.now = 5.0
    assert triage.on_failure(rec, 0, "x", "addr0", "m[0]").decision is Decision.RESTART
    clock.now = 9.9  # two restarts within 10 s already: the third failure escalates
    action = triage.on_failure(rec, 0, "x", "addr0", "m[0]")
    assert action.decision is Decision.REPORT and action.why == "2 restarts within 10s"
    assert rec.failed == {0: "x"}


def test_the_restart_window_slides():
    clock = _Clock()
    triage = FailureTriage(clock)
    rec = _record(policy=RestartPolicy(max_restarts=1, within_s=10.0))
    assert triage.on_failure(rec, 0, "x", "addr0", "m[0]").decision is Decision.RESTART
    clock.now = 10.0  # the first restart left the window
    assert triage.on_failure(rec, 0, "x", "addr0", "m[0]").decision is Decision.RESTART
    clock.now = 15.0
    assert triage.on_failure(rec, 0, "x", "addr0", "m[0]").decision is Decision.REPORT


def test_zero_restarts_escalates_at_once():
    triage = FailureTriage(_Clock())
    rec = _record(policy=RestartPolicy(max_restarts=0, within_s=1.0))
    assert triage.on_failure(rec, 0, "x", "addr0", "m[0]").decision is Decision.REPORT


def test_a_report_about_an_earlier_incarnation_is_ignored():
    triage = FailureTriage(_Clock())
    rec = _record(policy=RestartPolicy(max_restarts=3, within_s=60.0))
    assert triage.on_failure(rec, 0, "killed", "addr0", "m[0]").decision is Decision.RESTART
    rec.addresses[0] = "addr0-new"  # the shell respawned it on a fresh proc
    late = triage.on_failure(rec, 0, "late report from the old proc", "addr0", "m[0]")
    assert late.decision is Decision.IGNORE and late.why == "a report about an earlier incarnation"
    assert [a.decision for a in triage.on_peer_lost([rec], "addr0", "gone")] == []  # nothing lives there now
    assert triage.on_failure(rec, 0, "the new one failed", "addr0-new", "m[0]").decision is Decision.RESTART


def test_a_restart_that_cannot_be_done_is_reported():
    triage = FailureTriage(_Clock())
    rec = _record(policy=RestartPolicy(max_restarts=3, within_s=60.0))
    action = triage.on_failure(rec, 1, "x", "addr1", "m[1]")
    assert action.decision is Decision.RESTART
    report = triage.restart_failed(action)
    assert report.decision is Decision.REPORT and report.failure.crashed_ranks == [1]
    assert report.why == "the restart failed"
    assert triage.on_failure(rec, 1, "x", "addr1", "m[1]").decision is Decision.IGNORE


def test_a_report_without_a_source_is_taken_as_current():
    triage = FailureTriage(_Clock())
    rec = _record()
    assert triage.on_failure(rec, 0, "x", None, "m[0]").decision is Decision.REPORT


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_restart_policy_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=bad)

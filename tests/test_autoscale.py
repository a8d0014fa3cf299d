"""Autoscaling services: the decision rule in virtual time (no procs, no sleeps),
then a real service that grows under load and shrinks after it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from actormesh.serve import Autoscaling, Service
from actormesh.serve._autoscale import Autoscaler, ScaleDecider

from conftest import wait_for
from test_serve_service import FileGate

GET_S = 60


def run(decider: ScaleDecider, samples: list[tuple[float, float]], current: int) -> list[int]:
    """Feed ``(time, demand)`` samples, applying each decision; the count after each."""
    out = []
    for now, demand in samples:
        current = decider.decide(now, demand, current)
        out.append(current)
    return out


def test_it_grows_to_the_load_over_the_target_only_after_the_upscale_delay() -> None:
    cfg = Autoscaling(min_replicas=1, max_replicas=4, target_ongoing_requests=2, upscale_delay_s=3, look_back_s=1)
    # 5 requests want ceil(5 / 2) = 3 replicas; the delay runs from the first sample that wants more
    assert run(ScaleDecider(cfg), [(t, 5) for t in range(6)], 1) == [1, 1, 1, 3, 3, 3]


def test_it_stays_within_its_bounds() -> None:
    cfg = Autoscaling(min_replicas=2, max_replicas=3, target_ongoing_requests=1, upscale_delay_s=0, downscale_delay_s=0,
                      look_back_s=0.5)
    assert run(ScaleDecider(cfg), [(0, 100), (1, 0), (2, 0)], 2) == [3, 2, 2]
    assert ScaleDecider(cfg).decide(0, 0, 5) == 3, "a count outside the bounds comes back at once"


def test_a_burst_shorter_than_the_delay_changes_nothing() -> None:
    cfg = Autoscaling(min_replicas=1, max_replicas=4, target_ongoing_requests=1, upscale_delay_s=3, look_back_s=0.5)
    loads = [(0, 4), (1, 4), (2, 0), (3, 4), (4, 4), (5, 0), (6, 4)]  # never 3 s in a row
    assert run(ScaleDecider(cfg), loads, 1) == [1] * 7


def test_it_shrinks_only_after_the_longer_downscale_delay() -> None:
    cfg = Autoscaling(min_replicas=1, max_replicas=4, target_ongoing_requests=1, upscale_delay_s=1, downscale_delay_s=5,
                      look_back_s=0.5)
    counts = run(ScaleDecider(cfg), [(0, 4), (1, 4)] + [(t, 0) for t in range(2, 9)], 1)
    assert counts == [1, 4, 4, 4, 4, 4, 4, 1, 1]  # wants 1 from t=2: shrinks at t=7


def test_the_look_back_window_averages_the_load() -> None:
    cfg = Autoscaling(min_replicas=1, max_replicas=8, target_ongoing_requests=1, upscale_delay_s=0, look_back_s=10)
    d = ScaleDecider(cfg)
    assert run(d, [(0, 0), (1, 0), (2, 0), (3, 8)], 1) == [1, 1, 1, 2]  # average 2, not the spike's 8


@pytest.mark.parametrize("kwargs, says", [
    ({"min_replicas": 0}, "min_replicas must be an int >= 1"),
    ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
    ({"target_ongoing_requests": 0}, "target_ongoing_requests must be a finite number > 0"),
    ({"upscale_delay_s": -1}, "upscale_delay_s"),
    ({"interval_s": float("nan")}, "interval_s"),
])
def test_bad_settings_are_refused(kwargs: dict[str, float], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Autoscaling(**kwargs)


def test_the_thread_samples_refusals_as_demand_and_waits_for_each_scale() -> None:
    clock = [0.0]
    calls: list[int] = []
    state = {"refused": 0, "current": 1}
    wake = threading.Event()

    class Pending:
        def done(self) -> bool:
            return True

    def sample() -> tuple[int, int, int]:
        clock[0] += 1.0
        state["refused"] += 3  # nothing running, 3 refused per sample: unmet demand
        return 0, state["refused"], state["current"]

    def scale(n: int) -> Pending:
        calls.append(n)
        state["current"] = n
        wake.set()
        return Pending()

    cfg = Autoscaling(min_replicas=1, max_replicas=4, target_ongoing_requests=1, upscale_delay_s=0, look_back_s=0.5,
                      interval_s=0.01)
    scaler = Autoscaler("t", cfg, sample, scale, clock=lambda: clock[0])
    try:
        assert wake.wait(10)
    finally:
        scaler.stop()
    assert calls[0] == 3 and scaler.decisions[0] == (1, 3)
    assert not scaler._thread.is_alive()


def test_a_service_grows_under_load_and_shrinks_after_it(tmp_path: Path) -> None:
    flag = tmp_path / "open"
    cfg = Autoscaling(min_replicas=1, max_replicas=3, target_ongoing_requests=1, upscale_delay_s=0.2,
                      downscale_delay_s=0.5, look_back_s=0.3, interval_s=0.05)
    svc = Service(1, 1, FileGate, str(flag), max_concurrency=1, max_queue=8, autoscaling=cfg)
    try:
        svc.ready().get(timeout=GET_S)
        with pytest.raises(ValueError, match="autoscales between 1 and 3 replicas"):
            svc.scale(2)
        calls = [svc.wait.route(i) for i in range(3)]  # 3 waiting requests, a target of 1 each
        wait_for(lambda: svc.metrics().healthy_replicas == 3, timeout=GET_S)
        assert svc.autoscaler is not None and svc.autoscaler.decisions[0] == (1, 3)
        # the backlog queued on the first replica moved to the new ones: one request each
        wait_for(lambda: [r.in_flight for r in svc.metrics().replicas] == [1, 1, 1], timeout=GET_S)
        flag.write_text("go")
        assert sorted(f.get(timeout=GET_S) for f in calls) == [0, 1, 2]
        wait_for(lambda: len(svc.replicas()) == 1, timeout=GET_S)
        assert svc.autoscaler.decisions[-1] == (3, 1)
    finally:
        flag.write_text("go")
        svc.stop().get(timeout=GET_S)
    assert svc.autoscaler is not None and not svc.autoscaler._thread.is_alive()


def test_settings_that_do_not_hold_the_start_count_are_refused() -> None:
    with pytest.raises(ValueError, match="bounds hold num_replicas=5"):
        Service(1, 5, FileGate, "x", autoscaling=Autoscaling(max_replicas=3))
    with pytest.raises(ValueError, match="actormesh.serve.Autoscaling"):
        Service(1, 1, FileGate, "x", autoscaling={"max_replicas": 3})  # type: ignore[arg-type]


def test_the_cli_autoscales_between_its_bounds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import actormesh.serve as serve
    from actormesh.serve.__main__ import main

    seen: dict[str, object] = {}
    monkeypatch.setattr(serve, "serve_openai", lambda model, **kw: seen.update(kw))
    assert main(["--model", str(tmp_path), "--max-replicas", "3", "--max-slots", "4", "--upscale-delay-s", "5"]) == 0
    scaling = seen["autoscaling"]
    assert isinstance(scaling, Autoscaling)
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests, scaling.upscale_delay_s) == (1, 3, 4.0, 5.0)
    seen.clear()
    assert main(["--model", str(tmp_path), "--replicas", "2"]) == 0 and "autoscaling" not in seen
    assert main(["--model", str(tmp_path), "--min-replicas", "2"]) == 1  # autoscaling needs --max-replicas

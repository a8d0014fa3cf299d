"""Autoscaling a Service: how many replicas its load asks for (Ray Serve's rule).

Theory of operation
-------------------
Every ``interval_s`` the service's :class:`Autoscaler` thread samples its
*demand*: requests in flight plus requests queued, plus those refused with
``ServiceOverloaded`` since the last sample (unmet demand counts too). A
:class:`ScaleDecider` (pure: the clock is passed in, so it is tested with
virtual time) averages the samples of the last ``look_back_s`` and wants
``ceil(average / target_ongoing_requests)`` replicas, within
``[min_replicas, max_replicas]``. It moves only when it has wanted more for
``upscale_delay_s`` (or fewer for ``downscale_delay_s``) without a break, so a
burst shorter than the delay changes nothing and the count does not flap. The
thread then calls the service's scale (new replicas build in the background,
removed ones drain first) and waits for that to finish before deciding again.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import ServiceStopped
from ._periodic import PeriodicThread
from ._replica import HEALTHY, STARTING

if TYPE_CHECKING:
    from ._core import ServiceCore

__all__ = ["Autoscaling", "Autoscaler", "ScaleDecider", "autoscale"]

log = logging.getLogger("actormesh.serve")


@dataclass(frozen=True)
class Autoscaling:
    """How a :class:`~actormesh.serve.Service` sizes itself to its load (Ray Serve's
    ``autoscaling_config``, same names and meanings; ``look_back_s`` is Ray's
    ``look_back_period_s``, ``interval_s`` how often the load is sampled).

    Example::

        Service(1, 1, Model, autoscaling=Autoscaling(min_replicas=1, max_replicas=4,
                                                     target_ongoing_requests=2))
    """

    min_replicas: int = 1
    max_replicas: int = 1
    #: the requests (running and queued) each replica should hold on average
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_s: float = 30.0
    interval_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("min_replicas", "max_replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1 (a service keeps at least one replica), got {value!r}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        for name, low_open in (("target_ongoing_requests", True), ("upscale_delay_s", False), ("downscale_delay_s", False),
                               ("look_back_s", True), ("interval_s", True)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < 0 or (low_open and value == 0):
                raise ValueError(f"{name} must be a finite number {'> 0' if low_open else '>= 0'}, got {value!r}")

    def clamp(self, n: int) -> int:
        """``n`` within ``[min_replicas, max_replicas]``."""
        return max(self.min_replicas, min(self.max_replicas, n))


class ScaleDecider:
    """The replica count a stream of demand samples asks for (no clock, threads or procs)."""

    def __init__(self, config: Autoscaling) -> None:
        self.config = config
        self._samples: deque[tuple[float, float]] = deque()
        self._since: tuple[int, float] | None = None  # (direction wanted, since when)

    def desired(self) -> int:
        """What the samples in the look-back window ask for, within the bounds."""
        cfg = self.config
        if not self._samples:
            return cfg.min_replicas
        average = sum(d for _, d in self._samples) / len(self._samples)
        return cfg.clamp(math.ceil(average / cfg.target_ongoing_requests - 1e-9))

    def decide(self, now: float, demand: float, current: int) -> int:
        """Record ``demand`` at ``now``; the replica count to have (``current`` to stay)."""
        cfg = self.config
        self._samples.append((now, float(demand)))
        while self._samples and self._samples[0][0] < now - cfg.look_back_s:
            self._samples.popleft()
        if current != cfg.clamp(current):
            self._since = None
            return cfg.clamp(current)  # outside the bounds (replicas given up): back in at once
        want = self.desired()
        if want == current:
            self._since = None
            return current
        direction = 1 if want > current else -1
        if self._since is None or self._since[0] != direction:
            self._since = (direction, now)
        delay = cfg.upscale_delay_s if direction > 0 else cfg.downscale_delay_s
        if now - self._since[1] < delay:
            return current
        self._since = None
        return want


class Autoscaler(PeriodicThread):
    """The thread that samples a service's load and scales it; owned by the service
    (``stop`` joins it). ``sample()`` gives ``(in flight + queued, refused so far,
    replicas kept)``; ``scale(n)`` returns a Future."""

    def __init__(self, name: str, config: Autoscaling, sample: Callable[[], tuple[int, int, int]],
                 scale: Callable[[int], Any], clock: Callable[[], float] = time.monotonic) -> None:
        self.decider = ScaleDecider(config)
        self._sample, self._scale, self._clock = sample, scale, clock
        self.decisions: list[tuple[int, int]] = []  #: (from, to) of each scale it asked for, in order
        self._refused_before = 0
        self._pending: Any = None  # the Future of the last scale asked for
        super().__init__(f"autoscaler-{name}", config.interval_s)

    def tick(self) -> bool | None:
        ongoing, refused, current = self._sample()
        demand = ongoing + max(0, refused - self._refused_before)
        self._refused_before = refused
        target = self.decider.decide(self._clock(), demand, current)
        if target == current or (self._pending is not None and not self._pending.done()):
            return None
        try:
            self._pending = self._scale(target)
        except ServiceStopped:
            return False
        except Exception:  # the service must keep serving: log it and decide again later
            log.exception("autoscaling from %d to %d replicas failed", current, target)
            return None
        self.decisions.append((current, target))
        return None


def autoscale(core: ServiceCore, config: Autoscaling) -> Autoscaler:
    """Start the autoscaler of the service whose state is ``core``."""

    def sample() -> tuple[int, int, int]:
        m = core.metrics()
        kept = sum(1 for r in core.replicas() if r.state in (STARTING, HEALTHY))
        return m.in_flight + m.queued, m.overloaded, kept

    return Autoscaler(core.spec.name, config, sample, core.scale)

"""Settings of actormesh: one frozen dataclass, ``ACTORMESH_*`` environment overrides.

Precedence, lowest first: defaults < environment (``ACTORMESH_<KEY>``, read once at
import) < ``configure(**kw)`` / ``configured(**kw)``. Durations are seconds (floats)
or humantime strings (``"30s"``, ``"500ms"``, ``"1h 30m"``); sizes are bytes.

| key                     | default    | meaning |
|-------------------------|------------|---------|
| default_transport       | "unix"     | "unix" (same host) or "tcp" (loopback unless ``bind_host``) |
| bind_host               | "127.0.0.1"| interface TCP listeners bind to; anything else is explicit |
| codec_max_frame_length  | 10 GiB     | largest frame accepted; larger closes the connection |
| connect_timeout         | 10.0       | seconds to connect and authenticate to a peer |
| handshake_timeout       | 5.0        | seconds a peer has to finish the HMAC handshake |
| proc_spawn_timeout      | 30.0       | seconds for a spawned proc to report ready |
| stop_timeout            | 10.0       | seconds a stopping proc has before its spawner kills it |
| cleanup_timeout         | 3.0        | seconds a stopping actor has to finish and run ``__cleanup__`` (then its proc is killed), and a failed actor's ``__cleanup__`` (docs/supervision.md, Deadlines) |
| message_delivery_timeout| 30.0       | seconds before an undeliverable message fails |
| use_uvloop              | True       | use uvloop for event loops when it is installed |
| max_cast_fanout         | 16         | casts to more procs than this travel down a tree of procs |
| tls                     | False      | mutual TLS on a private per-job CA for TCP channels (needs ``cryptography``) |
| heartbeat_interval      | 0.5        | seconds of silence after which a spawner pings a child proc |
| heartbeat_timeout       | 3.0        | seconds of silence after which its spawner looks at a child proc in the OS: a stopped one (SIGSTOP) is killed, a busy one never (docs/supervision.md, Liveness) |
| hung_timeout            | 60.0       | seconds a silent child proc may use no CPU while not runnable before it is declared hung and killed |
| link_timeout            | 10.0       | seconds a peer on another host (a TCP link that is not to a child) may stay silent, pinged every ``heartbeat_interval``, before it is unreachable: its calls fail, owners hear it, and an agent that loses its controller stops that controller's procs; also TCP keepalive / ``TCP_USER_TIMEOUT``. At least twice ``heartbeat_interval`` (docs/supervision.md, Partitions) |
| proc_zygote             | True       | start this host's procs by forking a zygote: one interpreter per spawner that has actormesh imported already (2x faster to a first reply); off, or with a custom ``bootstrap_command``/``python``/``proc_bind``, each proc is a fresh ``python -m actormesh.worker`` |
| shm_threshold_bytes     | 1 MiB      | message buffers this large go to same-host procs through shared memory; 0 = never |
| bulk_lane_bytes         | 1 MiB      | messages this large to a TCP peer (no TLS) go on a second connection run by low-priority threads, so small ones on the first keep their latency (docs/dataplane.md); 0 = never |
| shm_pool_bytes          | 1 GiB      | idle shared-memory message buffers a process keeps for reuse |
| prefix_python_logs_with_actor | True | Python log messages made inside an actor start with ``[actor=<name>] `` |
| debug_attach_timeout    | 60.0       | seconds an actor paused in ``breakpoint()`` waits without a debug console (none connected, or it quit) before it continues with a logged warning; also how long the console waits for a paused actor to answer one command (docs/debugging.md) |
| rdma_disable_ibverbs    | True       | Monarch's RDMA backend switch. actormesh has no ibverbs backend: its buffers move over shared memory or TCP whatever the value, as Monarch's do on a host without ibverbs devices (``is_ibverbs_available()`` is False); settable and readable so Monarch programs run |
| telemetry               | False      | collect the runtime's figures (messages, mailbox depth, latency, errors, restarts, bytes, RSS, CPU) and trace calls across procs (docs/telemetry.md) |
| dashboard_port          | 0          | serve the dashboard (web page, JSON API, ``/metrics``) from the controller on this TCP port; 0 = off; implies ``telemetry`` (docs/dashboard.md) |
| dashboard_host          | "127.0.0.1"| interface the dashboard binds to; anything but loopback requires the job's token |
| rdma_allow_tcp_fallback | True       | Monarch's "fall back to TCP when ibverbs fails"; with no ibverbs backend TCP is always the path, so, like the key above, it is recorded and has no other effect |

Example::

    from actormesh import config
    with config.configured(default_transport="tcp"):
        procs = this_host().spawn_procs(per_host={"gpus": 2})
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

from ._monarch_config import MONARCH_KEYS, Encoding, translate
from .errors import ConfigError

__all__ = [
    "Config",
    "ConfigTypeError",
    "Encoding",
    "configure",
    "configured",
    "get_config",
    "get_global_config",
    "get_runtime_config",
    "clear_runtime_config",
    "reload_environment",
    "parametrize_config",
    "parametrize_config_pointwise",
]


class ConfigTypeError(ConfigError, TypeError):
    """A config value had the wrong type (caught by ``except TypeError`` too, as in Monarch)."""


@dataclasses.dataclass(frozen=True)
class Config:
    """The settings in force; build new ones with :func:`configure`, never mutate."""

    default_transport: str = "unix"
    bind_host: str = "127.0.0.1"
    codec_max_frame_length: int = 10 * 1024**3
    connect_timeout: float = 10.0
    handshake_timeout: float = 5.0
    proc_spawn_timeout: float = 30.0
    stop_timeout: float = 10.0
    cleanup_timeout: float = 3.0
    message_delivery_timeout: float = 30.0
    use_uvloop: bool = True
    tls: bool = False
    max_cast_fanout: int = 16
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 3.0
    hung_timeout: float = 60.0
    link_timeout: float = 10.0
    proc_zygote: bool = True
    shm_threshold_bytes: int = 1 << 20
    bulk_lane_bytes: int = 1 << 20
    shm_pool_bytes: int = 1 << 30
    prefix_python_logs_with_actor: bool = True
    debug_attach_timeout: float = 60.0
    telemetry: bool = False
    dashboard_port: int = 0
    dashboard_host: str = "127.0.0.1"
    # Monarch's RDMA backend keys, recorded only (see the table: no ibverbs backend here).
    rdma_disable_ibverbs: bool = True
    rdma_allow_tcp_fallback: bool = True

    def __getitem__(self, key: str) -> Any:
        """``cfg["cleanup_timeout"]``; Monarch's key names work too (see docs/config.md)."""
        if key == "default_encoding":
            return Encoding.Multipart
        name = MONARCH_KEYS.get(key, key) if key not in _NAMES else key
        if not isinstance(name, str) or name not in _NAMES:
            raise KeyError(key)
        return getattr(self, name)

    def to_env(self) -> dict[str, str]:
        """The settings as ``ACTORMESH_*`` variables, to hand to child processes."""
        return {f"ACTORMESH_{f.name.upper()}": str(getattr(self, f.name)) for f in dataclasses.fields(self)}


_TRANSPORTS = ("unix", "tcp")
# Size keys where 0 means "off".
_ZERO_DISABLES = frozenset({"shm_threshold_bytes", "bulk_lane_bytes", "dashboard_port"})
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|min|s|m|h|d)\s*")


def _parse_duration(text: str) -> float:
    pos, total = 0, 0.0
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    while pos < len(text):
        m = _DURATION.match(text, pos)
        if not m:
            raise ValueError(f"cannot parse duration {text!r}; use seconds or strings like '30s', '500ms', '1h 30m'")
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    return total


def _coerce(key: str, value: Any, *, from_env: bool) -> Any:
    field_type = {f.name: f.type for f in dataclasses.fields(Config)}[key]
    if field_type == "bool":
        if isinstance(value, bool):
            return value
        if from_env and isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigTypeError(f"config key {key!r} expects a bool, got {value!r}")
    if field_type == "int":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigTypeError(f"config key {key!r} expects an int (bytes), got {value!r}")
        try:
            result = int(value)
        except ValueError as exc:
            raise ConfigError(f"config key {key!r} expects an int (bytes), got {value!r}") from exc
        if result < 0 or (result == 0 and key not in _ZERO_DISABLES):
            raise ConfigError(f"config key {key!r} must be positive, got {value!r}")
        return result
    if field_type == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigTypeError(f"config key {key!r} expects seconds or a duration string like '30s', got {value!r}")
        try:
            seconds = float(value) if isinstance(value, (int, float)) else _parse_duration(str(value))
        except ValueError as exc:
            raise ConfigError(f"config key {key!r}: {exc}") from exc
        if not seconds > 0 or seconds == float("inf"):
            raise ConfigError(f"config key {key!r} must be a positive finite duration, got {value!r}")
        return seconds
    if not isinstance(value, str):
        raise ConfigTypeError(f"config key {key!r} expects a string, got {value!r}")
    if key == "default_transport" and value not in _TRANSPORTS:
        raise ConfigError(f"default_transport must be one of {_TRANSPORTS}, got {value!r}")
    return value


_NAMES = frozenset(f.name for f in dataclasses.fields(Config))


def _check(updates: dict[str, Any], *, from_env: bool) -> dict[str, Any]:
    out = {}
    for key, value in updates.items():
        for name, val in translate(key, value, _NAMES).items():
            if name not in _NAMES:
                raise ConfigError(f"unknown config key {key!r}; known keys: {', '.join(sorted(_NAMES))} "
                                  "(and Monarch's names for them, see docs/config.md)")
            out[name] = _coerce(name, val, from_env=from_env)
    return out


def _from_env() -> Config:
    env = {}
    for f in dataclasses.fields(Config):
        raw = os.environ.get(f"ACTORMESH_{f.name.upper()}")
        if raw is not None:
            env[f.name] = raw
    return Config(**_check(env, from_env=True))


_lock = threading.Lock()
_base = _from_env()
_runtime: dict[str, Any] = {}
_current = _base


def get_config() -> Config:
    """The settings in force now (cheap: one global read)."""
    return _current


def get_global_config() -> dict[str, Any]:
    """The settings in force as a plain dict."""
    return dataclasses.asdict(_current)


def get_runtime_config() -> dict[str, Any]:
    """The settings made with :func:`configure` / :func:`configured` (not defaults or environment)."""
    with _lock:
        return dict(_runtime)


def _consistent(cfg: Config) -> Config:
    """Refuse settings that contradict each other (naming both values)."""
    if cfg.link_timeout < 2 * cfg.heartbeat_interval:
        raise ConfigError(
            f"link_timeout ({cfg.link_timeout:g}s) must be at least twice heartbeat_interval ({cfg.heartbeat_interval:g}s): "
            "an idle link is pinged every heartbeat_interval, so a shorter deadline would declare healthy peers unreachable; "
            "raise link_timeout or lower heartbeat_interval")
    return cfg


def configure(**kw: Any) -> Config:
    """Change settings for this process and the procs it spawns afterwards.

    Unknown keys raise :class:`ConfigError` (a ValueError); wrong types too, and
    settings that contradict each other (``link_timeout`` below twice
    ``heartbeat_interval``).
    """
    global _current
    checked = _check(kw, from_env=False)
    with _lock:
        new = _consistent(dataclasses.replace(_base, **{**_runtime, **checked}))
        _runtime.update(checked)
        _current = new
        return _current


def clear_runtime_config() -> None:
    """Drop everything set with :func:`configure`; environment overrides stay."""
    global _current
    with _lock:
        _runtime.clear()
        _current = _base


def reload_environment() -> Config:
    """Read the ``ACTORMESH_*`` variables again and drop :func:`configure` settings:
    for a process whose environment was replaced after this module was imported
    (a proc forked by the zygote, which imported it before its spawn's settings existed)."""
    global _base, _current
    base = _from_env()
    with _lock:
        _runtime.clear()
        _base = _current = base
        return _current


@contextlib.contextmanager
def configured(**kw: Any) -> Iterator[Config]:
    """Apply settings inside a ``with`` block and restore the previous ones after it."""
    global _current
    checked = _check(kw, from_env=False)
    with _lock:
        new = _consistent(dataclasses.replace(_base, **{**_runtime, **checked}))
        saved = dict(_runtime)
        _runtime.update(checked)
        _current = new
    try:
        yield _current
    finally:
        with _lock:
            _runtime.clear()
            _runtime.update(saved)
            _current = dataclasses.replace(_base, **_runtime)


def _parametrize(combos: list[dict[str, Any]], what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator running a pytest test once per settings dict, inside ``configured(**combo)``."""
    import functools
    import inspect

    import pytest

    for combo in combos:
        _check(combo, from_env=False)  # a bad key or value fails at decoration time, not in the test
    ids = ["-".join(f"{k}={v}" for k, v in combo.items()) for combo in combos]
    param = "_actormesh_config"

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        if param in sig.parameters:
            raise TypeError(f"{what} cannot be applied twice to {fn.__qualname__}; give all settings in one call")
        new_sig = sig.replace(parameters=[inspect.Parameter(param, inspect.Parameter.POSITIONAL_OR_KEYWORD), *sig.parameters.values()])
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def wrapper(_actormesh_config: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
                with configured(**_actormesh_config):
                    return await fn(*args, **kwargs)
        else:

            @functools.wraps(fn)
            def wrapper(_actormesh_config: dict[str, Any], *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
                with configured(**_actormesh_config):
                    return fn(*args, **kwargs)

        wrapper.__signature__ = new_sig  # type: ignore[attr-defined]
        return pytest.mark.parametrize(param, combos, ids=ids)(wrapper)

    return decorate


def parametrize_config(**options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run a pytest test under every combination (cartesian product) of the given settings.

    Each value is a collection of settings to try; the test body runs inside
    ``configured(...)`` with one combination. Example::

        @parametrize_config(default_transport={"unix", "tcp"}, tls={False})
        def test_round_trip(): ...
    """
    import itertools

    if not options:
        raise ValueError("parametrize_config needs at least one setting, e.g. parametrize_config(default_transport={'unix', 'tcp'})")
    keys = list(options)
    values = [_values_of(k, options[k], "parametrize_config") for k in keys]
    return _parametrize([dict(zip(keys, combo)) for combo in itertools.product(*values)], "parametrize_config")


def parametrize_config_pointwise(**options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run a pytest test once per position: the i-th value of every setting together (zip).

    All settings must give the same number of values. Example::

        @parametrize_config_pointwise(default_transport=["unix", "tcp"], tls=[False, True])
        def test_round_trip(): ...   # (unix, no TLS), then (tcp, TLS)
    """
    if not options:
        raise ValueError("parametrize_config_pointwise needs at least one setting")
    keys = list(options)
    values = [_values_of(k, options[k], "parametrize_config_pointwise") for k in keys]
    lengths = {k: len(v) for k, v in zip(keys, values)}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"parametrize_config_pointwise needs the same number of values for every setting; got {lengths}")
    return _parametrize([dict(zip(keys, combo)) for combo in zip(*values)], "parametrize_config_pointwise")


def _values_of(key: str, values: Any, what: str) -> list[Any]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{what}({key}=...) needs a collection of values to try, got {values!r}")
    out = list(values)
    if not out:
        raise ValueError(f"{what}({key}=...) got no values")
    return out


class _ConfigModule(types.ModuleType):
    """Lets ``config.prefix_python_logs_with_actor = False`` (Monarch's spelling) set the setting."""

    @property
    def prefix_python_logs_with_actor(self) -> bool:
        return _current.prefix_python_logs_with_actor

    @prefix_python_logs_with_actor.setter
    def prefix_python_logs_with_actor(self, value: bool) -> None:
        configure(prefix_python_logs_with_actor=value)


sys.modules[__name__].__class__ = _ConfigModule

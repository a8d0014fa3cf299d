"""Monarch's config names: get_runtime_config, parametrize_config(_pointwise), Encoding,
Monarch key names mapped to actormesh's, and the [actor=<name>] log prefix."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from actormesh import config
from actormesh.actor import Actor, ChannelTransport, endpoint, this_host
from actormesh.config import (
    ConfigTypeError,
    Encoding,
    clear_runtime_config,
    configure,
    configured,
    get_config,
    get_runtime_config,
    parametrize_config,
    parametrize_config_pointwise,
)
from actormesh.errors import ConfigError


def test_get_runtime_config_is_what_configure_set() -> None:
    assert "cleanup_timeout" not in get_runtime_config()
    with configured(cleanup_timeout="2s"):
        assert get_runtime_config()["cleanup_timeout"] == 2.0
        snapshot = get_runtime_config()
        snapshot["cleanup_timeout"] = 99  # a copy
        assert get_config().cleanup_timeout == 2.0
    assert "cleanup_timeout" not in get_runtime_config()


@pytest.mark.parametrize(
    ("monarch", "value", "ours", "expected"),
    [
        ("stop_actor_timeout", "5s", "stop_timeout", 5.0),
        ("mesh_terminate_timeout", "15s", "stop_timeout", 15.0),
        ("mesh_proc_spawn_max_idle", "1m", "proc_spawn_timeout", 60.0),
        ("server_heartbeat_interval", "250ms", "heartbeat_interval", 0.25),
        ("message_delivery_timeout", "1h 30m", "message_delivery_timeout", 5400.0),
        ("codec_max_frame_length", 1024, "codec_max_frame_length", 1024),
        ("max_cast_fanout", 4, "max_cast_fanout", 4),
    ],
)
def test_monarch_key_names_set_the_same_actormesh_setting(monarch: str, value: object, ours: str, expected: object) -> None:
    with configured(**{monarch: value}) as cfg:
        assert getattr(cfg, ours) == expected
        assert cfg[monarch] == expected and cfg[ours] == expected


def test_default_transport_takes_channel_transport_members() -> None:
    with configured(default_transport=ChannelTransport.TcpWithLocalhost) as cfg:
        assert cfg.default_transport == "tcp"
    with configured(default_transport=ChannelTransport.Tls) as cfg:
        assert (cfg.default_transport, cfg.tls) == ("tcp", True)
    with pytest.raises(ConfigError, match="not available in actormesh"):
        configure(default_transport=ChannelTransport.MetaTlsWithHostname)


def test_monarch_keys_without_an_equivalent_say_so() -> None:
    with pytest.raises(ConfigError, match="'enable_log_forwarding' has no equivalent in actormesh: .*logging_option"):
        configure(enable_log_forwarding=True)
    with pytest.raises(ConfigError, match="'tokio_worker_threads' has no equivalent"):
        configure(tokio_worker_threads=4)
    with pytest.raises(ConfigError, match="unknown config key 'does_not_exist'"):
        configure(does_not_exist=1)
    assert get_runtime_config() == {}


def test_monarch_rdma_backend_keys_are_recorded_as_on_a_host_without_ibverbs() -> None:
    from actormesh.config import get_global_config
    from actormesh.rdma import is_ibverbs_available

    assert get_global_config()["rdma_disable_ibverbs"] is True  # what actormesh always does
    with configured(rdma_disable_ibverbs=False, rdma_allow_tcp_fallback=False) as cfg:
        assert (cfg.rdma_disable_ibverbs, cfg.rdma_allow_tcp_fallback) == (False, False)
        assert get_global_config()["rdma_disable_ibverbs"] is False
        assert not is_ibverbs_available()  # so Monarch's ibverbs-only cases skip themselves
    with pytest.raises(ConfigTypeError):
        configure(rdma_disable_ibverbs="yes")


def test_encoding() -> None:
    assert {e.name for e in Encoding} == {"Bincode", "Json", "Multipart"}
    with configured(default_encoding=Encoding.Multipart) as cfg:
        assert cfg["default_encoding"] is Encoding.Multipart
    with pytest.raises(ConfigError, match="always encodes Multipart"):
        configure(default_encoding=Encoding.Json)
    with pytest.raises(TypeError, match="expects an Encoding"):
        configure(default_encoding="bincode")


def test_wrong_types_are_type_errors_too() -> None:
    with pytest.raises(TypeError):
        configure(cleanup_timeout=[1])
    with pytest.raises(ConfigTypeError):
        configure(tls="yes")
    with pytest.raises(KeyError):
        get_config()["no_such_key"]


@parametrize_config(default_transport={"unix", "tcp"}, tls={False})
def test_parametrize_config_runs_each_combination(request: pytest.FixtureRequest) -> None:
    cfg = get_config()
    assert request.node.callspec.params["_actormesh_config"] == {"default_transport": cfg.default_transport, "tls": False}


@parametrize_config_pointwise(cleanup_timeout=["1s", "2s"], stop_actor_timeout=["3s", "4s"])
def test_parametrize_config_pointwise_zips_the_values() -> None:
    cfg = get_config()
    assert (cfg.cleanup_timeout, cfg.stop_timeout) in {(1.0, 3.0), (2.0, 4.0)}


def test_parametrize_config_wraps_async_tests_too() -> None:
    import asyncio

    async def body() -> float:
        await asyncio.sleep(0)
        return get_config().cleanup_timeout

    wrapped = parametrize_config(cleanup_timeout={"7s"})(body)
    (mark,) = wrapped.pytestmark
    assert mark.args == ("_actormesh_config", [{"cleanup_timeout": "7s"}])
    assert asyncio.run(wrapped({"cleanup_timeout": "7s"})) == 7.0
    assert get_config().cleanup_timeout != 7.0


def test_parametrize_helpers_restore_and_validate() -> None:
    def probe() -> None:
        pass

    product = parametrize_config(default_transport={"unix", "tcp"}, tls={False, True})(probe).pytestmark[0].args[1]
    assert sorted(map(sorted, (c.items() for c in product))) == sorted(
        sorted({"default_transport": t, "tls": b}.items()) for t in ("unix", "tcp") for b in (False, True))
    zipped = parametrize_config_pointwise(cleanup_timeout=["1s", "2s"], stop_timeout=["3s", "4s"])(probe).pytestmark[0].args[1]
    assert zipped == [{"cleanup_timeout": "1s", "stop_timeout": "3s"}, {"cleanup_timeout": "2s", "stop_timeout": "4s"}]
    assert get_runtime_config() == {}
    with pytest.raises(ValueError, match="same number of values"):
        parametrize_config_pointwise(cleanup_timeout=["1s"], stop_timeout=["1s", "2s"])
    with pytest.raises(ValueError, match="at least one setting"):
        parametrize_config()
    with pytest.raises(ConfigError, match="unknown config key"):
        parametrize_config(nope={1})
    with pytest.raises(TypeError, match="collection of values"):
        parametrize_config(cleanup_timeout="1s")


@pytest.fixture()
def _restore() -> object:
    yield
    clear_runtime_config()


class Logs(Actor):
    @endpoint
    def log(self, path: str) -> None:
        logger = logging.getLogger("compat.file")
        handler = logging.FileHandler(path)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            logger.info("from %s", "actor")
            logger.info("")  # empty messages stay empty
        finally:
            logger.removeHandler(handler)
            handler.close()


def test_python_logs_in_actors_get_the_actor_prefix_also_in_file_handlers(tmp_path: Path, _restore: object) -> None:
    procs = this_host().spawn_procs(per_host={"g": 1})
    try:
        logs = procs.spawn("logs", Logs)
        on = tmp_path / "on.log"
        logs.log.call_one(str(on)).get(timeout=60)
        assert on.read_text().splitlines() == ["[actor=<root>.<test_config_names.Logs logs{'g': 0/1}>] from actor", ""]
        config.prefix_python_logs_with_actor = False  # Monarch's spelling; travels to procs spawned after it
        assert get_config().prefix_python_logs_with_actor is False
        later = this_host().spawn_procs(per_host={"g": 1})
        try:
            off = tmp_path / "off.log"
            later.spawn("logs", Logs).log.call_one(str(off)).get(timeout=60)
            assert off.read_text().splitlines() == ["from actor", ""]
        finally:
            later.stop().get(timeout=30)
    finally:
        procs.stop().get(timeout=30)


def test_the_controller_logs_as_root() -> None:
    code = ("import logging, sys; logging.basicConfig(stream=sys.stdout, format='%(message)s'); "
            "logging.warning('before'); from actormesh.actor import context; context(); logging.warning('after')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["before", "[actor=<root>] after"]

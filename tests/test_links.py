"""The link-liveness rules in virtual time, the configuration check and the TCP
backstop (real processes: test_partitions.py)."""

from __future__ import annotations

import socket

import pytest

from actormesh import config
from actormesh.errors import ConfigError
from actormesh.runtime._links import silent_links
from actormesh.transport._sockets import tune_tcp


def test_a_link_silent_past_the_deadline_is_unreachable_and_traffic_keeps_it_alive():
    links = [("tcp:a:1", 100.0), ("tcp:b:1", 109.5)]
    assert silent_links(links, {}, now=110.0, timeout_s=10.0) == []  # exactly at the deadline: not yet
    assert silent_links(links, {}, now=110.5, timeout_s=10.0) == [("tcp:a:1", 10.5, None)]


def test_a_busy_proc_is_kept_while_its_host_agent_answers():
    judges = {"tcp:h:proc": "tcp:h:agent"}
    quiet_proc = [("tcp:h:proc", 0.0), ("tcp:h:agent", 29.0)]
    assert silent_links(quiet_proc, judges, now=30.0, timeout_s=10.0) == []  # busy, not gone
    both_quiet = [("tcp:h:proc", 0.0), ("tcp:h:agent", 15.0)]
    verdicts = silent_links(both_quiet, judges, now=30.0, timeout_s=10.0)
    assert verdicts == [("tcp:h:proc", 30.0, "tcp:h:agent"), ("tcp:h:agent", 15.0, None)]
    # A judge we hold no link to cannot vouch for anyone.
    assert silent_links([("tcp:h:proc", 0.0)], judges, now=30.0, timeout_s=10.0) == [("tcp:h:proc", 30.0, None)]


def test_link_timeout_must_be_positive_and_at_least_twice_the_heartbeat_interval():
    with pytest.raises(ConfigError, match=r"link_timeout \(0.8s\) must be at least twice heartbeat_interval \(0.5s\)"):
        config.configure(link_timeout=0.8)
    with pytest.raises(ConfigError, match="link_timeout"):
        config.configure(link_timeout=0)
    with pytest.raises(ConfigError, match=r"heartbeat_interval \(6s\)"):
        with config.configured(heartbeat_interval=6):
            pass
    assert config.get_config().link_timeout == 10.0  # nothing was changed by the refusals
    with config.configured(link_timeout=1.0, heartbeat_interval=0.5) as cfg:
        assert cfg.link_timeout == 1.0


def test_tcp_connections_get_keepalive_and_a_user_timeout_matching_the_deadline():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        tune_tcp(s, 10.0)
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10_000
            idle = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            interval = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
            count = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
            assert idle + interval * count <= 10  # keepalive gives up within the deadline too
    finally:
        s.close()

"""Monarch's configuration names, mapped onto actormesh's settings (a leaf module).

``configure(**kw)`` accepts Monarch's key names where actormesh has the same
setting; the table is documented in docs/config.md. A Monarch key that has
no actormesh equivalent raises :class:`ConfigError` saying why, as an unknown
key does. Values: durations as Monarch writes them (``"30s"``), transports as
:class:`ChannelTransport` members, ``default_encoding`` as :class:`Encoding`.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from typing import Any

from .errors import ConfigError

__all__ = ["ChannelTransport", "Encoding", "MONARCH_KEYS", "translate"]


class ChannelTransport(enum.Enum):
    """Monarch's channel transports; ``enable_transport`` and ``configure(default_transport=)`` take them.

    actormesh runs ``Unix`` (one host), ``TcpWithHostname`` /
    ``TcpWithLocalhost`` (tcp) and ``Tls`` (tcp with mutual TLS on the job's
    own CA). The others are Meta-internal or in-process only and are refused
    with the reason.
    """

    TcpWithLocalhost = "tcp(localhost)"
    TcpWithHostname = "tcp(hostname)"
    MetaTlsWithHostname = "metatls(hostname)"
    MetaTlsWithIpV6 = "metatls(ipv6)"
    MetaQuicWithHostname = "metaquic(hostname)"
    MetaQuicWithIpV6 = "metaquic(ipv6)"
    Quic = "quic"
    Tls = "tls"
    Local = "local"
    Unix = "unix"


class Encoding(enum.Enum):
    """Monarch's message encodings. actormesh always sends ``Multipart`` frames (a
    pickle-5 header plus out-of-band buffers as separate segments)."""

    Bincode = "bincode"
    Json = "json"
    Multipart = "multipart"


#: Monarch key -> actormesh key (same meaning).
MONARCH_KEYS: dict[str, str] = {
    "default_transport": "default_transport",
    "codec_max_frame_length": "codec_max_frame_length",
    "message_delivery_timeout": "message_delivery_timeout",
    "mesh_proc_spawn_max_idle": "proc_spawn_timeout",
    "stop_actor_timeout": "stop_timeout",
    # Monarch bounds an actor's stop and its proc's termination separately; actormesh's
    # stop_timeout bounds both (a proc is killed once it passes), so both keys set it.
    "mesh_terminate_timeout": "stop_timeout",
    "cleanup_timeout": "cleanup_timeout",
    "max_cast_fanout": "max_cast_fanout",
    "server_heartbeat_interval": "heartbeat_interval",
}

_WHY = {
    "enable_dest_actor_reordering_buffer": "actormesh always restores per-sender order at the receiver; it cannot be switched off",
    "enable_log_forwarding": "use `await procs.logging_option(stream_to_client=True)`; actormesh's spawners always read their procs' output",
    "host_spawn_ready_timeout": "actormesh jobs take their host wait time as a job argument",
    "message_ack_every_n_messages": "actormesh channels are TCP/unix streams without application-level acks",
    "message_ack_time_interval": "actormesh channels are TCP/unix streams without application-level acks",
    "mesh_admin_addr": "actormesh has no mesh admin HTTP server",
    "default_encoding": "actormesh always encodes Multipart frames (pickle 5 header + out-of-band buffers)",
}

#: Monarch 0.7.0's configuration keys that actormesh has no setting for.
_MONARCH_ONLY = frozenset(
    """actor_spawn_max_idle channel_net_rx_buffer_full_check_interval channel_reconnect_timeout channel_tcp_congestion
    channel_tcp_keepalive_idle enable_dest_actor_reordering_buffer enable_file_capture enable_log_forwarding
    enable_otel_metrics enable_otel_tracing enable_recorder_tracing enable_sqlite_tracing enable_unawaited_python_task_traceback
    file_log_level force_file_log forwarder_flush_timeout get_actor_state_max_idle get_proc_state_max_idle host_spawn_ready_timeout
    max_cast_dimension_size mesh_admin_addr mesh_admin_config_dump_bridge_timeout mesh_admin_max_concurrent_resolves
    mesh_admin_pyspy_bridge_timeout mesh_admin_pyspy_client_timeout mesh_admin_pyspy_max_profile_duration mesh_admin_pyspy_timeout
    mesh_admin_query_child_timeout mesh_admin_resolve_actor_timeout mesh_admin_single_host_timeout mesh_admin_tree_timeout
    mesh_attach_config_timeout mesh_bootstrap_enable_pdeathsig mesh_orphan_timeout mesh_terminate_concurrency
    message_ack_every_n_messages message_ack_time_interval message_latency_sampling_rate message_ttl_default monarch_log_suffix
    otel_metric_export_interval pending_actor_delivery_timeout prefix_with_rank proc_launcher_kind proc_stop_max_idle
    process_exit_timeout process_memory_metric_interval pyspy_bin rdma_cq_poller_per_device
    rdma_host_odp rdma_ibverbs_target rdma_max_chunk_size_mb rdma_max_nics_per_buffer rdma_min_stripe_size_kb
    rdma_peer_device_affinity rdma_qp_init_timeout rdma_qps_per_cq rdma_qps_per_peer rdma_runtime_worker_threads
    rdma_tcp_fallback_parallelism read_log_buffer scuba_log_enter_exit sequencer_max_locked_keys small_write_threshold
    split_max_buffer_age split_max_buffer_size stop_grace_period supervision_watchdog_timeout tail_log_lines
    terminated_snapshot_retention tokio_worker_threads use_direct_spawn""".split()
)

_TRANSPORT_VALUES: dict[Any, dict[str, Any]] = {
    ChannelTransport.Unix: {"default_transport": "unix"},
    ChannelTransport.TcpWithHostname: {"default_transport": "tcp"},
    ChannelTransport.TcpWithLocalhost: {"default_transport": "tcp"},
    ChannelTransport.Tls: {"default_transport": "tcp", "tls": True},
}


def translate(key: str, value: Any, names: Collection[str]) -> dict[str, Any]:
    """actormesh settings for one ``configure`` argument (``names``: actormesh's keys).

    Raises ConfigError for a Monarch key with no equivalent, naming the reason.
    An unknown key is returned as is (the caller reports it with the valid keys).
    """
    if key == "default_transport" and isinstance(value, ChannelTransport):
        if value not in _TRANSPORT_VALUES:
            raise ConfigError(f"default_transport={value}: not available in actormesh; use ChannelTransport.Unix, TcpWithHostname or Tls")
        return dict(_TRANSPORT_VALUES[value])
    if key == "default_encoding":
        if not isinstance(value, Encoding):
            from .config import ConfigTypeError

            raise ConfigTypeError(f"default_encoding expects an Encoding (e.g. Encoding.Multipart), got {value!r}")
        if value is not Encoding.Multipart:
            raise ConfigError(f"default_encoding={value}: {_WHY['default_encoding']}")
        return {}
    if key in names:
        return {key: value}
    if key in MONARCH_KEYS:
        return {MONARCH_KEYS[key]: value}
    if key in _MONARCH_ONLY:
        why = _WHY.get(key, "it configures a part of Monarch's Rust runtime that actormesh does not have")
        raise ConfigError(f"Monarch config key {key!r} has no equivalent in actormesh: {why}")
    return {key: value}

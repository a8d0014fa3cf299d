"""Anyone who can reach a port gets nowhere without the job secret."""

from __future__ import annotations

import os
import pickle
import socket
import struct

from actormesh.actor import Actor, endpoint
from actormesh.runtime import current_runtime
from actormesh.transport import parse_address


class Ping(Actor):
    @endpoint
    def ping(self) -> int:
        return os.getpid()


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _dial(address: str) -> socket.socket:
    scheme, target = parse_address(address)
    if scheme == "unix":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(target)
    else:
        s = socket.create_connection(target)
    s.settimeout(5)
    return s


def _frame(payload: bytes) -> bytes:
    return struct.pack("<QI", 8 + len(payload), 1) + struct.pack("<Q", len(payload)) + payload


def test_malicious_pickle_to_every_listening_socket_does_nothing(spawn_procs, tmp_path):
    procs = spawn_procs(per_host={"gpus": 2})
    pings = procs.spawn("pings", Ping)
    pids = pings.ping.call().get(timeout=30).values()
    addresses = [current_runtime().address, *procs._addresses]
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Evil(str(marker)))
    for address in addresses:
        # 1) a frame straight away, no handshake
        with _dial(address) as s:
            s.sendall(_frame(evil) * 3)
            try:
                while s.recv(4096):
                    pass
            except (socket.timeout, ConnectionResetError):
                pass
        # 2) a plausible-looking handshake with a made-up proof, then the frame
        with _dial(address) as s:
            s.sendall(b"AMESH\x01" + os.urandom(32) + os.urandom(32) + _frame(evil))
            try:
                while s.recv(4096):
                    pass
            except (socket.timeout, ConnectionResetError):
                pass
    assert not marker.exists()
    assert pings.ping.call().get(timeout=30).values() == pids  # nobody died, all still serve


def test_many_half_open_connections_do_not_block_real_traffic(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    ping = procs.spawn("ping", Ping)
    ping.ping.call_one().get(timeout=30)
    idle = []
    try:
        for address in (current_runtime().address, procs._addresses[0]):
            for _ in range(50):
                s = _dial(address)
                s.sendall(b"AMES")  # a few bytes, then silence
                idle.append(s)
        pid = ping.ping.call_one().get(timeout=10)
        answers = [ping.ping.call_one().get(timeout=10) for _ in range(200)]
        assert answers == [pid] * 200
    finally:
        for s in idle:
            s.close()

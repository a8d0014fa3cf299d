"""Transport layer: frames, codec, authenticated connections. Knows bytes, not actors."""

from ._auth import HANDSHAKE_BYTES, Handshake, new_secret
from ._codec import LostPayload, SerializationError, dumps, loads
from ._connection import Connection
from ._sockets import Listener, connect, listen, parse_address
from ._frames import FrameDecoder, Segment, encode_frame
from ._memory import buffer_address
from ._shm import ShmError, ShmPool
from ._tls import JobTLS

__all__ = [
    "HANDSHAKE_BYTES",
    "buffer_address",
    "Handshake",
    "new_secret",
    "SerializationError",
    "dumps",
    "loads",
    "Connection",
    "LostPayload",
    "Listener",
    "connect",
    "listen",
    "parse_address",
    "FrameDecoder",
    "Segment",
    "encode_frame",
    "JobTLS",
    "ShmError",
    "ShmPool",
]

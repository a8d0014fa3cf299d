"""Sans-I/O mutual authentication on a shared per-job secret.

Theory of operation
-------------------
Both ends send ``MAGIC + nonce`` (fixed size) as soon as the connection opens.
On receiving the peer's nonce each end sends
``HMAC-SHA256(secret, b"proof" + own_role + peer_nonce + own_nonce)``, and checks
the peer's proof computed with the peer's role. Roles ("dial"/"accept") differ, so
a proof cannot be reflected back to its sender; fresh nonces on both sides stop
replay. Nothing the peer sends is interpreted beyond fixed-size byte strings until
both proofs check out, so no byte is unpickled before authentication. The total
number of bytes read is fixed (``HANDSHAKE_BYTES``): reads are bounded by design;
time bounds are the caller's (see ``handshake_timeout``).
"""

from __future__ import annotations

import hashlib
import hmac
import os

from ..errors import AuthenticationError

__all__ = ["Handshake", "HANDSHAKE_BYTES", "new_secret"]

_MAGIC = b"AMESH\x01"
_NONCE = 32
_HELLO = len(_MAGIC) + _NONCE
_PROOF = 32
HANDSHAKE_BYTES = _HELLO + _PROOF


def new_secret() -> bytes:
    """A fresh random per-job secret."""
    return os.urandom(32)


class Handshake:
    """One side of the handshake. Feed it bytes; it returns bytes to send.

    >>> s = b"k" * 32
    >>> a, b = Handshake(s, dialer=True), Handshake(s, dialer=False)
    >>> pa, pb = a.receive(b.start()), b.receive(a.start())
    >>> _ = a.receive(pb), b.receive(pa)
    >>> a.done and b.done
    True
    """

    def __init__(self, secret: bytes, *, dialer: bool) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            raise ValueError("the job secret must be at least 16 bytes")
        self._secret = bytes(secret)
        self._role = b"dial" if dialer else b"accept"
        self._peer_role = b"accept" if dialer else b"dial"
        self._nonce = os.urandom(_NONCE)
        self._peer_nonce: bytes | None = None
        self._inbox = bytearray()
        self.done = False
        self.leftover = b""

    def __repr__(self) -> str:  # never show the secret
        return f"Handshake(role={self._role.decode()}, done={self.done})"

    def start(self) -> bytes:
        """Bytes to send as soon as the connection is open."""
        return _MAGIC + self._nonce

    def _proof(self, role: bytes, their_nonce: bytes, my_nonce: bytes) -> bytes:
        return hmac.new(self._secret, b"proof" + role + their_nonce + my_nonce, hashlib.sha256).digest()

    def receive(self, data: bytes) -> bytes:
        """Consume peer bytes; return bytes to send. Sets ``done`` on success.

        Raises AuthenticationError on a wrong magic or proof. Bytes after the
        handshake are kept in ``leftover`` for the frame decoder.
        """
        if self.done:
            raise AuthenticationError("handshake already complete")
        self._inbox += data
        out = b""
        if self._peer_nonce is None and len(self._inbox) >= _HELLO:
            if not hmac.compare_digest(bytes(self._inbox[: len(_MAGIC)]), _MAGIC):
                raise AuthenticationError("peer did not open with the actormesh handshake")
            self._peer_nonce = bytes(self._inbox[len(_MAGIC) : _HELLO])
            out = self._proof(self._role, self._peer_nonce, self._nonce)
        if self._peer_nonce is not None and len(self._inbox) >= HANDSHAKE_BYTES:
            theirs = bytes(self._inbox[_HELLO:HANDSHAKE_BYTES])
            expected = self._proof(self._peer_role, self._nonce, self._peer_nonce)
            if not hmac.compare_digest(theirs, expected):
                err = AuthenticationError(
                    "authentication failed: the peer holds a different job secret "
                    "(the address belongs to another job, or to a job that was restarted)"
                )
                # Our proof still goes out, so a dialer with the wrong secret learns
                # "wrong secret" at once instead of retrying a closed connection.
                err.reply = out  # type: ignore[attr-defined]
                raise err
            self.done = True
            self.leftover = bytes(self._inbox[HANDSHAKE_BYTES:])
            self._inbox = bytearray()
        return out

"""Envelope kinds and layouts. Envelopes are small tuples of builtins, pickled plainly;
user payloads travel as separate segments after them (see transport._frames).

Layouts (index 0 is the kind):

- CALL        (kind, actor, endpoint, reply, msg_index, msg_labels, msg_sizes, sender, seq)
- REPLY       (kind, port_id, index, status, sender)       status: OK | ERROR | SUPERVISION
- SPAWN       (kind, actor, rank, spawn_labels, spawn_sizes, owner, reply, mesh_name, display, is_async)
- STOP_ACTOR  (kind, actor, reply, index, sender, seq)
- CAST        (kind, actor, endpoint, reply, msg_labels, msg_sizes, sender, members)
              members: ((msg_index, address, seq), ...) of the subtree this node handles
- REPLY_MULTI (kind, port_id, ((index, status, nseg), ...), sender)  replies of a subtree,
              their payload segments concatenated in entry order

``(sender, seq)`` of CALL and STOP_ACTOR are appended by ``ProcRuntime.send``
(see _ordering.py); callers build the envelope without them.
- STOP_PROC   (kind, reply)
- HELLO       (kind, address, pid, error[, relay | RESTART]) ``relay`` asks a gateway to relay (see _gateway.py);
              RESTART: the dialer had given this peer up (unreachable) and numbers its messages afresh
- FAILURE     (kind, owner_actor, mesh_name, rank, cause, display, source_address)
- SINGLETON   (kind, name, reply)                          get_or_spawn_controller lookup at the root
- PING / PONG (kind,)                                      liveness probe from a spawner and its answer
- JOIN        (kind, address, hostname, pid)               a host agent announces itself to a controller
- RELAY_LOST  (kind, address, reason)                      gateway -> attached client: its leg to ``address`` is gone
- STATS       (kind, reply)                                ask a process for its telemetry snapshot (see _stats.py)

``reply`` is a port reference ``(address, port_id)`` or None. ``owner`` is an actor
reference ``(address, actor_name)``.
"""

CALL = 0
REPLY = 1
SPAWN = 2
STOP_ACTOR = 3
STOP_PROC = 4
HELLO = 5
FAILURE = 6
SINGLETON = 7
PING = 8
PONG = 9
JOIN = 10
CAST = 11
REPLY_MULTI = 12
RELAY_LOST = 13
STATS = 14

#: HELLO's last field from a dialer that revived the peer (see _peers.revive).
RESTART = "restart"

OK = 0
ERROR = 1
SUPERVISION = 2

#: Payloads with out-of-band data above this wait until the kernel has the bytes
#: before the sender goes on, so the sender may change its tensor afterwards.
BIG_PAYLOAD_BYTES = 1 << 20

"""Type-checked by tests/test_typing.py (mypy), never run: what users see of typed endpoints."""

from actormesh.actor import Actor, Port, ValueMesh, endpoint, concurrent_endpoint, this_host


class Counter(Actor):
    def __init__(self, start: int) -> None:
        self.n = start

    @endpoint
    def incr(self, by: int) -> int:
        self.n += by
        return self.n

    @endpoint
    async def name(self) -> str:
        return "c"

    @endpoint(explicit_response_port=True)
    def later(self, port: Port[float], x: int) -> None:
        port.send(x / 2)

    @concurrent_endpoint
    async def slow(self, s: str) -> bytes:
        return s.encode()

    @endpoint(instrument=False)
    def opt(self, flag: bool = False) -> list[int]:
        return [1]


def use() -> None:
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    c = procs.spawn("c", Counter, 0)
    reveal_type(c.incr.call_one(1))
    reveal_type(c.incr.call(2).get())
    reveal_type(c.name.choose())
    reveal_type(c.later.call_one(3))
    reveal_type(c.slow.stream("x"))
    reveal_type(c.opt.call_one(flag=True))
    c.incr.call_one("x")
    c.incr.broadcast()

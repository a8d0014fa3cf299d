"""The actor mailbox (runtime/_mailbox.py): order, batching, wake-ups, closing; no processes."""

from __future__ import annotations

import asyncio
import threading

import pytest

from actormesh.runtime._mailbox import LoopMailbox, ThreadMailbox, refuse_all

pytestmark = pytest.mark.timeout(30)


class CountingMailbox(ThreadMailbox[int]):
    def __init__(self) -> None:
        super().__init__()
        self.wakes = 0

    def _wake(self) -> None:
        self.wakes += 1
        super()._wake()


def test_items_come_out_in_put_order_and_a_burst_costs_one_wake_up() -> None:
    mb = CountingMailbox()
    assert mb.next_nowait() is None  # the taker goes to sleep
    for i in range(100):
        assert mb.put(i)
    assert mb.wakes == 1
    assert len(mb) == 100
    assert [mb.next() for _ in range(100)] == list(range(100))
    assert len(mb) == 0


def test_an_awake_taker_is_not_woken() -> None:
    mb = CountingMailbox()
    mb.put(1)
    mb.put(2)
    assert mb.next() == 1
    mb.put(3)
    assert [mb.next(), mb.next()] == [2, 3]
    assert mb.wakes == 0


def test_a_blocked_taker_wakes_on_put_from_another_thread() -> None:
    mb: ThreadMailbox[str] = ThreadMailbox()
    got: list[str] = []
    taker = threading.Thread(target=lambda: got.extend(mb.next() for _ in range(3)))
    taker.start()
    for item in ("a", "b", "c"):
        mb.put(item)
    taker.join(10)
    assert not taker.is_alive()
    assert got == ["a", "b", "c"]


def test_many_rounds_of_sleep_and_wake_lose_nothing() -> None:
    mb: ThreadMailbox[int] = ThreadMailbox()
    n = 20_000
    got: list[int] = []
    taker = threading.Thread(target=lambda: got.extend(mb.next() for _ in range(n)))
    taker.start()
    for i in range(n):
        mb.put(i)
    taker.join(20)
    assert got == list(range(n))


def test_close_returns_the_rest_of_the_batch_first_then_refuses_puts() -> None:
    mb: ThreadMailbox[tuple[str, None]] = ThreadMailbox()
    for item in ("a", "b", "c"):
        mb.put((item, None))
    assert mb.next() == ("a", None)  # "b" and "c" are now the taker's batch
    mb.put(("d", None))
    refused: list[str] = []
    refuse_all(mb, refused.append)
    assert refused == ["b", "c", "d"]
    assert mb.put(("e", None)) is False
    assert len(mb) == 0


def test_an_async_taker_sleeps_until_a_put_from_another_thread() -> None:
    loop = asyncio.new_event_loop()
    mb: LoopMailbox[int] = LoopMailbox(loop)
    n = 5_000

    async def take() -> list[int]:
        got: list[int] = []
        while len(got) < n:
            item = mb.next_nowait()
            if item is None:
                await mb.wait()
                continue
            got.append(item)
        return got

    def put_all() -> None:
        for i in range(n):
            mb.put(i)

    putter = threading.Thread(target=put_all)
    try:
        task = loop.create_task(take())
        loop.call_soon(putter.start)
        got = loop.run_until_complete(asyncio.wait_for(task, 20))
    finally:
        putter.join(10)
        loop.close()
    assert got == list(range(n))
    assert mb.put(1)  # a put to a closed loop's mailbox is still kept (until close())

"""``LLMEngine``: continuous batching in one process (or as rank 0 of a replica), streaming per request.

One loop thread owns the :class:`~._scheduler.Scheduler` and the model: each
turn it takes the requests, cancellations and weight swaps posted since the
last step, asks the scheduler for a :class:`~actormesh.parallel.StepPlan`,
runs it on the backend and delivers the resulting events to each request's
sink. Callers on any thread or event loop only post to the inbox, so a new
request joins the running batch at the next step and a cancelled one leaves
before it. Every request ends with exactly one terminal event (finished,
cancelled, or an error: a failed step, or the engine closing), so no caller
waits forever.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ..parallel import StepPlan
from ._backend import EngineBackend, LocalBackend
from ._scheduler import Event, Request, Scheduler, check_prompt
from ._types import SamplingParams

__all__ = ["LLMEngine", "EngineClosedError"]

#: The most logits one scored prompt may hold at once (float32, prompt x vocabulary): its pass
#: keeps every position's, unchunked (see actormesh.parallel._prompt_scores).
MAX_PROMPT_SCORE_BYTES = 2 << 30



def _item(event: Event) -> Any:
    """What a token event yields: the id, or with log-probabilities a tuple (see ``generate``);
    a scored prompt's event yields its :class:`PromptLogprobs`."""
    if event.prompt is not None:
        return event.prompt
    if event.logprob is None:
        return event.token
    if event.top is None:
        return (event.token, event.logprob)
    return (event.token, event.logprob, event.top)

class EngineClosedError(RuntimeError):
    """The engine was closed (or broke) before the request finished."""


class LLMEngine:
    """Continuous-batching generation with a KV cache; a :class:`~actormesh.serve.TokenGenerator`.

    Up to ``max_slots`` requests decode together; more wait for a free slot.
    ``compile=True`` runs the model through ``torch.compile`` (slow first
    steps, then much faster ones; see ``actormesh.parallel.StepRunner``).
    ``generate`` streams each request's tokens as they are sampled
    (``after_events(next_step_s)``, if given, runs on the loop thread after
    each step's events were delivered, so a transport can batch them there;
    ``next_step_s`` is how long the next step is expected to take, the last
    one's duration, or None when the events must go now: the engine is about
    to wait, or the next step admits requests, whose prefill takes longer); greedy
    output is token for token what Hugging Face ``generate(do_sample=False)``
    gives the same model for that prompt alone.

    Example::

        import torch, transformers
        from actormesh.parallel.hf import hf_causal_lm
        from actormesh.serve import LLMEngine, SamplingParams

        model = hf_causal_lm(transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=128, tie_word_embeddings=False))
        with LLMEngine(model, max_slots=8) as engine:
            print(engine.complete([[1, 2, 3]], SamplingParams(max_tokens=8)))    # blocking helper
            # in async code:  async for tok in engine.generate([1, 2, 3], params): ...
    """

    def __init__(self, model: Any = None, *, backend: EngineBackend | None = None, max_slots: int = 32,
                 max_context: int | None = None, seed: int | None = None, idle_s: float = 1.0, name: str = "llm-engine",
                 after_events: Callable[[float | None], None] | None = None, compile: bool | str = False) -> None:
        if (model is None) == (backend is None):
            raise TypeError("LLMEngine needs exactly one of model= (a model in this process) or backend=")
        self.backend: EngineBackend = backend if backend is not None else LocalBackend(model, max_slots, max_context,
                                                                                      compile=compile)
        self.max_context: int = self.backend.max_context
        self._scheduler = Scheduler(max_slots, self.max_context, seed)
        self._cond = threading.Condition()
        self._inbox: deque[tuple[str, Any]] = deque()
        self._closing = False
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self._idle_s = idle_s
        self._after_events = after_events  # e.g. send each caller's events of this step in one message
        self.steps = 0  #: steps run so far
        self.tokens_generated = 0
        self.step_s = 0.0  #: seconds spent in backend.run
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ----------------------------------------------------------- callers' side

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints; ValueError naming the problem if this engine cannot run it
        (see ``check_prompt``; also a prompt to score on a backend that cannot score prompts)."""
        ids = check_prompt(list(prompt_ids), params, self.max_context, self.backend.vocab_size)
        if params.prompt_logprobs is not None:
            if not hasattr(self.backend, "last_prompt_logprobs"):
                raise ValueError(f"prompt_logprobs: this engine's backend ({type(self.backend).__name__}) does not "
                                 "score prompts (it has no last_prompt_logprobs); drop prompt_logprobs")
            vocab = self.backend.vocab_size
            if vocab is not None and len(ids) * vocab * 4 > MAX_PROMPT_SCORE_BYTES:
                raise ValueError(f"prompt_logprobs: scoring a prompt of {len(ids)} tokens over a vocabulary of {vocab} "
                                 f"holds {len(ids) * vocab * 4 / 2**30:.1f} GiB of logits at once (at most "
                                 f"{MAX_PROMPT_SCORE_BYTES / 2**30:.0f} GiB); score a shorter prompt")
        return ids

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Callable[[Event], None],
               request_id: str | None = None) -> str:
        """Queue a request; ``sink`` (called on the engine thread) gets its events. Returns its id.

        Raises ValueError for a prompt that is empty, out of vocabulary or over
        ``max_context`` (with ``max_tokens``), EngineClosedError after close.
        """
        ids = self.check(prompt_ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        self._post("add", Request(rid, ids, params, sink))
        return rid

    def submit_many(self, requests: Sequence[tuple[str, Sequence[int], SamplingParams, Callable[[Event], None]]]) -> None:
        """Queue several ``(request_id, prompt_ids, params, sink)`` at once: they join the same step.

        Validates every prompt first and raises ValueError for the first bad
        one (then none is queued), EngineClosedError after close.
        """
        checked = [Request(rid, self.check(ids, params), params, sink)
                   for rid, ids, params, sink in requests]
        self._post_all([("add", req) for req in checked])

    def cancel(self, request_id: str) -> None:
        """Stop a request; its slot is free from the next step. Unknown or finished ids are ignored."""
        self._post("cancel", request_id, check=False)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[int]:
        """Stream the new token ids of one request (the TokenGenerator protocol); with
        ``params.logprobs``, ``(token id, log-probability)`` pairs, and with ``params.top_logprobs``
        ``(token id, log-probability, ((id, log-probability), ...))``.

        Validates at once (ValueError for a prompt over the context); the
        request starts when the iterator is first awaited. Closing it early
        (``aclose()``, breaking out and dropping it) cancels the request.
        """
        ids = self.check(prompt_ids, params)
        return self._stream(ids, params)

    async def _stream(self, ids: list[int], params: SamplingParams) -> AsyncIterator[int]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        rid = f"req-{next(self._ids)}"

        def sink(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the caller's loop is gone: nobody is listening
                self.cancel(rid)

        self.submit(ids, params, sink, rid)
        finished = False
        try:
            while True:
                event = await queue.get()
                if event.error is not None:
                    finished = True
                    raise event.error
                if event.finish is not None:
                    finished = True
                    return
                yield _item(event)
        finally:
            if not finished:
                self.cancel(rid)

    def complete(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 timeout_s: float = 300.0) -> list[list[int]]:
        """Blocking helper: generate for every prompt at once (one batch); the new tokens of each.

        Raises the first request's error, or TimeoutError after ``timeout_s``
        (the requests are then cancelled).
        """
        per = list(params) if not isinstance(params, SamplingParams) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per)} SamplingParams")
        outs: list[list[int]] = [[] for _ in prompts]
        errors: list[BaseException] = []
        left = threading.Semaphore(0)

        def sink_for(i: int) -> Callable[[Event], None]:
            def sink(event: Event) -> None:
                if event.token is not None:
                    outs[i].append(event.token)
                    return
                if event.prompt is not None:
                    return  # complete() gives the new tokens only
                if event.error is not None:
                    errors.append(event.error)
                left.release()
            return sink

        for i, p in enumerate(prompts):  # validate all before starting any
            self.check(p, per[i])
        rids = [self.submit(p, per[i], sink_for(i)) for i, p in enumerate(prompts)]
        deadline = _Deadline(timeout_s)
        for _ in rids:
            if not left.acquire(timeout=deadline.left()):
                for rid in rids:
                    self.cancel(rid)
                raise TimeoutError(f"{len(prompts)} requests did not finish within {timeout_s}s (cancelled)")
        if errors:
            raise errors[0]
        return outs

    def update_weights(self, weights: Any, drain: bool = False, timeout_s: float = 300.0) -> None:
        """Install new weights between two steps; no request is lost.

        ``drain=False`` (double buffer): the new weights are already complete
        in memory, and running requests continue on them from the next step.
        ``drain=True``: admissions pause, running requests finish on the old
        weights, then the swap happens and waiting requests start on the new.
        """
        done = threading.Event()
        failure: list[BaseException] = []
        self._post("swap", (weights, drain, done, failure))
        if not done.wait(timeout_s):
            raise TimeoutError(f"weight swap not done within {timeout_s}s (still queued; running requests may be long)")
        if failure:
            raise failure[0]

    def stats(self) -> dict[str, Any]:
        """Counters (read without locking: a snapshot that may be one step old)."""
        s = self._scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "free_slots": len(s.free),
                "steps": self.steps, "tokens_generated": self.tokens_generated, "step_s": round(self.step_s, 6)}

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the loop; requests still waiting or running fail with EngineClosedError."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"the engine loop did not stop within {timeout_s}s (a step is still running)")

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _post(self, kind: str, item: Any, check: bool = True) -> None:
        self._post_all([(kind, item)], check)

    def _post_all(self, items: list[tuple[str, Any]], check: bool = True) -> None:
        with self._cond:
            if self._closing or self._dead is not None:
                if not check:
                    return
                raise EngineClosedError(f"the engine is closed{f': {self._dead!r}' if self._dead else ''}")
            self._inbox.extend(items)
            self._cond.notify_all()

    # -------------------------------------------------------------- loop thread

    def _loop(self) -> None:
        error: BaseException | None = None
        swaps: list[Any] = []
        try:
            while True:
                with self._cond:
                    if not (self._inbox or self._closing or self._scheduler.has_work() or swaps):
                        self._cond.wait(self._idle_s)
                    inbox, self._inbox = list(self._inbox), deque()
                    if self._closing:
                        break
                swaps.extend(self._take(inbox))
                swaps = self._swap_if_ready(swaps)
                plan = self._scheduler.plan()
                if plan is None:
                    self._flush(None)
                    self.backend.idle()
                    continue
                self._flush(self._step(plan))
        except BaseException as exc:  # the backend broke: nothing more can run
            error = exc
        finally:
            with self._cond:
                self._dead = error or EngineClosedError("the engine was closed")
                inbox, self._inbox = list(self._inbox), deque()
            self._shutdown(error, inbox, swaps)

    def _take(self, inbox: list[tuple[str, Any]]) -> list[Any]:
        swaps = []
        for kind, item in inbox:
            if kind == "add":
                self._scheduler.add(item)
            elif kind == "cancel":
                req = self._scheduler.cancel(item)
                if req is not None:
                    _deliver(req, Event(finish="cancelled"))
            else:
                swaps.append(item)
        return swaps

    def _swap_if_ready(self, swaps: list[Any]) -> list[Any]:
        """Apply queued swaps (a draining one once the batch is empty); the ones still waiting."""
        while swaps:
            weights, drain, done, failure = swaps[0]
            if drain and self._scheduler.running:
                self._scheduler.admitting = False
                return swaps
            try:
                self.backend.swap(weights)
            except Exception as exc:  # bad weights: report to the caller, keep serving the old ones
                failure.append(exc)
            self._scheduler.admitting = True
            done.set()
            swaps = swaps[1:]
        return swaps

    def _step(self, plan: StepPlan) -> float | None:
        """Run one step; how long the next is expected to take (None: it admits requests, or this one failed)."""
        t0 = time.perf_counter()
        try:
            tokens = self.backend.run(plan)
        except Exception as exc:
            if getattr(self.backend, "broken", False):
                raise
            # A failed step (e.g. out of memory) fails the requests in it, not the engine.
            for req in [self._scheduler.running[s] for s in plan.slots]:
                self._scheduler.cancel(req.id)
                _deliver(req, Event(error=RuntimeError(f"generation step failed: {exc!r}")))
            return None
        took = time.perf_counter() - t0
        self.steps += 1
        self.step_s += took
        logprobs = getattr(self.backend, "last_logprobs", None) if plan.logprobs else None
        tops = getattr(self.backend, "last_top_logprobs", None) if plan.top_logprobs else None
        prompts = getattr(self.backend, "last_prompt_logprobs", None) if plan.prompt_logprobs else None
        for req, event in self._scheduler.commit(plan, tokens, logprobs, tops, prompts):
            if event.token is not None:
                self.tokens_generated += 1
            _deliver(req, event)
        sched = self._scheduler
        return None if self._inbox or (sched.waiting and sched.admitting and sched.free) else took

    def _shutdown(self, error: BaseException | None, inbox: list[tuple[str, Any]], swaps: list[Any]) -> None:
        swaps = swaps + [item for kind, item in inbox if kind == "swap"]
        why = EngineClosedError(f"the engine stopped: {error!r}" if error else "the engine was closed")
        for req in self._scheduler.drop_all() + [item for kind, item in inbox if kind == "add"]:
            _deliver(req, Event(error=why))
        for _, _, done, failure in swaps:
            failure.append(why)
            done.set()
        self._flush(None)
        try:
            self.backend.close()
        except Exception:
            pass

    def _flush(self, next_step_s: float | None) -> None:
        if self._after_events is not None:
            try:
                self._after_events(next_step_s)
            except Exception:  # a caller's transport must not stop the loop for everyone else
                pass


def _deliver(req: Request, event: Event) -> None:
    try:
        req.sink(event)
    except Exception:  # a caller's sink must not stop the loop for everyone else
        pass


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self._end - time.monotonic())

"""``grad_generator``: backward one requested gradient at a time, and
``grad_function``: an autograd function written as a forward with its backward.

``for g in grad_generator(loss, [w3, w2, w1]):`` yields each gradient as soon
as the part of the backward graph it needs has run, then runs only the next
part when asked for the next one. Between two yields the caller can issue work
that uses the gradient (``g.reduce_("dp", "avg")``), so on the workers that
work is queued between the backward stages instead of after the whole backward.
Ask in the order gradients become available (last layer first) to keep each
stage small; any order gives the same values.

How a stage runs: the gradients still to be propagated sit on *frontier*
edges (the inputs of backward nodes not run yet). Asking for the gradient at
edge ``(N, k)`` runs exactly the nodes that have not run and lead to ``N``,
(grown so that every node they feed gets all its inputs from them or from
earlier stages), with one ``torch.autograd.grad`` call from the frontier edges
into those nodes that asks for the edges leaving the stage: the new frontier
(so hooks, broadcasting reductions and custom Functions behave as in a normal
backward). Each node runs once, so the graph is freed as it goes (as with
``retain_graph=False``). One difference from a single backward: a hook
registered on an intermediate tensor whose node is just past a stage's end
runs when that stage ends (with the stage's part of the gradient) and again
when its node runs in a later stage (with all of it); a parameter's hooks run
once per stage that sends it gradient (once, unless it is used in several
places). Like ``torch.autograd.grad``, nothing is
accumulated into ``.grad``; a tensor the roots do not depend on yields None.

Stages run in the caller's context: the active mesh and stream where the
iteration happens (Monarch restores the forward's mesh and stream per node; in
actormesh, ops of distributed tensors go to their own mesh anyway).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["grad_generator", "grad_function"]

TensorOrEdge = Union[torch.Tensor, GradientEdge]
_Edge = tuple[Any, int]  # (backward node, index of its input)


def _edge(x: TensorOrEdge) -> _Edge:
    e = x if isinstance(x, GradientEdge) else get_gradient_edge(x)
    return (e.node, e.output_nr)


def grad_generator(
    roots: Union[torch.Tensor, Sequence[TensorOrEdge]] = (),
    with_respect_to: Sequence[TensorOrEdge] = (),
    grad_roots: Sequence[torch.Tensor | None] = (),
) -> Iterator[torch.Tensor | None]:
    """Yield d(roots)/d(x) for each x of ``with_respect_to``, in that order, running
    the backward incrementally (see the module doc).

    ``grad_roots[i]`` is the gradient flowing into ``roots[i]`` (default: ones,
    for a one-element root). Raises RuntimeError, as ``torch.autograd.grad``
    does, for a root that does not require grad or a non-scalar root without
    its grad.
    """
    if isinstance(roots, (torch.Tensor, GradientEdge)):
        roots = [roots]
    return _Backward(list(roots), list(with_respect_to), list(grad_roots)).run()


class _Backward:
    """The state of one incremental backward: the graph, what ran, the frontier."""

    def __init__(self, roots: list[TensorOrEdge], wrt: list[TensorOrEdge], grad_roots: list[Any]) -> None:
        if len(grad_roots) > len(roots):
            raise ValueError(f"grad_generator: {len(grad_roots)} grad_roots for {len(roots)} roots")
        self.frontier: dict[_Edge, torch.Tensor] = {}
        for i, root in enumerate(roots):
            grad = grad_roots[i] if i < len(grad_roots) else None
            if grad is None:
                if isinstance(root, GradientEdge) or root.numel() != 1:
                    raise RuntimeError(f"grad_generator: root {i} is not a scalar: give its gradient in grad_roots "
                                       "(grad can be implicitly created only for scalar outputs)")
                grad = torch.ones_like(root)
            self._add(_edge(root), grad)
        self.targets = [_edge(w) for w in wrt]
        self.preds = self._walk([e[0] for e in self.frontier])
        self.done: set[Any] = set()
        self.captured: dict[int, torch.Tensor | None] = {}

    def _walk(self, starts: list[Any]) -> dict[Any, list[Any]]:
        """Every node the roots reach -> the nodes that feed it."""
        preds: dict[Any, list[Any]] = {n: [] for n in starts}
        todo = list(starts)
        while todo:
            node = todo.pop()
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                if nxt not in preds:
                    preds[nxt] = []
                    todo.append(nxt)
                preds[nxt].append(node)
        return preds

    def _add(self, edge: _Edge, grad: torch.Tensor) -> None:
        old = self.frontier.get(edge)
        self.frontier[edge] = grad if old is None else old + grad

    def _needed(self, node: Any, stop: set[Any]) -> set[Any]:
        """The nodes not run yet (and not in ``stop``) that lead to ``node``."""
        out: set[Any] = set()
        todo = [p for p in self.preds.get(node, ()) if p not in self.done and p not in stop]
        while todo:
            n = todo.pop()
            if n in out:
                continue
            out.add(n)
            todo.extend(p for p in self.preds[n] if p not in self.done and p not in out and p not in stop)
        return out

    def _closed_stage(self, node: Any) -> set[Any]:
        """``_needed(node)``, grown until every node it feeds has all its producers in
        it or already run: the engine then computes every gradient the stage sends out
        (it skips outputs that no requested input needs)."""
        stage = self._needed(node, set())
        while stage:
            fed = {m for n in stage for m, _ in n.next_functions if m is not None and m not in stage}
            extra: set[Any] = set()
            for m in fed:
                extra |= self._needed(m, stage)
            if not extra:
                break
            stage |= extra
        return stage

    def run(self) -> Iterator[torch.Tensor | None]:
        for i, target in enumerate(self.targets):
            if i in self.captured:
                yield self.captured.pop(i)
                continue
            stage = self._closed_stage(target[0])
            if stage:
                self._stage(stage, i)
            yield self.frontier.get(target)

    def _stage(self, stage: set[Any], i: int) -> None:
        later = [j for j in range(i + 1, len(self.targets)) if j not in self.captured and self.targets[j][0] in stage]
        outs = [(e, g) for e, g in self.frontier.items() if e[0] in stage]
        sent = list({(m, k) for n in stage for m, k in n.next_functions if m is not None and m not in stage})
        wanted = sent + [self.targets[j] for j in later]
        got = torch.autograd.grad([GradientEdge(n, k) for (n, k), _ in outs], [GradientEdge(n, k) for n, k in wanted],
                                  grad_outputs=[g for _, g in outs], allow_unused=True, retain_graph=False)
        for e, _ in outs:
            del self.frontier[e]
        self.done |= stage
        for e, g in zip(sent, got):
            if g is not None:
                self._add(e, g)
        for j, g in zip(later, got[len(sent):]):
            self.captured[j] = g


class _GradFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], *args: Any) -> Any:  # type: ignore[override]
        result, backward = fn(*args)
        ctx.backward_fn = backward
        return result

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        out = ctx.backward_fn(*grads)
        return (None, *out) if isinstance(out, tuple) else (None, out)


def grad_function(fn: Callable[..., tuple[Any, Callable[..., Any]]]) -> Callable[..., Any]:
    """An autograd function from ``fn(*args) -> (result, backward)``, where
    ``backward(*grad_results)`` returns one gradient (or None) per argument.

    >>> @grad_function                                 # doctest: +SKIP
    ... def to_mesh(x, mesh):
    ...     omesh = x.mesh
    ...     return x.to_mesh(mesh), lambda g: (g.to_mesh(omesh), None)
    """

    @functools.wraps(fn)
    def apply(*args: Any) -> Any:
        return _GradFunction.apply(fn, *args)

    return apply

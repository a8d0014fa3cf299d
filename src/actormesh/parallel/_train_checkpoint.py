"""Trainer checkpoints with ``torch.distributed.checkpoint`` (DCP): model, optimizer, LR schedule, data position.

A checkpoint is one DCP directory. Its keys are the full model's parameter
names (``model.<fqn>``), the optimizer state flattened by those names
(``optim.state.<fqn>.exp_avg``, ...), ``steps`` (optimizer steps done),
``data_position`` (batches drawn from the rank-side data, see
:mod:`._train_data`) and ``lr_schedule`` (the LR scheduler's state: the same on
every rank, so DCP keeps one copy). Each rank writes and reads only its
shards; DCP reshards on load, so a checkpoint resumes under another plan or
world size.

Before reading any tensor, :func:`check_compatible` compares the
checkpoint's metadata with the model's names and shapes (taken from the
model built on the meta device, identical on every rank), so a checkpoint of
another model fails on every rank alike, naming the first mismatched key,
instead of failing in a collective half-way through a load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["CheckpointMismatch", "model_shapes", "check_compatible", "save_checkpoint", "load_checkpoint"]


class CheckpointMismatch(ValueError):
    """A checkpoint does not belong to this model; the message names the first key that differs."""


def model_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """``{fqn: shape}`` of a (meta) model's state dict, in its order."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_compatible(path: str, shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
    """Raise CheckpointMismatch unless the checkpoint at ``path`` holds exactly this model; its top-level keys."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"no checkpoint at {path!r} (expected a directory written by trainer.save): {exc}") from exc
    saved = {k.removeprefix("model."): v for k, v in meta.items() if k.startswith("model.")}
    for name, shape in shapes.items():
        entry = saved.get(name)
        if entry is None:
            raise CheckpointMismatch(f"checkpoint {path!r} is not of this model: first mismatched key {name!r} is in the model "
                                     f"but not in the checkpoint")
        got = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        if got != shape:
            raise CheckpointMismatch(f"checkpoint {path!r} is not of this model: first mismatched key {name!r} has shape "
                                     f"{list(got) if got is not None else 'non-tensor'} in the checkpoint, {list(shape)} in the model")
    extra = [k for k in saved if k not in shapes]
    if extra:
        raise CheckpointMismatch(f"checkpoint {path!r} is not of this model: first mismatched key {extra[0]!r} is in the checkpoint "
                                 f"but not in the model ({len(extra)} such keys)")
    return {k.split(".", 1)[0] for k in meta}


def _state(chunks: Sequence[Any], optimizers: Sequence[Any]) -> dict[str, Any]:
    """Sharded model + optimizer state keyed by the full model's names (DCP's format)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for chunk, opt in zip(chunks, optimizers):
        model.update(get_model_state_dict(chunk))
        optim.update(get_optimizer_state_dict(chunk, opt, options=flat))
    return {"model": model, "optim": optim}


def save_checkpoint(path: str, chunks: Sequence[Any], optimizers: Sequence[Any], schedulers: Sequence[Any],
                    steps: int, data_position: int) -> None:
    """Write this rank's shards and the counters to ``path`` (collective)."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = _state(chunks, optimizers)
    state["steps"] = torch.tensor(steps)
    state["data_position"] = torch.tensor(data_position)
    if schedulers:
        state["lr_schedule"] = schedulers[0].state_dict()  # one schedule drives every chunk's optimizer
    dcp.save(state, checkpoint_id=path)


def load_checkpoint(path: str, chunks: Sequence[Any], optimizers: Sequence[Any], schedulers: Sequence[Any],
                    shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
    """Load ``path`` into the chunks, optimizers and schedulers (collective); returns (steps, data position).

    Checkpoints written before the data position existed load with position = steps.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    present = check_compatible(path, shapes)
    state = _state(chunks, optimizers)
    state["steps"] = torch.tensor(0)
    if "data_position" in present:
        state["data_position"] = torch.tensor(0)
    if schedulers and "lr_schedule" in present:
        state["lr_schedule"] = schedulers[0].state_dict()
    dcp.load(state, checkpoint_id=path)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    for chunk, opt in zip(chunks, optimizers):
        set_model_state_dict(chunk, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(chunk, opt, state["optim"], options=flat)
    if "lr_schedule" in state:
        for sched in schedulers:
            sched.load_state_dict(dict(state["lr_schedule"]))
    steps = int(state["steps"])
    return steps, int(state.get("data_position", steps))

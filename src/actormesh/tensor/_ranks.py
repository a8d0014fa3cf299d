"""``procs.rank_tensor(dim)``: each proc's coordinate, as a distributed tensor."""

from __future__ import annotations

from typing import Any

import torch

from ._client import client_for
from ._tensor import Tensor

__all__ = ["rank_tensor"]

_META = ((), (), 0, torch.long, torch.device("cpu"))


def rank_tensor(procs: Any, dim: str) -> Tensor:
    """A 0-dim long tensor holding each proc's coordinate along ``dim`` of ``procs``."""
    view = client_for(procs).view(procs)
    if dim not in view.shape.labels:
        raise KeyError(f"{dim!r} is not a dim of mesh {dict(procs.sizes)}")
    out = Tensor._make(_META, view)
    view.client.record((4, out._ref.id, dim, view.sid))
    return out

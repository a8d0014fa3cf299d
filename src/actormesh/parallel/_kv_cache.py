"""A key/value cache of fixed slots for batched generation (continuous batching).

Theory of operation: the cache holds, per attention layer, two tensors
``[max_slots, max_len, heads, head_dim]``. A request owns one slot from its
prefill until it finishes; its token at position ``p`` has its keys/values at
``[slot, p]`` (one ``index_copy_`` writes a step's rows). When the rows are
consecutive slots (the scheduler orders rows by slot, so a full batch is),
the keys to attend over are a view of the cache, not a copy. One forward pass covers a batch of rows (one row per slot,
``T`` new tokens per row at positions ``positions[row]``):
:meth:`KVCache.bind` sets which slots and positions the pass writes, then each
layer calls :meth:`KVCache.update` (the method Hugging Face attention calls on
its ``past_key_values``) with the new keys/values; it writes them and returns
the slot rows ``[:kv_len]`` to attend over, and :meth:`KVCache.mask` says which
of those keys each query may see (``key position <= query position``, within
the sliding window for sliding layers).

Positions a row does not own yet may hold stale values (another request's, or
a padded prefill's): they are never attended, because a row writes position
``p`` before it attends to it and the mask hides everything after the query.

Under tensor parallelism each rank's attention computes only its own heads, so
the cache is allocated lazily from the first keys it sees and holds that
rank's heads only; under pipeline parallelism a stage allocates only its own
layers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVCache"]


class KVCache:
    """Slot-indexed key/value tensors for the layers of one model chunk.

    Example::

        cache = KVCache(max_slots=4, max_len=64)
        cache.bind(torch.tensor([2]), torch.arange(5)[None])   # slot 2, positions 0..4
        logits = model.forward_cached(tokens, positions, cache)
    """

    def __init__(self, max_slots: int, max_len: int, sliding_window: int | None = None) -> None:
        if max_slots < 1 or max_len < 1:
            raise ValueError(f"KVCache needs max_slots >= 1 and max_len >= 1, got {max_slots}, {max_len}")
        self.max_slots, self.max_len, self.sliding_window = max_slots, max_len, sliding_window
        #: read consecutive slots as views; under torch.compile this makes one more graph (rows that are
        #: not consecutive slots), and it saves a copy of the batch's keys and values per layer and step
        self.views = True
        self.keys: dict[int, Any] = {}
        self.values: dict[int, Any] = {}
        self._slots: Any = None
        self._flat: Any = None  # slot * max_len + position of each new token, row-major
        self._span: tuple[int, int] | None = None  # (first, last + 1) when the rows are consecutive slots
        self._kv_len = 0
        self._uniform = False
        self._masks: dict[str, Any] = {}
        self._positions: Any = None

    def bind(self, slots: Any, positions: Any, uniform: bool = False, *, slot_ids: list[int] | None = None,
             kv_len: int | None = None) -> None:
        """Set the next forward's rows: ``slots[B]`` and the ``positions[B, T]`` of their new tokens.

        ``uniform``: every row has the same positions (no padding), so full
        attention needs no mask: each query sees every key up to its own
        position (:meth:`mask` may then answer None, i.e. causal).
        ``slot_ids`` (``slots`` as a list) and ``kv_len`` (the largest
        position + 1), when the caller has them, save reading them back from
        the tensors.
        """
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        if kv_len > self.max_len:
            raise ValueError(f"position {kv_len - 1} is beyond the cache's max_len={self.max_len}")
        self._slots = slots
        self._positions = positions
        self._flat = None  # made at the first update: under torch.compile, inside the graph
        ids = slot_ids if slot_ids is not None else slots.tolist()
        consecutive = self.views and ids == list(range(ids[0], ids[0] + len(ids)))
        self._span = (ids[0], ids[0] + len(ids)) if consecutive else None
        self._kv_len = kv_len
        self._uniform = uniform
        self._masks = {}  # each built on first use: under torch.compile inside the graph; a uniform step under SDPA needs none

    def mask(self, layer_type: str = "full_attention", allow_causal: bool = False) -> Any:
        """Boolean ``[B, 1, T, kv_len]`` mask (True = attend) for the bound rows.

        With ``allow_causal``, None when plain causal attention is the same
        (uniform rows, no window cutting in): the caller then attends with
        ``is_causal=T > 1`` and takes a faster kernel.
        """
        window = self.sliding_window if layer_type == "sliding_attention" else None
        if allow_causal and self._uniform and (window is None or self._kv_len <= window):
            return None
        if layer_type not in ("full_attention", "sliding_attention") or (layer_type == "sliding_attention" and not window):
            raise ValueError(f"no {layer_type!r} mask: the cache was made with sliding_window={self.sliding_window}")
        if layer_type not in self._masks:
            self._build_mask(layer_type)
        return self._masks[layer_type]

    def _build_mask(self, layer_type: str) -> None:
        import torch

        window = self.sliding_window if layer_type == "sliding_attention" else None
        positions = self._positions
        keys = torch.arange(self._kv_len, device=positions.device)
        visible = keys[None, None, :] <= positions[:, :, None]  # [B, T, L]
        if window:
            visible = visible & (positions[:, :, None] - keys[None, None, :] < window)
        self._masks[layer_type] = visible[:, None]

    def update(self, key: Any, value: Any, layer_idx: int, *_: Any, **__: Any) -> tuple[Any, Any]:
        """Store ``key``/``value`` ``[B, heads, T, head_dim]`` of layer ``layer_idx``; return ``[B, heads, kv_len, head_dim]``."""
        import torch

        if self._slots is None:
            raise RuntimeError("KVCache.update before bind(): call cache.bind(slots, positions) before the forward")
        if layer_idx not in self.keys:
            shape = (self.max_slots, self.max_len, key.shape[1], key.shape[3])
            self.keys[layer_idx] = torch.zeros(shape, dtype=key.dtype, device=key.device)
            self.values[layer_idx] = torch.zeros(shape, dtype=value.dtype, device=value.device)
        if self._flat is None:
            self._flat = (self._slots[:, None] * self.max_len + self._positions).reshape(-1)
        out = []
        for new, cache in ((key, self.keys[layer_idx]), (value, self.values[layer_idx])):
            rows = new.transpose(1, 2).reshape(-1, *cache.shape[2:])
            if rows.dtype != cache.dtype:
                rows = rows.to(cache.dtype)
            cache.view(-1, *cache.shape[2:]).index_copy_(0, self._flat, rows)
            if self._span is not None:
                seen = cache[self._span[0]:self._span[1], : self._kv_len]
            else:
                seen = cache.index_select(0, self._slots)[:, : self._kv_len]
            out.append(seen.transpose(1, 2))
        return out[0], out[1]

    def clear(self) -> None:
        """Free every layer's tensors (they are reallocated on the next update)."""
        self.keys.clear()
        self.values.clear()

"""Host tier: the routing of KV chunks that a KV offload tier holds, keyed as that
tier keys their KV.

A KV offload tier (vLLM's ``OffloadingConnector``) copies chunks of KV blocks to host
memory and loads them back into new blocks on a later prefix hit. Their routing, kept
by KV slot in :class:`~slotroute.store.RoutedExpertsManager`, would die with the GPU
blocks; :class:`RoutingTier` keeps it as long as the offload tier keeps the KV, and no
longer. ``slotroute/vllm/offload.py`` connects it to vLLM.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import numpy as np

from slotroute.spec import RoutingSpec

__all__ = ["RoutingTier"]

# What an entry holds while its KV's store is in flight and no rows are captured yet.
_AWAITING = None


class RoutingTier:
    """Rows of KV chunks, by the key under which an offload tier stores their KV.

    Invariant: :meth:`get` returns a key's rows only between the :meth:`complete` of
    the store that captured them and the next :meth:`expect`, :meth:`drop` or
    :meth:`clear` of that key: a key the offload tier evicted, failed to store or is
    storing anew never returns rows. At most ``capacity`` keys are held (the offload
    tier's own capacity, in chunks); past it the oldest go first.

    A key's life follows its KV's: :meth:`expect` when the offload tier accepts a store
    of the chunk, :meth:`put` when its rows are captured (before the GPU blocks that
    hold them can be reused), :meth:`complete` when the store finished, :meth:`drop`
    when the tier evicts it.

    Parameters
    ----------
    spec
        The routing of one token; rows are held in its ``storage_dtype``.
    capacity
        The most keys held at once; ``None`` for no bound beyond the offload tier's
        evictions.

    Raises
    ------
    ValueError
        If ``capacity`` is not a positive int or ``None``.
    """

    def __init__(self, spec: RoutingSpec, capacity: int | None = None) -> None:
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0):
            raise ValueError(f"capacity must be a positive int or None, got {capacity!r}")
        self.spec = spec
        self.capacity = capacity
        # key -> (first token position, read-only rows) or _AWAITING; in insertion order.
        self._entries: dict[Hashable, tuple[int, np.ndarray] | None] = {}
        # Keys whose rows get() may return.
        self._ready: set[Hashable] = set()
        self._nbytes = 0

    def __len__(self) -> int:
        """Keys held, awaiting rows or with rows."""
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._ready

    @property
    def nbytes(self) -> int:
        """Bytes of rows held."""
        return self._nbytes

    def expect(self, keys: Iterable[Hashable]) -> None:
        """A store of these keys' KV starts: rows held for them go (the KV is being
        replaced), and each awaits its rows. Over ``capacity``, the oldest keys go."""
        for key in keys:
            self._forget(key)
            self._entries[key] = _AWAITING
        if self.capacity is not None:
            while len(self._entries) > self.capacity:
                self._forget(next(iter(self._entries)))

    def put(self, key: Hashable, first: int, rows: np.ndarray) -> bool:
        """Capture the rows of an awaited key: tokens ``first .. first + len(rows) - 1``
        of the chunk. Copied. Returns whether they were taken: a key not awaited (never
        offered, or dropped since) takes none.

        Raises
        ------
        ValueError
            ``rows`` is not ``[n, num_layers, top_k]`` of the storage dtype with
            ``n >= 1``, or ``first`` is negative; nothing changes.
        """
        spec = self.spec
        if not isinstance(rows, np.ndarray) or rows.ndim != 3 or rows.shape[1:] != spec.token_shape:
            shape = getattr(rows, "shape", type(rows).__name__)
            raise ValueError(f"rows must be [n, {spec.num_layers}, {spec.top_k}], got {shape}")
        if rows.dtype != spec.storage_dtype or rows.shape[0] == 0:
            raise ValueError(f"rows must be {spec.storage_dtype} with at least one token, got {rows.dtype} {rows.shape}")
        if isinstance(first, bool) or not isinstance(first, (int, np.integer)) or first < 0:
            raise ValueError(f"first must be a non-negative int, got {first!r}")
        if key not in self._entries or self._entries[key] is not _AWAITING:
            return False
        held = rows.copy()
        held.flags.writeable = False
        self._entries[key] = (int(first), held)
        self._nbytes += held.nbytes
        return True

    def complete(self, keys: Iterable[Hashable]) -> None:
        """The store of these keys finished: those with rows become readable, those
        still awaiting rows go (their routing was not captured: a hit on them is
        recomputed)."""
        for key in keys:
            entry = self._entries.get(key, _AWAITING)
            if entry is _AWAITING:
                self._forget(key)
            else:
                self._ready.add(key)

    def fail(self, keys: Iterable[Hashable]) -> None:
        """The store of these keys failed: those not yet readable go."""
        for key in keys:
            if key not in self._ready:
                self._forget(key)

    def drop(self, keys: Iterable[Hashable]) -> None:
        """The offload tier evicted these keys: their rows go."""
        for key in keys:
            self._forget(key)

    def clear(self) -> None:
        """The offload tier was reset: every key goes."""
        self._entries.clear()
        self._ready.clear()
        self._nbytes = 0

    def get(self, key: Hashable) -> tuple[int, np.ndarray] | None:
        """The key's first token position and rows (a read-only array the tier keeps),
        or ``None`` unless the key's store completed with rows captured."""
        if key not in self._ready:
            return None
        return self._entries[key]

    def _forget(self, key: Hashable) -> None:
        entry = self._entries.pop(key, _AWAITING)
        if entry is not _AWAITING:
            self._nbytes -= entry[1].nbytes
        self._ready.discard(key)

    def __repr__(self) -> str:
        return f"RoutingTier({len(self._ready)} of {len(self._entries)} keys readable, {self._nbytes} bytes)"

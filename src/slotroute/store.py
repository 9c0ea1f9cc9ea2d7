"""Scheduler side: routing kept per KV-cache slot, for as long as its block lives."""

from __future__ import annotations

import mmap
import operator
import os
from collections.abc import Sequence

import msgspec
import numpy as np

from slotroute.spec import ID_DTYPES, MissingRoutingError, RoutingSpec

try:
    from slotroute import _native
except ImportError:  # a source tree whose C loops are not built: numpy does the work
    _native = None

__all__ = ["INPUT_DTYPES", "RoutedExpertsManager", "StoreStats"]

# Expert-id dtypes store_batch accepts: narrow ones as the capturer ships them,
# wide ones as vLLM's own capturer does.
INPUT_DTYPES = ID_DTYPES

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def largest_unsigned(values: np.ndarray) -> int:
    """The largest element of a non-empty integer array read as unsigned, as a Python
    int: a negative value comes out larger than any valid index or id, so ``< bound``
    checks both ends in one pass. ``argmax`` is a plain loop, where ``max`` sets up
    numpy's ufunc reduction, and ``item`` gives an int that compares without numpy's
    scalar arithmetic."""
    if values.dtype.kind == "i":
        values = values.view(_UNSIGNED[values.dtype.itemsize])
    return values.item(values.argmax())

# Statuses of the C loops, in the order of _native.c's enum (a test compares them).
STATUSES = ("OK", "OUT_OF_RANGE", "BAD_ID", "MISSING", "NOT_INT", "LAYOUT", "NOT_COVERED")
_OK, _OUT_OF_RANGE, _MISSING, _NOT_INT = (STATUSES.index(name) for name in ("OK", "OUT_OF_RANGE", "MISSING", "NOT_INT"))


def last_level_cache_bytes(cpu: str = "/sys/devices/system/cpu/cpu0") -> int | None:
    """Size of the largest cache the kernel reports for one CPU, or ``None`` where it
    reports none (not Linux, some containers)."""
    sizes = []
    try:
        for index in os.scandir(f"{cpu}/cache"):
            if index.name.startswith("index"):
                with open(f"{index.path}/size") as f:
                    text = f.read().strip()
                scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                sizes.append(int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        return None
    return max(sizes, default=None)


# get() writes a result of at least this many bytes with non-temporal stores: a
# quarter of the last-level cache, the size from which glibc's memcpy (2.38 on) does
# the same. A result that large would evict much of the cache on its way to the
# caller, who reads it once; smaller ones stay in cache. 8 MiB where the size is
# unknown. Read from sysfs when the first store is built, not at import.
STREAM_RESULTS_FROM: int | None = None


def stream_results_from() -> int:
    """:data:`STREAM_RESULTS_FROM`, reading the cache size on the first call."""
    global STREAM_RESULTS_FROM
    if STREAM_RESULTS_FROM is None:
        STREAM_RESULTS_FROM = (last_level_cache_bytes() or 32 << 20) // 4
    return STREAM_RESULTS_FROM

# Lists of at most this many block ids, as the scheduler frees them a step at a time,
# are invalidated one by one from Python: converting a short list into a numpy index
# costs more than the loop.
FEW_BLOCKS = 8


class StoreStats(msgspec.Struct, frozen=True):
    """Memory and occupancy of a :class:`RoutedExpertsManager`.

    ``capacity_bytes``: size of the slot buffer (virtual; what a dense allocation
    would cost). ``resident_bytes``: bytes of it the OS holds in memory now (from
    ``mincore``; where that is unavailable, the bytes of written slots, a lower
    bound). ``slots_written``: slots holding routing that may be read.
    """

    capacity_bytes: int
    resident_bytes: int
    slots_written: int


class RoutedExpertsManager:
    """Slot-indexed routing store: row ``s`` of ``routed_experts_by_slot`` is the
    routing of the token in KV-cache slot ``s = block_id * block_size + offset``,
    and it is returned by :meth:`get` only if it was written by :meth:`store_batch`
    since its block was last invalidated.

    Every expert id in the buffer written through this class is in
    ``[0, spec.num_experts)``. The buffer is ``np.zeros`` of the whole pool, which
    the OS pages in lazily: it costs memory only for the pages actually written, until
    :meth:`populate` commits all of it (NOTE 4).
    Every method validates its arguments before touching any state, so a call that
    raises has changed nothing. Not thread-safe: one scheduler thread drives it.

    Parameters
    ----------
    spec
        Shape of one token's routing; ``spec.storage_dtype`` is the buffer dtype.
    num_blocks, block_size
        The KV-cache block pool this store mirrors.

    Raises
    ------
    ValueError
        If ``spec`` is not a RoutingSpec or a size is not a positive integer.
    """

    def __init__(self, spec: RoutingSpec, num_blocks: int, block_size: int) -> None:
        if not isinstance(spec, RoutingSpec):
            raise ValueError(f"spec must be a RoutingSpec, got {type(spec).__name__}")
        self.spec = spec
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_size = _positive_int("block_size", block_size)
        self.num_slots = self.num_blocks * self.block_size
        layers, top_k = self._token_shape = spec.token_shape
        self._buffer = np.zeros((self.num_slots, layers, top_k), dtype=spec.storage_dtype)
        self._by_block = self._buffer.reshape(self.num_blocks, self.block_size, layers, top_k)
        # NOTE 1: written state is kept as stamps. Every stored row gets a stamp
        # (increasing over the store's life) in its slot; invalidating a block
        # records the last stamp handed out so far. A slot is written iff its stamp
        # is newer than its block's invalidation, so one scatter per batch maintains
        # it and invalidation is one write per block. Both arrays are demand-paged
        # like the buffer.
        self._stamp = np.zeros(self.num_slots, dtype=np.int64)
        self._stamp_by_block = self._stamp.reshape(self.num_blocks, self.block_size)
        self._invalidated_at = np.zeros(self.num_blocks, dtype=np.int64)
        self._last_stamp = 0
        # NOTE 2: a block is flagged full when the C store writes its last slot and
        # finds every slot of it stamped since its invalidation; invalidating the
        # block clears the flag. Stamps only grow, so a flagged block stays wholly
        # written until then, and get reads one byte for it instead of a stamp per
        # slot, a second scattered stream beside the rows.
        # The flag may be missing where slots were written out of order (or by the
        # numpy path); get then reads the stamps, so it only ever saves work.
        self._full = np.zeros(self.num_blocks, dtype=np.uint8)
        # The arrays the C loops take, in their order.
        self._arrays = (self._buffer, self._stamp, self._invalidated_at, self._full)
        # The C loops where they are built (NOTE 3), else the plain numpy path, the
        # reference the C loops are tested against.
        self._native = _native
        # Ids of dtypes whose whole range is valid need no range check.
        self._check_ids_of = {
            dt: np.iinfo(dt).max >= spec.num_experts or dt.kind == "i" for dt in INPUT_DTYPES
        }
        view = self._buffer.view()
        view.flags.writeable = False
        self._readonly_view = view

    @property
    def routed_experts_by_slot(self) -> np.ndarray:
        """The slot buffer, shape ``(num_slots, num_layers, top_k)``, storage dtype.

        A **read-only view**: rows of unwritten or invalidated slots hold stale data
        or zeros; only :meth:`get` knows which rows are valid.
        """
        return self._readonly_view

    def store_batch(self, data: np.ndarray, slot_mapping: np.ndarray | Sequence[int]) -> None:
        """Write one step's routing: row ``i`` of ``data`` into slot ``slot_mapping[i]``.

        Slots < 0 are padding: their rows are skipped and not checked. If a slot
        repeats, the last row that names it wins. In the C loops, bounded by memory
        bandwidth for large steps (one pass reads every id, then runs of consecutive
        slots are streamed to memory), by the latency of scattered writes for decode
        tokens, and by Python call overhead for decode steps (one C call).

        Parameters
        ----------
        data
            Expert ids, shape ``(N, num_layers, top_k)``, dtype uint8, uint16, int32
            or int64. It is copied; the caller keeps ownership. It may be a view of
            this store's own rows: the result is that of storing a copy of it.
        slot_mapping
            Integer array or sequence of shape ``(N,)``.

        Raises
        ------
        ValueError
            Wrong shape or dtype, or an expert id outside ``[0, num_experts)`` in a
            non-padding row (the message names the first one found).
        IndexError
            A slot >= ``num_slots``.
        """
        if type(data) is np.ndarray and np.may_share_memory(data, self._buffer):
            data = data.copy()  # rows of this store, e.g. copied between blocks: read before any write
        native = self._native
        if native is None:
            self._store_numpy(*self._checked_shapes(data, slot_mapping))
            return
        # The C loop takes arrays as the worker ships them, C-contiguous with int64
        # slots, checking their layout itself: one call per decode step. Anything
        # else, a failed check included, takes the checks of _store_native.
        if type(data) is np.ndarray and type(slot_mapping) is np.ndarray:
            status = native.store_rows(
                *self._arrays, data, slot_mapping, *self._token_shape, self.spec.num_experts,
                self._last_stamp + 1,
            )
            if status == _OK:
                self._last_stamp += data.shape[0]
                return
        self._store_native(*self._checked_shapes(data, slot_mapping))

    def check_batch(self, data: np.ndarray, slot_mapping: np.ndarray | Sequence[int]) -> None:
        """Raise what :meth:`store_batch` of the same arguments would raise, storing
        nothing: for a write queued now and applied later.

        Raises
        ------
        ValueError, IndexError
            As :meth:`store_batch`.
        """
        data, slots = self._checked_slots(*self._checked_shapes(data, slot_mapping))
        self._check_ids(data, slots)

    def get(
        self, block_ids: Sequence[int] | np.ndarray, num_tokens: int, token_start: int = 0, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Routing of tokens ``token_start .. num_tokens - 1`` of a request whose
        token ``t`` lives in block ``block_ids[t // block_size]``.

        Only the blocks covering the range are read, each as one contiguous copy;
        bounded by memory bandwidth, and by memory latency at each block boundary
        when the blocks are scattered over the pool.

        Parameters
        ----------
        out
            Where to write the rows instead of a new array: C-contiguous, shape
            ``(num_tokens - token_start, num_layers, top_k)``, storage dtype (a view
            into a larger array the caller assembles, say). If the call raises, ``out``
            may hold part of the rows; the store is unchanged either way.

        Returns
        -------
        np.ndarray
            Shape ``(num_tokens - token_start, num_layers, top_k)``, storage dtype.
            A **copy**: it shares no memory with the store and stays valid after
            later writes or invalidations. ``out`` itself where it was given.

        Raises
        ------
        IndexError
            A block id outside ``[0, num_blocks)``.
        ValueError
            ``block_ids`` not 1-D integers, ``num_tokens`` negative or beyond
            ``len(block_ids) * block_size``, ``token_start`` outside
            ``[0, num_tokens]``, or ``out`` not of the shape, dtype and layout above.
        MissingRoutingError
            Some token in the range has a slot not written since its block was last
            invalidated (the message lists which tokens).
        """
        # A list goes to C as it is (C reads plain ints, checks their range); anything
        # else through numpy's checks first.
        as_list = self._native is not None and type(block_ids) is list
        blocks = block_ids if as_list else self._checked_blocks(block_ids)
        num_tokens, token_start = self._checked_range(len(blocks), num_tokens, token_start)
        if out is not None:
            self._check_out(out, num_tokens - token_start)
        if self._native is None:
            rows = self._gather(blocks, num_tokens, token_start)
            if out is None:
                return rows
            out[...] = rows
            return out
        if out is None:
            out = np.empty((num_tokens - token_start, *self._token_shape), dtype=self._buffer.dtype)
        ids = blocks if as_list else np.ascontiguousarray(blocks, dtype=np.int64)
        stream_from = STREAM_RESULTS_FROM if STREAM_RESULTS_FROM is not None else stream_results_from()
        status = self._native.gather_blocks(*self._arrays, out, ids, token_start, num_tokens, stream_from)
        if status == _OK:
            return out
        if status == _MISSING:
            return self._gather(self._checked_blocks(block_ids), num_tokens, token_start)  # raises
        if as_list and status in (_NOT_INT, _OUT_OF_RANGE):  # a list numpy must read: other ints, or a bad id
            return self.get(self._checked_blocks(block_ids), num_tokens, token_start, out)
        raise RuntimeError(f"internal error: gather_blocks returned status {_status_name(status)} for checked input")

    def invalidate_blocks(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Mark every slot of these blocks unwritten: :meth:`get` of them raises
        :class:`MissingRoutingError` until they are written again. The routing bytes
        are left in place (and resident).

        Raises
        ------
        IndexError
            A block id outside ``[0, num_blocks)``.
        ValueError
            ``block_ids`` not 1-D integers.
        """
        if type(block_ids) is list and len(block_ids) <= FEW_BLOCKS:
            for block in self._checked_block_list(block_ids):
                self._invalidated_at[block] = self._last_stamp
                self._full[block] = 0
            return
        blocks = self._checked_blocks(block_ids)
        self._invalidated_at[blocks] = self._last_stamp
        self._full[blocks] = 0

    def populate(self) -> int:
        """Commit the memory of the slot buffer and its stamps now (NOTE 4). Contents
        and written state are unchanged.

        NOTE 4: the buffer is demand-paged, so the first store into each page takes a
        page fault that zeroes it. A step that writes slots never written before
        (every prefill of a fresh engine, until the block pool has been used once)
        pays one fault per 4 KiB it writes, about 770 for an 8192-token step of 384
        B/token, several times the copy itself. A serving engine populates its store
        once at start instead, where the faults cost the start, not a step.

        Returns
        -------
        int
            The bytes committed: the capacity of the buffer and of its stamps.
        """
        for array in (self._buffer, self._stamp):
            _populate(array)
        return self._buffer.nbytes + self._stamp.nbytes

    def stats(self) -> StoreStats:
        """Capacity, resident memory and occupancy of the slot buffer (a snapshot)."""
        resident = _resident_bytes(self._buffer)
        written = int(np.count_nonzero(self._stamp_by_block > self._invalidated_at[:, None]))
        if resident is None:
            resident = written * self.spec.bytes_per_token
        return StoreStats(self._buffer.nbytes, resident, written)

    def __repr__(self) -> str:
        layers, top_k = self.spec.token_shape
        return (
            f"RoutedExpertsManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"slots=({self.num_slots}, {layers}, {top_k}) {self.spec.storage_dtype})"
        )

    # -- validation (once, at the boundary) ---------------------------------------

    def _checked_shapes(self, data, slot_mapping) -> tuple[np.ndarray, np.ndarray]:
        """Types, dtypes and shapes of one step (no numpy pass over the values)."""
        if not isinstance(data, np.ndarray):
            raise ValueError(f"data must be a numpy array, got {type(data).__name__}")
        slots = slot_mapping if isinstance(slot_mapping, np.ndarray) else np.asarray(slot_mapping)
        if data.dtype not in self._check_ids_of:
            raise ValueError(f"data dtype must be one of uint8, uint16, int32, int64, got {data.dtype}")
        if data.ndim != 3 or data.shape[1:] != self._token_shape:
            raise ValueError(
                f"data must have shape (N, {self.spec.num_layers}, {self.spec.top_k}) "
                f"(N, num_layers, top_k), got {data.shape}"
            )
        if slots.shape != (data.shape[0],):
            raise ValueError(f"slot_mapping must have shape ({data.shape[0]},) to match data, got {slots.shape}")
        if slots.dtype.kind not in "iu":
            if slots.size or slots.dtype.kind != "f":  # np.asarray([]) is float64
                raise ValueError(f"slot_mapping must hold integers, got dtype {slots.dtype}")
            slots = slots.astype(np.int64)
        elif not slots.dtype.isnative:
            slots = slots.astype(slots.dtype.newbyteorder("="))
        return data, slots

    def _checked_slots(self, data, slots) -> tuple[np.ndarray, np.ndarray]:
        """Raise for a slot >= num_slots; drop padding rows (slots < 0)."""
        beyond = slots >= self.num_slots
        if beyond.any():
            row = int(beyond.argmax())
            raise IndexError(
                f"slot {int(slots[row])} (row {row}) is out of range: the store has "
                f"{self.num_slots} slots ({self.num_blocks} blocks of {self.block_size})"
            )
        keep = slots >= 0
        return data[keep], slots[keep]

    def _check_ids(self, data: np.ndarray, slots: np.ndarray) -> None:
        """Raise unless every id of ``data`` is in ``[0, num_experts)``: one pass."""
        if self._check_ids_of[data.dtype] and data.size:
            if largest_unsigned(data) >= self.spec.num_experts:
                raise ValueError(_bad_expert_message(data, slots, self.spec.num_experts))

    def _checked_blocks(self, block_ids) -> np.ndarray:
        blocks = block_ids if isinstance(block_ids, np.ndarray) else np.asarray(block_ids)
        if blocks.ndim != 1:
            raise ValueError(f"block_ids must be 1-D, got shape {blocks.shape}")
        if blocks.size == 0:
            return blocks.astype(np.intp)
        if blocks.dtype.kind not in "iu":
            raise ValueError(f"block_ids must hold integers, got dtype {blocks.dtype}")
        if not blocks.dtype.isnative:
            blocks = blocks.astype(blocks.dtype.newbyteorder("="))
        if largest_unsigned(blocks) >= self.num_blocks:
            i = int(np.argmax((blocks < 0) | (blocks >= self.num_blocks)))
            raise self._block_out_of_range(i, int(blocks[i]))
        return blocks

    def _checked_block_list(self, block_ids: list) -> list[int] | np.ndarray:
        """A short list of block ids, checked in Python where every id is a plain int,
        as the scheduler hands over the few blocks a step allocated: no numpy call
        (each costs microseconds with the cold caches of an engine step)."""
        if not all(type(b) is int for b in block_ids):
            return self._checked_blocks(block_ids)
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            i, b = next((i, b) for i, b in enumerate(block_ids) if not 0 <= b < self.num_blocks)
            raise self._block_out_of_range(i, b)
        return block_ids

    def _checked_range(self, num_blocks: int, num_tokens, token_start) -> tuple[int, int]:
        num_tokens = _index_int("num_tokens", num_tokens)
        token_start = _index_int("token_start", token_start)
        capacity = num_blocks * self.block_size
        if not 0 <= num_tokens <= capacity:
            raise ValueError(
                f"num_tokens must be in [0, {capacity}] for {num_blocks} blocks of "
                f"{self.block_size}, got {num_tokens}"
            )
        if not 0 <= token_start <= num_tokens:
            raise ValueError(f"token_start must be in [0, {num_tokens}] (num_tokens), got {token_start}")
        return num_tokens, token_start

    def _check_out(self, out, rows: int) -> None:
        expected = (rows, *self._token_shape)
        if (
            type(out) is not np.ndarray or out.shape != expected or out.dtype != self._buffer.dtype
            or not out.flags.c_contiguous or not out.flags.writeable
        ):
            found = (
                f"{out.dtype} of shape {out.shape}{'' if out.flags.c_contiguous else ', not C-contiguous'}"
                f"{'' if out.flags.writeable else ', read-only'}"
                if isinstance(out, np.ndarray) else type(out).__name__
            )
            raise ValueError(f"out must be a writable C-contiguous {self._buffer.dtype} array of shape {expected}, got {found}")

    def _block_out_of_range(self, position: int, block_id: int) -> IndexError:
        return IndexError(f"block id {block_id} (position {position}) is out of range [0, {self.num_blocks})")

    # -- the C loops ----------------------------------------------------------------

    def _store_native(self, data: np.ndarray, slots: np.ndarray) -> None:
        """NOTE 3: one C call checks slots and ids, then writes rows and stamps in row
        order (a repeated slot keeps its last row), writing nothing if a check fails;
        numpy then finds what failed, for the message. Bounded by memory bandwidth for
        large steps (long runs are written with non-temporal stores), by Python call
        overhead for decode steps."""
        if slots.dtype != np.int64 or not slots.flags.c_contiguous:
            if slots.dtype.kind == "u" and slots.size and largest_unsigned(slots) >= self.num_slots:
                self._checked_slots(data, slots)  # raises: beyond the store, maybe beyond int64
            slots = slots.astype(np.int64)
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        status = self._native.store_rows(
            *self._arrays, data, slots, *self._token_shape, self.spec.num_experts, self._last_stamp + 1
        )
        if status != _OK:
            data, slots = self._checked_slots(data, slots)  # raises for a slot beyond the store
            if status != STATUSES.index("BAD_ID"):
                raise RuntimeError(f"internal error: store_rows returned status {_status_name(status)} for checked input")
            raise ValueError(_bad_expert_message(data, slots, self.spec.num_experts))
        self._last_stamp += slots.shape[0]

    # -- the numpy path, where the C loops are not built ----------------------------

    def _store_numpy(self, data: np.ndarray, slots: np.ndarray) -> None:
        """store_batch in plain numpy, the reference the C loops are tested against:
        check every slot, then every id of the non-padding rows, then write the last
        row of each slot and stamp the slots. The batch shares one stamp: NOTE 1 needs
        stamps newer than any invalidation, not distinct ones."""
        data, slots = self._checked_slots(data, slots)
        self._check_ids(data, slots)
        if slots.shape[0] == 0:
            return
        data, slots = _last_write_per_slot(data, slots)  # numpy leaves the winner of a repeated index open
        self._last_stamp += 1
        self._stamp[slots] = self._last_stamp
        self._buffer[slots] = data

    def _gather(self, blocks: np.ndarray, num_tokens: int, token_start: int) -> np.ndarray:
        """get in plain numpy: the stamps of the range, then its rows, block by block."""
        first = token_start // self.block_size
        used = blocks[first : -(-num_tokens // self.block_size)]
        lo = token_start - first * self.block_size
        hi = num_tokens - first * self.block_size
        written = self._stamp_by_block[used] > self._invalidated_at[used][:, None]
        written = written.reshape(-1)[lo:hi]
        if not written.all():
            raise MissingRoutingError(_missing_message(written, token_start, num_tokens))
        return self._by_block[used].reshape(-1, *self._token_shape)[lo:hi]


def _last_write_per_slot(data: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep, for every slot, only the last row naming it (np.unique returns the first
    occurrence of each value, so it is applied to the reversed slots)."""
    _, first_from_end = np.unique(slots[::-1], return_index=True)
    rows = slots.shape[0] - 1 - first_from_end
    return data[rows], slots[rows]


def _bad_expert_message(data: np.ndarray, slots: np.ndarray, num_experts: int) -> str:
    bad = (data < 0) | (data >= num_experts)
    row, layer, k = (int(i) for i in np.argwhere(bad)[0])
    return (
        f"expert id {int(data[row, layer, k])} at row {row} (slot {int(slots[row])}), layer "
        f"{layer}, k {k} is outside [0, {num_experts}); {int(np.count_nonzero(bad))} ids "
        f"out of range in this batch"
    )


def _missing_message(written: np.ndarray, token_start: int, num_tokens: int) -> str:
    missing = np.flatnonzero(~written) + token_start
    # Collapse into ranges "a-b" so a long gap stays readable.
    cut = np.flatnonzero(missing[1:] - missing[:-1] != 1)
    firsts = np.concatenate((missing[:1], missing[cut + 1]))[:8].tolist()
    lasts = np.concatenate((missing[cut], missing[-1:]))[:8].tolist()
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in zip(firsts, lasts))
    if cut.shape[0] + 1 > 8:
        text += f", ... ({cut.shape[0] + 1 - 8} more ranges)"
    return (
        f"no routing stored for {missing.shape[0]} of tokens {token_start}-{num_tokens - 1}: "
        f"tokens {text} (never written, or their block was invalidated since)"
    )


def _positive_int(name: str, value) -> int:
    value = _index_int(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _index_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}") from None


def _status_name(status: int) -> str:
    return STATUSES[status] if 0 <= status < len(STATUSES) else f"{status} (unknown)"


def _load_libc(name: str, *argtypes):
    """libc's function ``name`` (returning int) with these argument types, or None
    where it is unavailable."""
    import ctypes
    import ctypes.util

    path = ctypes.util.find_library("c")
    try:
        fn = getattr(ctypes.CDLL(path, use_errno=True), name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


def _load_mincore():
    import ctypes

    return _load_libc("mincore", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def _load_madvise():
    import ctypes

    return _load_libc("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


_UNLOADED = object()
_MINCORE = _UNLOADED  # libc's mincore, loaded on first use (None where unavailable)
_MADVISE = _UNLOADED  # libc's madvise, loaded on first use (None where unavailable)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in for writing, keeping its contents


def _pages_of(array: np.ndarray) -> tuple[int, int]:
    """The address of the first page ``array`` (non-empty) overlaps, and how many
    pages it overlaps."""
    page = mmap.PAGESIZE
    start = array.ctypes.data // page * page
    return start, -(-(array.ctypes.data + array.nbytes - start) // page)


def _populate(array: np.ndarray) -> None:
    """Fault every page of ``array`` (C-contiguous) in for writing, keeping its bytes:
    one ``madvise(MADV_POPULATE_WRITE)`` where the kernel has it, else a read and a
    write of one byte in each page (a read of an untouched page maps the shared zero
    page; the write of the same byte gives the process its own)."""
    global _MADVISE
    if array.nbytes == 0:
        return
    if _MADVISE is _UNLOADED:
        _MADVISE = _load_madvise()
    start, pages = _pages_of(array)
    if _MADVISE is not None and _MADVISE(start, pages * mmap.PAGESIZE, _MADV_POPULATE_WRITE) == 0:
        return
    flat = array.reshape(-1).view(np.uint8)
    flat[::mmap.PAGESIZE] = flat[::mmap.PAGESIZE].copy()
    flat[-1:] = flat[-1:].copy()


def _resident_bytes(array: np.ndarray) -> int | None:
    """Bytes of ``array``'s pages that are resident now, or None where mincore is
    unavailable. Counts whole pages overlapping the array."""
    global _MINCORE
    if _MINCORE is _UNLOADED:
        _MINCORE = _load_mincore()
    if _MINCORE is None or array.nbytes == 0:
        return None
    start, pages = _pages_of(array)
    vec = np.zeros(pages, dtype=np.uint8)
    if _MINCORE(start, array.ctypes.data + array.nbytes - start, vec.ctypes.data) != 0:
        return None
    return int(np.count_nonzero(vec & 1)) * mmap.PAGESIZE

"""Worker side: record the experts every MoE layer routes each token to, and ship one
step's worth to the host in the storage dtype.

This is the only slotroute module that imports torch. It imports no inference engine:
the engine passes ``topk_ids`` and a :class:`BatchLayout`, and hands the
:class:`~slotroute.wire.RoutedExpertsLists` from :meth:`PendingSnapshot.result` to the
scheduler. ``docs/capture.md`` walks through the layouts and the snapshot pipeline.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from slotroute.spec import RoutingSpec
from slotroute.wire import RoutedExpertsLists

logger = logging.getLogger(__name__)

try:
    from slotroute import _native
except ImportError:  # a source tree whose C loops are not built: numpy takes CPU snapshots
    _native = None

__all__ = ["BatchLayout", "PendingSnapshot", "RoutedExpertsCapturer"]

# The value clear_buffer() writes: outside every spec's [0, num_experts), so a
# (token, layer) that no capture() wrote since is reported by the snapshot's check.
NOT_CAPTURED = -1
# Torch has no full uint16 support; uint16 ids travel as int16 with the same bits.
_TORCH_STORAGE = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.int16}
# Every integer dtype a router or a monolithic MoE kernel hands over (vLLM 0.32's
# RoutedExpertsSink passes int16); the buffer's int32 copy widens or narrows on the device.
_TOPK_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
# The slot mappings the kernel reads in place (RoutedExpertsCapturer.snapshot_leading).
_SLOT_DTYPES = (torch.int32, torch.int64)


def _int_tuple(name: str, values: Sequence[int] | None) -> tuple[int, ...] | None:
    if values is None:
        return None
    out = tuple(int(v) for v in values)
    if not out or min(out) < 0:
        raise ValueError(f"BatchLayout.{name} must be a non-empty list of counts >= 0, got {out}")
    return out


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Where this rank's tokens sit among the rows of the ``topk_ids`` a router sees.

    Validated on construction and immutable: ``dp_rank`` indexes
    ``num_tokens_across_dp``; ``local_sizes``, when given, holds the same number of
    shard sizes for every DP rank (DP-major, TP-minor, padding included) and each DP
    rank's shards hold at least its tokens. The default describes a single rank: every
    row of ``topk_ids`` is one of this rank's tokens.

    Parameters
    ----------
    num_tokens_across_dp
        Tokens each data-parallel rank runs this step; ``None`` for a single DP rank
        without sequence parallelism.
    dp_rank
        This rank's index into ``num_tokens_across_dp``.
    tp_size
        Tensor-parallel size; sequence-parallel shards are ``ceil(t / tp_size)`` rows.
    local_sizes
        Row counts of the sequence-parallel shards gathered across DP ranks by a naive
        DP+EP dispatch, or ``None``.

    Raises
    ------
    ValueError
        If a count is negative, ``dp_rank`` or ``tp_size`` is out of range, or
        ``local_sizes`` does not split evenly into shards that hold each DP rank's tokens.
    """

    num_tokens_across_dp: tuple[int, ...] | None = None
    dp_rank: int = 0
    tp_size: int = 1
    local_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        counts = _int_tuple("num_tokens_across_dp", self.num_tokens_across_dp)
        shards = _int_tuple("local_sizes", self.local_sizes)
        object.__setattr__(self, "num_tokens_across_dp", counts)
        object.__setattr__(self, "local_sizes", shards)
        if int(self.tp_size) < 1:
            raise ValueError(f"BatchLayout.tp_size must be >= 1, got {self.tp_size}")
        object.__setattr__(self, "tp_size", int(self.tp_size))
        object.__setattr__(self, "dp_rank", int(self.dp_rank))
        if counts is None:
            if self.dp_rank != 0 or shards is not None:
                raise ValueError(
                    "BatchLayout without num_tokens_across_dp describes a single DP rank: "
                    f"dp_rank must be 0 and local_sizes None, got {self.dp_rank} and {shards}"
                )
            return
        if not 0 <= self.dp_rank < len(counts):
            raise ValueError(
                f"BatchLayout.dp_rank must be in [0, {len(counts)}) (DP ranks), got {self.dp_rank}"
            )
        if shards is None:
            return
        if len(shards) % len(counts):
            raise ValueError(
                f"BatchLayout.local_sizes must hold the same number of shards for each of the "
                f"{len(counts)} DP ranks, got {len(shards)} sizes"
            )
        per_rank = len(shards) // len(counts)
        for rank, tokens in enumerate(counts):
            held = sum(shards[rank * per_rank : (rank + 1) * per_rank])
            if held < tokens:
                raise ValueError(
                    f"BatchLayout.local_sizes give DP rank {rank} {held} rows for its {tokens} tokens"
                )


@functools.lru_cache(maxsize=256)
def _locate(rows: int, layout: BatchLayout) -> tuple[int, int, bool]:
    """``(start, count, gather)``: this rank's tokens are rows ``[start, start + count)``
    of ``topk_ids`` (after an all-gather across the TP group when ``gather``).

    Every layer of a step sees the same ``(rows, layout)``, so this runs once a step.
    """
    counts = layout.num_tokens_across_dp
    if counts is None:
        return 0, rows, False
    mine = counts[layout.dp_rank]
    if rows == sum(counts):  # naive dispatch: every DP rank's tokens, concatenated
        return sum(counts[: layout.dp_rank]), mine, False
    if rows == mine:  # modular kernel: only this rank's tokens
        return 0, mine, False
    shards = layout.local_sizes
    if shards is not None and rows == sum(shards):  # DP+EP dispatch of SP shards
        per_rank = len(shards) // len(counts)
        return sum(shards[: layout.dp_rank * per_rank]), mine, False
    sp_rows = -(-mine // layout.tp_size)
    if layout.tp_size > 1 and rows == sp_rows:  # sequence parallel: this TP rank's shard
        return 0, mine, True
    expected = [f"{sum(counts)} (all DP ranks' tokens)", f"{mine} (this DP rank's tokens)"]
    if shards is not None:
        expected.append(f"{sum(shards)} (gathered sequence-parallel shards)")
    if layout.tp_size > 1:
        expected.append(f"{sp_rows} (this TP rank's sequence-parallel shard)")
    raise ValueError(
        f"topk_ids has {rows} rows; for dp_rank={layout.dp_rank}, tp_size={layout.tp_size}, "
        f"num_tokens_across_dp={list(counts)} expected " + ", ".join(expected)
    )


@functools.cache
def _fused_kernel():
    """:mod:`slotroute._capture_kernel`, the Triton kernel of :func:`pack_snapshot`,
    imported on the first CUDA snapshot so that CPU runs never import Triton; ``None``
    where Triton is missing (it ships with the CUDA builds of torch)."""
    try:
        from slotroute import _capture_kernel
    except ImportError:  # pragma: no cover - depends on the torch build
        return None
    return _capture_kernel


# Ids each program of the snapshot kernel checks: one count of bad ids per PACK_BLOCK ids.
PACK_BLOCK = 4096


def _fill_run(fill: torch.Tensor, block: int) -> torch.Tensor:
    """``fill`` (one token's pattern, 1-D) repeated over at least ``block + fill.numel()``
    ids: the snapshot kernel's ``fill`` (NOTE 2 of ``_capture_kernel._pack_kernel``)."""
    return fill.repeat(-(-(block + fill.numel()) // fill.numel()))


# Chunk sizes of a capturer's pinned host pool (_HostPool): doubling from the first to the last.
_POOL_MIN_CHUNK, _POOL_MAX_CHUNK = 4 << 20, 64 << 20


def pack_snapshot(
    ids: torch.Tensor,
    fill: torch.Tensor,
    rows: torch.Tensor,
    counts: torch.Tensor,
    slots_in: torch.Tensor | None,
    slots_out: torch.Tensor | None,
    num_experts: int,
    clear: bool,
) -> None:
    """One step's snapshot on the device, on the current stream, reading nothing back.

    ``rows`` (1-D, storage dtype) receives the first ``rows.numel()`` of ``ids`` (the
    flat int32 capture buffer) narrowed; ``counts[p]`` (int32, ``ceil(rows.numel() /
    PACK_BLOCK)`` entries) the number of ids outside ``[0, num_experts)`` among ids
    ``[p * PACK_BLOCK, (p + 1) * PACK_BLOCK)``; ``slots_out`` (int64), where given, a
    copy of ``slots_in``; and with ``clear`` every id of ``ids`` is then refilled from
    ``fill`` (one token's ``num_layers * top_k`` pattern, repeated). One fused kernel
    where Triton is available, else torch ops to the same effect.
    """
    kernel = _fused_kernel() if ids.is_cuda else None
    if kernel is not None:
        kernel.pack_snapshot(ids, fill, rows, counts, slots_in, slots_out, num_experts, clear, PACK_BLOCK)
        return
    n = rows.numel()
    src = ids[:n]
    rows.copy_(src)
    counts.zero_()
    if n:
        counts[0] = ((src < 0) | (src >= num_experts)).sum(dtype=torch.int32)
    if slots_out is not None:
        slots_out.copy_(slots_in)
    if clear:
        ids.view(-1, fill.numel()).copy_(fill.view(1, -1).expand(ids.numel() // fill.numel(), -1))


class _RingSlot:
    """One entry of the capturer's snapshot ring (CUDA, TP rank 0), allocated once: the
    packed device buffer the snapshot kernel writes where it stages (NOTE 3 of
    ``RoutedExpertsCapturer._snapshot_async``), the pinned host buffer that the kernel writes
    directly at ``mapped`` (its address for a kernel; ``None`` where it stages) or the
    step's one device-to-host copy fills, and two events made once: ``ready`` orders a
    copy on the capturer's own stream after the kernel, ``copied`` (blocking: the host
    sleeps on it) follows the kernel, or that copy. ``holder`` is the unresolved snapshot using the slot; a
    resolved snapshot's arrays are views of ``host_np``, and the slot is :meth:`lent`
    while any of them is alive. ``address`` is the device buffer's, made once: the
    kernel's launch takes addresses, so a snapshot makes no view of its own (each torch
    call on the hot path costs several microseconds inside an engine step)."""

    __slots__ = (
        "device", "address", "host", "host_np", "mapped", "ready", "copied", "holder", "_free_refs",
    )

    def __init__(self, nbytes: int, device: torch.device, direct: bool = False):
        nbytes = -(-max(nbytes, 1) // 64) * 64  # whole lines, as a packed layout's parts
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.address = self.device.data_ptr()  # every view's, for the kernel's launch
        if self.address % 16:  # torch's CUDA allocations are aligned far beyond this
            raise RuntimeError(f"a snapshot ring buffer at {self.address:#x} is not 16-byte aligned")
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host_np = self.host.numpy()
        self.mapped = mapped_address(self.host) if direct else None
        self.ready = torch.cuda.Event()
        self.copied = torch.cuda.Event(blocking=True)
        self.holder: PendingSnapshot | None = None
        self._free_refs = sys.getrefcount(self.host_np)

    def lent(self) -> bool:
        """Whether some view of the host buffer is alive (numpy collapses every view's
        ``base`` to ``host_np``, so each holds one reference to it): a result still in
        use, whose rows a later snapshot must not overwrite."""
        return sys.getrefcount(self.host_np) > self._free_refs


def _packed_layout(num_tokens: int, row_bytes: int, row_ids: int, device_slots: bool) -> tuple[int, int, int, int]:
    """Byte offsets in a packed snapshot of ``num_tokens`` tokens: the end of its rows,
    the start of its int64 slots (where the slot mapping is on the device), the start
    of its int32 counts of bad ids, and its total size. Each part starts on a 64-byte
    line, which leaves the room the kernel's padded stores need (NOTE 1 of
    ``_capture_kernel._pack_kernel``)."""
    rows_end = num_tokens * row_bytes
    slots_at = -(-rows_end // 64) * 64
    counts_at = slots_at + (-(-8 * num_tokens // 64) * 64 if device_slots else 0)
    return rows_end, slots_at, counts_at, counts_at + 4 * -(-(num_tokens * row_ids) // PACK_BLOCK)


class PendingSnapshot:
    """One step's routing on its way to the host; :meth:`result` waits for it.

    On CUDA it holds a slot of the capturer's ring until it is resolved. Its result is
    then a view of the slot's pinned host buffer, which no later snapshot writes while
    any view of it is alive, or, once the capturer found a slot still in use when its
    turn came, a view of a span of the capturer's pinned host pool that is this
    snapshot's alone (NOTE 1). The first :meth:`result`
    call resolves it; later calls return the same object (or raise the same error).
    Made by :meth:`RoutedExpertsCapturer.snapshot`, not constructed directly.
    """

    __slots__ = (
        "_spec", "_num_tokens", "_slot", "_host", "_host_at", "_host_np", "_layout", "_host_slots", "_own_stream",
        "_copy_enqueued", "_copy_out", "_arrays", "_result", "_error", "_failed_slots", "_direct",
    )

    def __init__(
        self,
        spec: RoutingSpec,
        num_tokens: int,
        arrays: tuple[np.ndarray, np.ndarray] | None = None,
        error: Exception | None = None,
        failed_slots: np.ndarray | None = None,
        slot: _RingSlot | None = None,
        layout: tuple[int, int, int, int] | None = None,
        host_slots: np.ndarray | None = None,
        own_stream: bool = True,
        host: tuple[torch.Tensor, int, np.ndarray] | None = None,
        direct: bool = False,
    ):
        self._spec = spec
        self._num_tokens = num_tokens
        self._arrays = arrays
        self._error = error
        self._failed_slots = failed_slots
        self._result = None
        self._slot = slot
        # The pinned bytes the copy fills, as a buffer, the offset in it and a numpy view
        # from that offset: the slot's own (lent, or copied out of where `_copy_out`), or
        # `host`, a span of the capturer's host pool for this snapshot alone, whose views
        # are the result (the view keeps the span in use until then).
        if host is None and slot is not None:
            host = (slot.host, 0, slot.host_np)
        self._host, self._host_at, self._host_np = host if host is not None else (None, 0, None)
        self._layout = layout
        self._host_slots = host_slots
        self._own_stream = own_stream
        self._copy_enqueued = own_stream
        self._copy_out = False  # set by the ring for a held snapshot it resolves to free the slot (NOTE 1)
        self._direct = direct  # the kernel wrote the host bytes itself: no copy (NOTE 3 of _snapshot_async)

    @property
    def spec(self) -> RoutingSpec:
        """The routing spec of the capturer that took the snapshot."""
        return self._spec

    def enqueue_copy(self) -> None:
        """Enqueue the step's one device-to-host copy on the current stream, for a
        snapshot taken with ``defer_copy=True``: call it on a stream ordered after the
        one that took the snapshot (vLLM's output copy stream, which waits for its
        main stream), and synchronise that stream, or an event recorded on it after
        this call, before :meth:`result`. A no-op for any other snapshot. Bounded by
        one copy launch, and none where the kernel wrote the host bytes itself (NOTE 3
        of ``RoutedExpertsCapturer._snapshot_async``): the stream's order then does it."""
        if self._slot is None or self._copy_enqueued:
            return
        self._copy_to_host()
        self._copy_enqueued = True

    def _copy_to_host(self) -> None:
        # The step's one device-to-host copy, on the current stream; none where the
        # kernel wrote the host bytes.
        total, at = self._layout[3], self._host_at
        if total and not self._direct:
            self._host[at:at + total].copy_(self._slot.device[:total], non_blocking=True)

    def done(self) -> bool:
        """Whether :meth:`result` would return without waiting. Never blocks."""
        return self._slot is None or not self._own_stream or self._slot.copied.query()

    def result(self) -> RoutedExpertsLists | None:
        """Wait for the copy and return the step's routing.

        Returns
        -------
        RoutedExpertsLists or None
            ``routing_data`` of shape ``(num_tokens, num_layers, top_k)`` in the spec's
            storage dtype and ``slot_mapping`` (int64) of shape ``(num_tokens,)``:
            numpy arrays over host memory that belongs to this result alone (on CUDA,
            views of a ring slot that no later snapshot writes while one of them is
            alive, or of the snapshot's own span of pinned memory). ``None`` on a TP rank other
            than 0, which ships nothing.

        Raises
        ------
        ValueError
            If an expert id is outside ``[0, num_experts)``, including ``-1`` for a
            (token, layer) that no ``capture()`` wrote since the buffer was cleared.

        A snapshot taken with ``defer_copy=True`` whose :meth:`enqueue_copy` was not
        called copies now on the current stream and waits for it.
        """
        arrays = self.arrays()
        if arrays is not None and self._result is None:
            self._result = RoutedExpertsLists(routing_data=arrays[0], slot_mapping=arrays[1])
        return self._result

    def arrays(self) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`result` as its two arrays ``(routing_data, slot_mapping)``, without
        building the struct: what a caller that wraps them in its own type needs.
        Same waiting, same arrays, same errors."""
        if self._slot is not None:
            self._resolve()
        if self._error is not None:
            raise self._error
        return self._arrays

    def discard(self) -> None:
        """Give the snapshot up unread (a step whose sampling raised): its ring slot is
        free for later snapshots at once, which their stream orders after this one's
        kernel and copy. No wait; :meth:`result` then raises. Bounded by a few
        attribute writes."""
        self._release()
        self._arrays, self._result, self._failed_slots = None, None, None
        self._error = ValueError(f"the routing snapshot of this step of {self._num_tokens} tokens was discarded unread")

    def failed_slots(self) -> np.ndarray | None:
        """The KV slots of the step (int64) if :meth:`result` raised, so that a caller
        can drop what the step would have written; ``None`` otherwise."""
        if self._slot is not None:
            self._resolve()
        return self._failed_slots if self._error is not None else None

    def _release(self) -> None:
        """Free the ring slot (if this snapshot still holds it) and drop every
        reference to host memory, so that nothing here keeps the slot's bytes alive."""
        slot = self._slot
        if slot is not None and slot.holder is self:
            slot.holder = None
        self._slot = self._host = self._host_np = self._layout = self._host_slots = None

    def _resolve(self) -> None:
        # Bounded by the wait for the copy (the pipeline's only host wait, on a blocking
        # event, and none where the caller synchronised its own stream), a sum over the
        # step's counts of bad ids and, for a held snapshot resolved to free its slot
        # (NOTE 1), a memcpy of the step's bytes out of it.
        slot = self._slot
        if not self._copy_enqueued:  # deferred, and nobody enqueued the copy: do it now and wait
            with torch.cuda.device(slot.device.device):
                self.enqueue_copy()
                torch.cuda.current_stream().synchronize()
        elif self._own_stream:
            slot.copied.synchronize()
        spec, n = self._spec, self._num_tokens
        rows_end, slots_at, counts_at, total = self._layout
        host = self._host_np
        # Each array in one numpy call (a view of `host`, whose base is the buffer's):
        # inside an engine step every library call costs many times its isolated time.
        data = np.ndarray((n, *spec.token_shape), spec.storage_dtype, host)
        slots = self._host_slots if self._host_slots is not None else np.ndarray((n,), np.int64, host, slots_at)
        copied_out = self._copy_out and host is slot.host_np
        if copied_out:
            data = owned_copy(data)
            slots = slots if self._host_slots is not None else owned_copy(slots)
        # A nonzero byte among the counts is a nonzero count: the sum only then.
        bad = int(host[counts_at:total].view(np.int32).sum()) if host[counts_at:total].tobytes().strip(b"\0") else 0
        self._release()
        if bad:
            self._error = _range_error(spec, n, bad, data, slots)
            self._failed_slots = slots if copied_out else slots.copy()
        else:
            self._arrays = (data, slots)


def _pinned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory (torch's caching host allocator)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@functools.cache
def _cuda_driver():
    """The CUDA driver library, or ``None`` where it cannot be loaded."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def mapped_address(host: torch.Tensor) -> int | None:
    """The address at which a kernel on the current CUDA device writes the pinned host
    tensor ``host`` (``CU_POINTER_ATTRIBUTE_DEVICE_POINTER``; under unified addressing
    its own), or ``None`` where the driver maps none: the snapshot then stages its
    bytes on the device and copies them."""
    driver = _cuda_driver()
    if driver is None or not host.is_pinned():
        return None
    address = ctypes.c_uint64()
    status = driver.cuPointerGetAttribute(ctypes.byref(address), 3, ctypes.c_uint64(host.data_ptr()))
    return address.value if status == 0 and address.value else None


class _HostPool:
    """Pinned host memory for snapshots whose results the caller keeps (once the ring
    stops lending, NOTE 1 of :meth:`RoutedExpertsCapturer._acquire_slot`): chunks,
    each handed out front to back in spans, one per snapshot.

    Invariant: a chunk is handed out from its start again only when no numpy view of it
    is alive: a snapshot holds a view of its span from :meth:`take` until it resolves,
    and its result's arrays are views of that.

    NOTE 1: a snapshot's pinned buffer of its own from torch's caching host allocator
    costs an allocation per step, and a new page-locked block per step for as long as
    the caller keeps the rows (vLLM 0.28-0.30 keep each decode row until its request
    finishes). A chunk holds many steps, so the page-locking happens once per chunk,
    and chunks whose rows were all dropped are reused without any allocation. Chunks
    grow with the pool (at least ``min_chunk``, at most ``max_chunk`` bytes unless a
    step needs more) and are kept, as torch's allocator keeps its freed blocks. A
    span's writes and later writes into the same bytes are ordered by the stream both
    are enqueued on: the snapshot kernel's (the forward's stream), where it writes the
    span itself, or the copy's (the capturer's copy stream, or the runner's output
    copy stream).
    """

    __slots__ = (
        "_chunks", "_buffer", "_array", "_offset", "_min_chunk", "_max_chunk", "_idle_refs", "_allocate", "_map",
        "mapped",
    )

    def __init__(self, min_chunk: int, max_chunk: int, allocate=None, map_chunk=None) -> None:
        # Each chunk: its pinned buffer, a numpy view of it and the address a kernel writes it at (or None).
        self._chunks: list[tuple[torch.Tensor, np.ndarray, int | None]] = []
        self._buffer: torch.Tensor | None = None  # the chunk spans come from now
        self._array: np.ndarray | None = None
        self.mapped: int | None = None  # the current chunk's address for a kernel, where it has one
        self._offset = 0
        self._min_chunk, self._max_chunk = min_chunk, max_chunk
        self._idle_refs = 0  # _refs() of a chunk no view of which is alive, measured on the first
        self._allocate = allocate or _pinned  # nbytes -> a uint8 CPU tensor
        self._map = map_chunk  # buffer -> its address for a kernel, or None

    @property
    def nbytes(self) -> int:
        """Pinned bytes the pool holds."""
        return sum(chunk[0].numel() for chunk in self._chunks)

    def take(self, nbytes: int) -> tuple[torch.Tensor, int, np.ndarray]:
        """A span of at least ``nbytes`` pinned bytes for one snapshot, a whole number
        of 64-byte lines: its chunk's buffer, the offset in it (a multiple of 64) and a
        numpy view of the span (which keeps the chunk in use while it or a view of it
        is alive); :attr:`mapped` is then the chunk's address for a kernel. Bounded by
        a slice, except when the current chunk is full: then a pass over the chunks,
        and an allocation if none is free."""
        nbytes = -(-nbytes // 64) * 64  # every span whole cache lines: viewed as int64 and int32 alike
        start = self._offset
        if self._buffer is None or start + nbytes > self._buffer.numel():
            self._next_chunk(nbytes)
            start = 0
        self._offset = start + nbytes
        return self._buffer, start, self._array[start:start + nbytes]

    def in_use(self, chunk: tuple[torch.Tensor, np.ndarray, int | None]) -> bool:
        """Whether a numpy view of ``chunk`` is alive (numpy collapses every view's
        ``base`` to the chunk's array, so each holds one reference to it)."""
        return self._refs(chunk) - (chunk[1] is self._array) > self._idle_refs

    @staticmethod
    def _refs(chunk: tuple[torch.Tensor, np.ndarray, int | None]) -> int:
        array = chunk[1]
        return sys.getrefcount(array)

    def reserve(self, nbytes: int) -> None:
        """Allocate chunks (each at most the largest chunk size) until the pool holds at
        least ``nbytes``: the page-locking done at once, before any step needs it."""
        while self.nbytes < nbytes:
            self._add_chunk(min(self._max_chunk, nbytes - self.nbytes))

    def _next_chunk(self, nbytes: int) -> None:
        chunk = next((c for c in self._chunks if c[0].numel() >= nbytes and not self.in_use(c)), None)
        if chunk is None:
            chunk = self._add_chunk(max(nbytes, min(max(self._min_chunk, self.nbytes), self._max_chunk)))
        self._buffer, self._array, self.mapped = chunk

    def _add_chunk(self, nbytes: int) -> tuple[torch.Tensor, np.ndarray, int | None]:
        buffer = self._allocate(-(-nbytes // 64) * 64)
        chunk = (buffer, buffer.numpy(), None if self._map is None else self._map(buffer))
        self._chunks.append(chunk)
        if len(self._chunks) == 1:
            self._idle_refs = self._refs(chunk)
        return chunk


def owned_copy(view: np.ndarray) -> np.ndarray:
    """A copy of the C-contiguous array ``view``, made while holding the GIL (one
    memoryview slice assignment). numpy releases the GIL around a large copy; in an
    engine whose other threads run Python, taking it back can wait a whole switch
    interval (5 ms by default), many times the copy itself."""
    out = np.empty(view.shape, view.dtype)
    if out.size:
        memoryview(out).cast("B")[:] = memoryview(view).cast("B")
    return out


def _range_error(
    spec: RoutingSpec, num_tokens: int, bad: int, ids: np.ndarray | None = None, slots: np.ndarray | None = None
) -> ValueError:
    """The error for a snapshot with ``bad`` ids out of range; with the step's ``ids``
    (int32 as captured, or narrowed to the storage dtype), it names the first one's token
    and layer (a narrowed id may have wrapped into range: then only the count)."""
    where = ""
    if ids is not None:
        unsigned = ids.view(np.uint32) if ids.dtype == np.int32 else ids
        found = np.flatnonzero(unsigned.reshape(-1) >= spec.num_experts)
        if found.size:
            token, rest = divmod(int(found[0]), spec.num_layers * spec.top_k)
            slot = "" if slots is None else f" (KV slot {int(slots[token])})"
            value = int(ids.reshape(-1)[found[0]])
            where = f"; the first is token {token} of the step{slot}, layer {rest // spec.top_k}: {value}"
    return ValueError(
        f"routing snapshot of {num_tokens} tokens holds {bad} expert id(s) outside "
        f"[0, {spec.num_experts}) (num_experts){where}; {NOT_CAPTURED} marks a (token, layer) "
        "that no capture() wrote since clear_buffer()"
    )


class RoutedExpertsCapturer:
    """A fixed int32 buffer ``(max_num_tokens, num_layers, top_k)`` on one device that
    MoE layers write their ``topk_ids`` into, row ``i`` being this DP rank's ``i``-th
    token of the current step.

    The buffer is allocated once and never moves, so CUDA graphs may record
    :meth:`capture`. Every rank of a TP group keeps an identical buffer and runs the
    same kernels (every rank records the same graph); only TP rank 0 ships data.

    Parameters
    ----------
    spec
        Layers, top-k and expert count of the model.
    max_num_tokens
        The most tokens one step runs on this rank.
    device
        ``"cpu"`` or a CUDA device.
    tp_group
        The tensor-parallel process group: needed for sequence-parallel layouts, and
        to know this rank's TP rank (0 without a group).
    dense_layers
        Layers no router writes (dense MLP layers, numbered among the decoder
        layers): the buffer holds 0 there, a valid id, where other layers hold
        ``NOT_CAPTURED`` until a capture writes them.
    ring_depth
        Snapshots a CUDA capturer keeps in flight in its ring of packed device and
        pinned host buffers, allocated once; a snapshot taken while every slot is in
        flight waits for the oldest (own-stream copies) or gets a buffer of its own
        (deferred copies). vLLM's runners need their ``max_concurrent_batches`` + 1.
    host_writes
        Whether a CUDA snapshot's kernel writes its bytes straight into pinned host
        memory (the default, where the driver maps it: no copy per step) or stages
        them on the device for one device-to-host copy (NOTE 3 of ``_snapshot_async``).
    copy_once
        Whether :meth:`capture` holds each layer's ids and the capture of the last
        router layer (the last layer not in ``dense_layers``) writes every layer's rows
        with one kernel, instead of one copy per layer (NOTE 5). Off by default here;
        the vLLM plugin's worker turns it on for a CUDA device
        (``slotroute.vllm.capture_copy_once``).

    Raises
    ------
    ValueError
        If ``max_num_tokens`` or ``ring_depth`` is not positive, the device is neither
        CPU nor CUDA, or a dense layer is outside ``[0, num_layers)``.
    """

    def __init__(
        self,
        spec: RoutingSpec,
        max_num_tokens: int,
        device: torch.device | str,
        tp_group: dist.ProcessGroup | None = None,
        dense_layers: Sequence[int] = (),
        ring_depth: int = 3,
        host_writes: bool = True,
        copy_once: bool = False,
    ):
        if isinstance(max_num_tokens, bool) or int(max_num_tokens) != max_num_tokens or max_num_tokens <= 0:
            raise ValueError(f"max_num_tokens must be a positive int, got {max_num_tokens!r}")
        if isinstance(ring_depth, bool) or int(ring_depth) != ring_depth or ring_depth <= 0:
            raise ValueError(f"ring_depth must be a positive int, got {ring_depth!r}")
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or a CUDA device, got {device}")
        dense = sorted({int(layer) for layer in dense_layers})
        if dense and not (0 <= dense[0] and dense[-1] < spec.num_layers):
            raise ValueError(f"dense_layers must be in [0, {spec.num_layers}) (num_layers), got {dense}")
        self._spec = spec
        self._max_num_tokens = int(max_num_tokens)
        # One token's cleared row: NOT_CAPTURED where a router writes, 0 in dense layers.
        fill = torch.full(spec.token_shape, NOT_CAPTURED, dtype=torch.int32)
        fill[dense] = 0
        self._fill = fill.reshape(-1).to(device)
        self._row_ids = spec.num_layers * spec.top_k
        self._buffer = torch.empty((self._max_num_tokens, *spec.token_shape), dtype=torch.int32, device=device)
        # NOTE 4: a clear refills only the rows written since the last one, which
        # leaves the buffer as a whole refill would: every row is the fill after a
        # clear, and only capture() writes rows, [0, count), where a capture run in
        # Python records its count (`_written`, since the last clear). A CUDA graph's
        # replay runs no Python: it writes the rows its captures wrote while it was
        # recorded, so the most any capture() recorded into a graph (`_graph_rows`)
        # bounds every replay's rows. A buffer handed out (get_device_buffer,
        # device_buffer) may be written anywhere, by anyone: from then on every clear
        # refills it whole (`_exposed`). The kernel's clear of an 8192-token buffer
        # then shrinks to the largest graph's rows in a decode step.
        self._written = self._graph_rows = 0
        self._exposed = False
        self.clear_buffer()
        self._device = self._buffer.device  # "cuda" resolved to "cuda:<index>"
        self._capturing = torch.cuda.is_current_stream_capturing if self._device.type == "cuda" else bool
        # One view per layer, made once: capture() then slices a single dimension.
        self._layer_rows = tuple(self._buffer[:, layer] for layer in range(spec.num_layers))
        # NOTE 5: with copy_once, capture() keeps each router layer's ids (`_held`, in
        # layer order) and the last router layer's capture writes all of them with one
        # torch.stack along the layer dimension into the buffer's first rows, a
        # contiguous block (dense layers from a zero block, the 0 they hold anyway):
        # one kernel a step where a copy per layer is one kernel per MoE layer, which
        # inside a decode step's CUDA graph is most of what routing adds to the device.
        # The held tensors stay referenced until that stack is enqueued, so a CUDA
        # graph's memory pool hands their memory to no later allocation of the same
        # capture, piecewise graphs' pieces included; a replay then writes each layer's
        # ids where the recorded stack reads them. A forward that starts before the
        # last router layer's capture of the one before drops what that one held: its
        # rows stay NOT_CAPTURED and the snapshot's check reports them, never another
        # step's ids. A snapshot writes what is still held first.
        self._copy_once = bool(copy_once)
        self._held: list[tuple[int, torch.Tensor]] = []
        self._routers = [layer for layer in range(spec.num_layers) if layer not in dense]
        self._last_router = self._routers[-1] if self._routers else -1
        self._dense_rows = (torch.zeros((self._max_num_tokens, spec.top_k), dtype=torch.int32, device=device)
                            if self._copy_once and dense else None)
        self._flat = self._buffer.view(-1)  # the snapshot kernel's view, made once
        # NOTE 3: a CPU snapshot reads the buffer through this numpy view of the same
        # memory: inside an engine step a numpy slice handed to one C call measured
        # cheaper than torch ops doing the same, while for capture() torch's copy_
        # measured cheaper than a numpy assignment (docs/capture.md, "CPU step cost").
        self._host = self._buffer.numpy() if self._device.type == "cpu" else None
        self._token_shape, self._storage = spec.token_shape, spec.storage_dtype
        self._tp_group = tp_group
        self._tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self._tp_world = dist.get_world_size(tp_group) if tp_group is not None else 1
        self._gather_into_tensor = tp_group is not None and dist.get_backend(tp_group) != "gloo"
        self._copy_stream = None
        self._direct = False
        self._ring: list[_RingSlot] = []
        self._ring_depth = int(ring_depth)
        self._lend = True  # results are views of their slot until a slot is found still lent (NOTE 1)
        self._next_slot = 0
        self._row_bytes = self._row_ids * spec.storage_dtype.itemsize
        if self._device.type == "cuda" and self._tp_rank == 0:
            self._narrow = _TORCH_STORAGE[spec.storage_dtype]
            self._copy_stream = torch.cuda.Stream(self._device)
            self._ring_capacity = _packed_layout(self._max_num_tokens, self._row_bytes, self._row_ids, True)[3]
            # The kernel writes pinned host memory where the driver maps it (NOTE 3 of _snapshot_async).
            self._direct = bool(host_writes)
            self._ring = [self._new_slot(self._ring_capacity) for _ in range(self._ring_depth)]
            # Pinned spans for the results kept once the ring stops lending (NOTE 1 of _HostPool).
            self._pool = _HostPool(max(_POOL_MIN_CHUNK, self._ring_capacity), _POOL_MAX_CHUNK,
                                   map_chunk=mapped_address if self._direct else None)
            # What the kernel's launches take from this capturer, made once: the capture
            # buffer's and the fill's addresses, and the fixed part of a launch's key
            # (their dtypes and alignment, and the integers Triton specialises on; a ring
            # slot's address is 16-byte aligned, and offsets fit int32 where Triton
            # counts the step's ids in int32).
            self._fill_run = _fill_run(self._fill, PACK_BLOCK)  # the kernel's fill (NOTE 2 of _pack_kernel)
            self._addresses = (self._flat.data_ptr(), self._fill_run.data_ptr())
            self._launch_key = (self._narrow, self._addresses[0] % 16 == 0, self._addresses[1] % 16 == 0,
                                self._row_ids, spec.num_experts)
        self._launch = None  # the snapshot kernel's launcher, made by the first CUDA snapshot

    @property
    def spec(self) -> RoutingSpec:
        """The routing spec the buffer is shaped for."""
        return self._spec

    @property
    def max_num_tokens(self) -> int:
        """Rows of the capture buffer: the most tokens one step may capture."""
        return self._max_num_tokens

    @property
    def device(self) -> torch.device:
        """The device of the capture buffer (a CUDA device always carries its index)."""
        return self._device

    @property
    def device_buffer(self) -> torch.Tensor:
        """The int32 capture buffer itself (not a copy); same as :meth:`get_device_buffer`."""
        self._exposed = True  # written by anyone from now on: every clear refills it whole (NOTE 4)
        return self._buffer

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        """The stream snapshots copy to the host on; ``None`` on CPU and on TP ranks > 0."""
        return self._copy_stream

    @property
    def tp_rank(self) -> int:
        """This rank's index in the TP group (0 without a group)."""
        return self._tp_rank

    @property
    def is_rank0(self) -> bool:
        """Whether this rank ships data: only TP rank 0 does."""
        return self._tp_rank == 0

    def get_device_buffer(self) -> torch.Tensor:
        """Return the int32 capture buffer ``(max_num_tokens, num_layers, top_k)``.

        A view of the capturer's own storage (not a copy): the next step overwrites it.
        Rows written through it are cleared as those ``capture`` writes are: from then
        on every clear refills the whole buffer.
        """
        self._exposed = True  # NOTE 4
        return self._buffer

    def clear_buffer(self) -> None:
        """Fill the capture buffer with ``NOT_CAPTURED`` (-1), 0 in ``dense_layers``, on
        the current stream (one kernel).

        A snapshot of rows some layer did not write afterwards fails its range check,
        so calling this before a step turns a missed capture into an error; on CUDA a
        snapshot with ``clear=True`` does the same for the next step in its own kernel.
        Ids held for one copy (``copy_once``, NOTE 5) are dropped.
        """
        self._held = []
        self._refill(self._max_num_tokens)

    def _refill(self, rows: int) -> None:
        """Refill the buffer's first ``rows`` rows on the current stream (torch ops): a
        clear, with ``rows`` at least those written since the last one (NOTE 4)."""
        self._buffer[:rows].view(-1, self._row_ids).copy_(self._fill.view(1, -1).expand(rows, -1))
        self._written = 0

    def _rows_to_clear(self) -> int:
        """The rows a clear must refill (NOTE 4): those written since the last clear, or
        all where the buffer was handed out. The clear, once enqueued, sets ``_written``
        to 0."""
        return self._max_num_tokens if self._exposed else max(self._written, self._graph_rows)

    def capture(self, layer_id: int, topk_ids: torch.Tensor, layout: BatchLayout | None = None) -> int:
        """Write one MoE layer's routing of this rank's tokens into the buffer.

        ``layout`` says where this rank's tokens sit in ``topk_ids`` (the four layouts of
        :class:`BatchLayout`); for the sequence-parallel layout the shards are
        all-gathered across the TP group first, a collective every TP rank must reach.
        Writes on the current stream and never synchronises, so it may be recorded into
        a CUDA graph. Expert ids are checked by :meth:`snapshot`, not here.

        Returns
        -------
        int
            The rows written: this rank's tokens in this step (rows ``[0, count)``).

        Raises
        ------
        IndexError
            If ``layer_id`` is outside ``[0, num_layers)``.
        ValueError
            If ``topk_ids`` is not 2-D with ``top_k`` columns, not of an integer dtype
            (int8, uint8, int16, int32, int64), not on
            the buffer's device, its row count fits no layout, or this rank's tokens
            exceed ``max_num_tokens``. Nothing is written then.
        """
        # Bounded by one copy kernel launch (eager) or by Python overhead under a graph;
        # with copy_once, by a list append, and one stack launch at the last router layer.
        spec = self._spec
        if not 0 <= layer_id < spec.num_layers:
            raise IndexError(f"layer_id must be in [0, {spec.num_layers}) (num_layers), got {layer_id}")
        if topk_ids.ndim != 2 or topk_ids.shape[1] != spec.top_k:
            raise ValueError(
                f"topk_ids must have shape (num_rows, {spec.top_k}) (top_k), got {tuple(topk_ids.shape)}"
            )
        if topk_ids.dtype not in _TOPK_DTYPES:
            raise ValueError(
                f"topk_ids must be integers ({', '.join(str(d) for d in _TOPK_DTYPES)}), got {topk_ids.dtype}"
            )
        if topk_ids.device != self._device:
            raise ValueError(f"topk_ids must be on {self._device} (the capture buffer's device), got {topk_ids.device}")
        rows = topk_ids.shape[0]
        if layout is None or layout.num_tokens_across_dp is None:  # one DP rank: all rows
            start, count, gather = 0, rows, False
        else:
            start, count, gather = _locate(rows, layout)
        if count > self._max_num_tokens:
            raise ValueError(f"this rank has {count} tokens, more than max_num_tokens={self._max_num_tokens}")
        if gather:
            topk_ids = self._all_gather(topk_ids, layout.tp_size)
        if start or count != topk_ids.shape[0]:
            topk_ids = topk_ids[start : start + count]
        if count > self._written:  # NOTE 4
            self._written = count
        if count > self._graph_rows and self._capturing():
            self._graph_rows = count
        if not self._copy_once:
            self._layer_rows[layer_id][:count].copy_(topk_ids)
            return count
        if self._held and layer_id <= self._held[-1][0]:  # a new forward: NOTE 5
            self._held = []
        self._held.append((layer_id, topk_ids))
        if layer_id == self._last_router:
            self._write_held()
        return count

    def _write_held(self) -> None:
        """Write the rows :meth:`capture` held (NOTE 5) into the buffer and let them go:
        one stack where every router layer is held with the same rows, contiguous
        int32, else a copy per held layer."""
        held, self._held = self._held, []
        if not held:
            return
        count = held[0][1].shape[0]
        if [layer for layer, _ in held] == self._routers and all(
            ids.shape[0] == count and ids.dtype == torch.int32 and ids.is_contiguous() for _, ids in held
        ):
            by_layer = dict(held)
            zeros = None if self._dense_rows is None else self._dense_rows[:count]
            rows = [by_layer.get(layer, zeros) for layer in range(self._spec.num_layers)]
            torch.stack(rows, dim=1, out=self._buffer[:count])
            return
        for layer, ids in held:
            self._layer_rows[layer][: ids.shape[0]].copy_(ids)

    def _all_gather(self, shard: torch.Tensor, tp_size: int) -> torch.Tensor:
        if self._tp_group is None or self._tp_world != tp_size:
            raise ValueError(
                f"a sequence-parallel layout with tp_size={tp_size} needs a tp_group of that size, "
                f"got {'no group' if self._tp_group is None else f'a group of {self._tp_world}'}"
            )
        shard = shard.contiguous()
        gathered = shard.new_empty((tp_size * shard.shape[0], shard.shape[1]))
        if self._gather_into_tensor:
            dist.all_gather_into_tensor(gathered, shard, group=self._tp_group)
        else:  # gloo has no all_gather_into_tensor; the chunks are views of `gathered`
            dist.all_gather(list(gathered.chunk(tp_size)), shard, group=self._tp_group)
        return gathered

    def snapshot(
        self,
        num_tokens: int,
        slot_mapping: torch.Tensor | np.ndarray,
        clear: bool = False,
        defer_copy: bool = False,
    ) -> PendingSnapshot:
        """Start shipping the first ``num_tokens`` rows of the buffer and their KV slots.

        On CUDA this never waits for the device. One kernel, enqueued on the current
        stream (the one that ran the forward), checks every id against
        ``[0, num_experts)``, casts it to the storage dtype and writes it, the count of
        bad ids and a device ``slot_mapping`` into one packed buffer of the capturer's
        ring; with ``clear`` the same kernel then refills the rows written since the
        last clear, which leaves the buffer as :meth:`clear_buffer` does (NOTE 4 of
        ``__init__``), so the next step's missed capture is found. One
        device-to-host copy moves the packed buffer into the ring slot's pinned host
        buffer: on the capturer's copy stream, ordered after the kernel by the slot's
        event, or, with ``defer_copy``, on the caller's stream when it calls
        ``PendingSnapshot.enqueue_copy`` (a runner's own output copy stream, whose
        synchronisation then covers it). The next step may overwrite the capture
        buffer and ``slot_mapping`` at once: the kernel reads them before its kernels
        on the same stream. Any number of snapshots may be in flight (NOTE 1).

        On CPU the work is done before returning; the API is the same.

        Parameters
        ----------
        num_tokens
            Rows of this step, ``0 <= num_tokens <= max_num_tokens``.
        slot_mapping
            The KV-cache slot of every row, shape ``(num_tokens,)``, integer: a numpy
            array, a CPU tensor (both copied now) or a tensor on the buffer's device.
        clear
            Clear the capture buffer once its rows are read (the rows written since
            the last clear: NOTE 4 of ``__init__``).
        defer_copy
            Leave the device-to-host copy to ``PendingSnapshot.enqueue_copy`` (CUDA).

        Returns
        -------
        PendingSnapshot
            Its ``result()`` returns the data on TP rank 0 and ``None`` elsewhere.

        Raises
        ------
        ValueError
            If ``num_tokens`` or ``slot_mapping`` has the wrong type, shape, dtype or
            device. Out-of-range expert ids are reported by ``result()``.
        """
        # The checks run on every step, so the CPU engine's case (an int and a numpy
        # array) is tested first, by exact type.
        if type(num_tokens) is not int and (isinstance(num_tokens, bool) or not isinstance(num_tokens, np.integer)):
            raise ValueError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
        if not 0 <= num_tokens <= self._max_num_tokens:
            raise ValueError(f"num_tokens must be in [0, {self._max_num_tokens}] (max_num_tokens), got {num_tokens}")
        n = int(num_tokens)
        on_device = False
        if isinstance(slot_mapping, torch.Tensor):
            on_device = slot_mapping.device.type != "cpu"
            if on_device and slot_mapping.device != self._device:
                where = "cpu" if self._device.type == "cpu" else f"cpu or {self._device}"
                raise ValueError(f"slot_mapping must be on {where}, got {slot_mapping.device}")
            dtype_ok = not slot_mapping.dtype.is_floating_point and not slot_mapping.dtype.is_complex
            dtype_ok = dtype_ok and slot_mapping.dtype != torch.bool
            shape, dtype = tuple(slot_mapping.shape), slot_mapping.dtype
            host_slots = None if on_device else slot_mapping.numpy()
        else:
            host_slots = slot_mapping if type(slot_mapping) is np.ndarray else np.asarray(slot_mapping)
            shape, dtype = host_slots.shape, host_slots.dtype
            dtype_ok = dtype.kind in "iu"
        if shape != (n,) or not dtype_ok:
            raise ValueError(f"slot_mapping must be integers of shape ({n},) (num_tokens), got {dtype} of shape {shape}")
        if self._held:  # NOTE 5
            self._write_held()
        if self._tp_rank != 0:
            if clear:
                self._refill(self._rows_to_clear())
            return PendingSnapshot(self._spec, n)
        if self._host is not None:
            pending = self._snapshot_now(n, host_slots)
            if clear:
                self._refill(self._rows_to_clear())
            return pending
        # astype always copies: the caller may reuse its array next step
        host_slots = None if on_device else host_slots.astype(np.int64)
        device_slots = slot_mapping.contiguous() if on_device else None  # the kernel reads it flat
        return self._snapshot_async(n, device_slots, host_slots, clear, defer_copy)

    def snapshot_leading(
        self, num_tokens: int, slots: torch.Tensor, defer_copy: bool = False, row: int | None = None
    ) -> PendingSnapshot:
        """:meth:`snapshot` with ``clear`` of the first ``num_tokens`` entries of
        ``slots``, a runner's slot-mapping row that is longer than the step, or, with
        ``row``, of row ``row`` of ``slots``, a runner's 2-D slot mappings (one row per
        KV-cache group). On this capturer's CUDA device (rank 0) the kernel reads them
        in place: no torch call per step to index or slice them. Anything else, a
        malformed call included, goes through :meth:`snapshot` with the slice, and
        raises as it does.

        Raises
        ------
        ValueError
            As :meth:`snapshot`, and if ``row`` is given and ``slots`` has no such row.
        """
        # Four torch calls (dtype, device, shape, strides): each costs many times its
        # isolated time inside an engine step.
        if (
            self._host is None and self._tp_rank == 0 and type(num_tokens) is int
            and 0 <= num_tokens <= self._max_num_tokens and isinstance(slots, torch.Tensor)
        ):
            dtype = slots.dtype
            if dtype in _SLOT_DTYPES and slots.get_device() == self._device.index:
                shape, stride = slots.shape, slots.stride()
                if row is None:
                    if len(shape) == 1 and shape[0] >= num_tokens and stride[0] == 1:
                        if self._held:  # NOTE 5
                            self._write_held()
                        return self._snapshot_async(num_tokens, slots, None, True, defer_copy, dtype=dtype)
                elif (
                    type(row) is int and len(shape) == 2 and 0 <= row < shape[0]
                    and shape[1] >= num_tokens and stride[1] == 1
                ):
                    if self._held:  # NOTE 5
                        self._write_held()
                    return self._snapshot_async(
                        num_tokens, slots, None, True, defer_copy, row * stride[0] * dtype.itemsize, dtype, row
                    )
        if row is not None:
            rows = slots.shape[0] if isinstance(slots, torch.Tensor) and slots.dim() == 2 else None
            if rows is None or isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < rows:
                raise ValueError(
                    f"row must be an int in [0, {rows}) (the rows of a 2-D slots tensor), got row {row!r} "
                    f"of {type(slots).__name__} of shape {tuple(getattr(slots, 'shape', ()))}"
                )
            slots = slots[int(row)]
        return self.snapshot(num_tokens, slots[:num_tokens], clear=True, defer_copy=defer_copy)

    def _snapshot_now(self, n: int, slots: np.ndarray) -> PendingSnapshot:
        # Bounded by one pass over n * num_layers * top_k int32s; for the small steps
        # of decoding, by the number of library calls, each slowed by the caches the
        # forward just used (docs/capture.md, "CPU step cost"): with the C loops, two
        # allocations and one call that checks and narrows the ids and copies the slots
        # (the caller may reuse its array next step).
        spec = self._spec
        data = np.empty((n, *self._token_shape), self._storage)
        owned = np.empty(n, np.int64)
        ids = self._host[:n]
        bad = -1 if _native is None else _native.narrow_step(data, ids, owned, slots, spec.num_experts)
        if bad < 0:  # no C loops, or slots not int64
            # Read as uint32, a negative id (NOT_CAPTURED included) exceeds every
            # num_experts, so the largest id checks both ends.
            bad = int(np.count_nonzero(ids.view(np.uint32) >= spec.num_experts))
            data[...] = ids
            owned[...] = slots
        if bad:
            return PendingSnapshot(spec, n, error=_range_error(spec, n, bad, ids, owned), failed_slots=owned)
        return PendingSnapshot(spec, n, arrays=(data, owned))

    def _snapshot_async(
        self, n: int, slot_mapping: torch.Tensor | None, host_slots: np.ndarray | None, clear: bool, defer: bool,
        row_offset: int = 0, dtype: torch.dtype | None = None, row: int | None = None,
    ) -> PendingSnapshot:
        # Host cost: one kernel launch and, with the capturer's own stream, one event
        # record (two, a stream wait and a copy launch where it stages); nothing is
        # allocated. Device cost: one pass over the int32 rows (memory bandwidth; over
        # the rows written since the last clear with `clear`, NOTE 4) and the narrow
        # bytes over the host link.
        # `slot_mapping` is 1-D, or 2-D with `row` the one to read, `row_offset` bytes
        # from its start; `dtype` is its dtype where the caller read it.
        #
        # NOTE 3: the kernel writes the packed bytes straight into their pinned host
        # span (mapped host memory: the GPU's stores cross the host link), so a step
        # launches no copy and, on the capturer's own stream, records one event. It
        # stages them in the ring slot's device buffer and copies them instead where
        # the driver maps no address for the span, or without Triton (torch's ops
        # cannot write host memory). Either way the bytes reach the host in the order
        # of the stream the kernel runs on, before any event recorded after it there
        # (or on a stream that waits for it) completes.
        if torch.cuda.current_device() != self._device.index:
            with torch.cuda.device(self._device):
                return self._snapshot_async(n, slot_mapping, host_slots, clear, defer, row_offset, dtype, row)
        layout = _packed_layout(n, self._row_bytes, self._row_ids, slot_mapping is not None)
        rows_end, slots_at, counts_at, total = layout
        slot = self._acquire_slot(total)
        in_ring = slot in self._ring
        # A slot of the ring lends its host buffer while the capturer lends (a one-off
        # slot's is this snapshot's alone); else the snapshot fills a span of the
        # capturer's pinned host pool, and its result is views of that (NOTE 1).
        if in_ring and not self._lend:
            host = self._pool.take(total)
            target = None if self._pool.mapped is None else self._pool.mapped + host[1]
        else:
            host, target = None, slot.mapped
        launch = self._launch
        if launch is None:
            launch = self._launch = self._launcher()
        if launch is not pack_snapshot:  # addresses, element offsets and a key made of the capturer's
            # Each part's own address (64-byte aligned), for the padded stores (NOTE 1 of _pack_kernel).
            address = slot.address if target is None else target
            if slot_mapping is None:  # placeholders the kernel does not read: the rows and counts
                slots_address, slots_dtype, copy_slots = address, self._narrow, False
            else:
                slots_address, copy_slots = slot_mapping.data_ptr() + row_offset, True
                slots_dtype = slot_mapping.dtype if dtype is None else dtype

            def tensors():  # the same arguments as tensors, for a launch Triton compiles
                if target is None:
                    span = slot.device
                else:
                    span = slot.host if host is None else host[0][host[1]:host[1] + host[2].size]
                rows, counts, slots = span.view(self._narrow), span[counts_at:].view(torch.int32), span[slots_at:].view(torch.int64)
                slots_in = rows if slot_mapping is None else slot_mapping if row is None else slot_mapping[row]
                return self._flat, self._fill_run, rows, counts, slots_in, slots if copy_slots else counts

            launch.launch(
                (self._launch_key, slots_dtype, slots_address % 16 == 0),
                (*self._addresses, address, address + counts_at, slots_address,
                 address + slots_at if copy_slots else address + counts_at),
                (n * self._row_ids, self._rows_to_clear() * self._row_ids if clear else 0, self._row_ids, n if copy_slots else 0,
                 self._spec.num_experts, 0, 0),
                (copy_slots, clear, True, PACK_BLOCK), tensors,
            )
        else:
            target = None
            packed = slot.device
            if slot_mapping is not None:
                slot_mapping = (slot_mapping if row is None else slot_mapping[row])[:n]
            pack_snapshot(
                self._flat, self._fill, packed[:rows_end].view(self._narrow),
                packed[counts_at:total].view(torch.int32), slot_mapping,
                None if slot_mapping is None else packed[slots_at:slots_at + 8 * n].view(torch.int64),
                self._spec.num_experts, clear,  # the torch ops refill the whole buffer
            )
        if clear:
            self._written = 0  # NOTE 4
        pending = PendingSnapshot(
            self._spec, n, slot=slot, layout=layout, host_slots=host_slots, own_stream=not defer, host=host,
            direct=target is not None,
        )
        if in_ring:
            slot.holder = pending
        if not defer:
            if target is not None:  # written in place (NOTE 3): the event follows the kernel
                slot.copied.record()
                return pending
            # NOTE 2: the copy stream reads only the slot's packed buffer, written by
            # the kernel just enqueued on the compute stream; kernels enqueued there
            # later (the next step overwriting the capture buffer and slot_mapping)
            # cannot tear this snapshot.
            slot.ready.record(torch.cuda.current_stream())
            self._copy_stream.wait_event(slot.ready)
            with torch.cuda.stream(self._copy_stream):
                pending._copy_to_host()
                slot.copied.record(self._copy_stream)
        return pending

    def _new_slot(self, nbytes: int) -> _RingSlot:
        return _RingSlot(nbytes, self._device, self._direct)

    def reserve_host(self, nbytes: int) -> int:
        """Page-lock ``nbytes`` of host memory now for results the caller keeps.

        For a caller known to keep each result well past the next snapshots (vLLM
        0.28-0.30's in-process engines keep each decode row until its request
        finishes): from now on each snapshot's result takes a span of this memory
        (NOTE 1 of :meth:`_acquire_slot`), which grows during steps only past
        ``nbytes``. Without it the capturer finds out at the first result still in use
        and page-locks its memory a chunk at a time inside steps, about 0.4 ms per MiB.

        Returns
        -------
        int
            The pinned bytes held for results; 0 on CPU and on TP ranks other than 0,
            whose results need none.

        Raises
        ------
        ValueError
            If ``nbytes`` is not a non-negative int.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        if self._device.type != "cuda" or self._tp_rank != 0:
            return 0
        self._lend = False
        self._pool.reserve(nbytes)
        return self._pool.nbytes

    def _launcher(self):
        """What launches this capturer's snapshot kernel: the Triton kernel's
        :class:`~slotroute._capture_kernel.PackLauncher`, or :func:`pack_snapshot`'s
        torch ops where Triton is missing."""
        kernel = _fused_kernel()
        return pack_snapshot if kernel is None else kernel.PackLauncher(self._device.index)

    def _acquire_slot(self, nbytes: int) -> _RingSlot:
        """The next slot of the ring, for a snapshot of ``nbytes`` packed bytes.

        NOTE 1: a slot is free once the snapshot that held it was resolved (after its
        copy completed) and no view of its host buffer, a lent result's arrays, is
        alive. One still held by an own-stream snapshot is freed by resolving that
        snapshot (a host wait on its blocking event). One held by a deferred snapshot,
        whose copy this capturer cannot wait for, is left alone: the step takes another
        free slot, or one added to the ring (at most twice its depth: a runner that
        keeps more steps in flight than its ``max_concurrent_batches`` says, as vLLM
        0.29's in-process V2 engine does, grows the ring once instead of allocating
        every step), or buffers of its own. One whose lent result is still in use when
        its turn comes shows a caller that keeps results (vLLM 0.28-0.30's in-process engine
        keeps a view of each decode row until its request finishes): from then on the
        capturer lends no ring buffer; each snapshot's copy fills a span of its own in
        the capturer's pinned host pool (:class:`_HostPool`: no host copy, and host
        memory held as long as the caller keeps rows of the span's chunk), and
        this step takes another free slot, or one added to the ring (at most twice its
        depth), or buffers of its own. A runner whose steps in flight are fewer than
        the ring's slots, and that drops each step's result once it is read (vLLM
        0.31+ stores the rows and drops them), takes none of these branches and
        allocates nothing per step. Only a held own-stream snapshot resolved to free
        its slot copies its result out of the slot.
        """
        ring, at = self._ring, self._next_slot
        slot = ring[at]
        holder = slot.holder
        if holder is not None and holder._own_stream:
            holder._copy_out = True  # so that resolving it frees the slot
            holder._resolve()
            holder = None
        if holder is not None or slot.lent():
            if holder is None and self._lend:
                logger.info("slotroute: a routing result was still in use when its ring slot came round "
                            "again; each result gets pinned host memory of its own from now on")
                self._lend = False
            slot = next((other for other in ring if other.holder is None and not other.lent()), None)
            if slot is None:
                if len(ring) >= 2 * self._ring_depth:
                    return self._new_slot(nbytes)
                slot = self._new_slot(self._ring_capacity)
                ring.insert(at, slot)
            at = ring.index(slot)
        self._next_slot = (at + 1) % len(ring)
        return slot

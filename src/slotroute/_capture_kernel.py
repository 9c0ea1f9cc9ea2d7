"""The one kernel of a CUDA snapshot, in Triton.

:func:`slotroute.capture.pack_snapshot` imports this module on its first call with a
CUDA tensor, so that CPU runs (the demo, the tests, the CPU server) never import Triton.
"""

import triton
import triton.language as tl

from slotroute.capture import _fill_run

@triton.jit(do_not_specialize=["numel", "clear_numel", "num_slots", "counts_at", "slots_at"])
def _pack_kernel(
    ids, fill, rows, counts, slots_in, slots_out, numel, clear_numel, row_elems, num_slots, num_experts,
    counts_at, slots_at, COPY_SLOTS: tl.constexpr, CLEAR: tl.constexpr, PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    # Program p: ids [p * BLOCK, (p + 1) * BLOCK) narrowed into `rows`, its count of ids
    # outside [0, num_experts) into counts[counts_at + p] (every counting program writes
    # its own entry: nothing to zero first); the same span of the capture buffer, below
    # clear_numel, refilled from `fill` (NOTE 2); the same span of the slot mapping
    # copied as int64 from slots_out[slots_at]. Bounded by memory bandwidth, or by the
    # host link where `rows` and `slots_out` are mapped host memory.
    #
    # NOTE 1: with PAD the rows are stored up to numel rounded up to 16 and the slots
    # up to num_slots rounded up to 2, zeros past the end (the caller leaves room): a
    # store mask Triton knows to be constant over 16 bytes lets it store 16-byte
    # vectors. Masked at numel itself (an integer it does not specialise), every
    # element is stored alone: to mapped host memory, one transfer per byte over the
    # host link, 60-80 times slower (docs/capture.md).
    #
    # NOTE 2: `fill` is one token's pattern (row_elems ids) repeated over at least
    # BLOCK + row_elems ids (capture._fill_run), so that a program reads its span's refill at the
    # one offset where its first id falls in a token: one 64-bit remainder per program.
    # An element's own `offset % row_elems` is a 64-bit division by a value Triton does
    # not specialise, which the GPU runs as a software routine, for every id cleared.
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if pid.to(tl.int64) * BLOCK < numel:
        inside = offsets < numel
        found = tl.load(ids + offsets, mask=inside, other=0)
        stored = offsets < (numel + 15) // 16 * 16 if PAD else inside
        tl.store(rows + offsets, found.to(rows.dtype.element_ty), mask=stored)
        tl.store(counts + counts_at + pid, tl.sum(((found < 0) | (found >= num_experts)).to(tl.int32), axis=0))
    if CLEAR:
        # After the load above, in program order on the same addresses: it read the ids first.
        cleared = offsets < clear_numel
        phase = (pid.to(tl.int64) * BLOCK) % row_elems
        tl.store(ids + offsets, tl.load(fill + phase + tl.arange(0, BLOCK), mask=cleared, other=0), mask=cleared)
    if COPY_SLOTS:
        copied = offsets < num_slots
        stored = offsets < (num_slots + 1) // 2 * 2 if PAD else copied
        tl.store(slots_out + slots_at + offsets, tl.load(slots_in + offsets, mask=copied, other=0).to(tl.int64), mask=stored)


_INT32_MAX = (1 << 31) - 1


class PackLauncher:
    """The kernel's launches for one capturer, on the current stream of its device.

    Invariant: a compiled kernel is launched directly only for a call whose every
    property Triton specialises on (each pointer's dtype and 16-byte alignment, each
    integer's width, the specialised integers' values and the constexprs) equals
    that of the call which compiled it through Triton's JIT launch.

    NOTE 1: Triton's JIT launch (``kernel[grid](...)``) binds and specialises every
    argument, hashes a cache key and asks the driver for each tensor's pointer on
    every call: most of a snapshot's host time inside an engine step. The compiled
    kernel it returns is launched here directly (``CompiledKernel[grid](*args,
    stream=...)``, the same call the JIT launch ends in, with the same arguments:
    every parameter, constexprs included, in order; pointers as integers), keyed by
    those properties; any call whose key is new goes through the JIT launch first.

    NOTE 2: even the compiled kernel's launch spends most of its time in Python: a
    closure per call, a metadata dict for the launch hooks and two calls of the hook
    chains, empty unless a profiler hooked launches. While both chains are empty the
    kernel's launcher (``CompiledKernel.run``, the call ``CompiledKernel[grid]`` ends
    in, of the same signature in Triton 3.5-3.7) is called directly with no hooks and
    no metadata; a hooked launch goes through ``CompiledKernel[grid]``.
    """

    def __init__(self, device_index: int) -> None:
        self._compiled: dict[tuple, tuple] = {}  # key -> (compiled kernel, its launcher, function, metadata)
        self._device_index = device_index
        self._stream = None  # the driver's current-stream getter, taken at the first direct launch
        self._runtime = getattr(getattr(triton, "knobs", None), "runtime", None)  # where the launch hooks live

    def __call__(
        self, ids, fill, rows, counts, slots_in, slots_out, num_experts: int, clear: bool, block: int,
        numel: int | None = None, counts_at: int = 0, slots_at: int = 0, num_slots: int | None = None,
    ) -> None:
        """As :func:`pack_snapshot` (``fill`` one token's pattern: it is repeated here,
        NOTE 2 of ``_pack_kernel``). Bounded by the launch's Python calls (NOTE 1)."""
        if numel is None:
            numel = rows.numel()
        clear_numel = ids.numel() if clear else 0
        row_elems = fill.numel()
        fill = _fill_run(fill, block)
        if num_slots is None:
            num_slots = 0 if slots_out is None else slots_out.numel()
        copy_slots = slots_out is not None
        slots_in = rows if slots_in is None else slots_in
        slots_out = counts if slots_out is None else slots_out
        pointers = (ids, fill, rows, counts, slots_in, slots_out)
        addresses = tuple(t.data_ptr() for t in pointers)
        sizes = (numel, clear_numel, row_elems, num_slots, num_experts, counts_at, slots_at)
        key = (tuple(t.dtype for t in pointers), tuple(a & 15 == 0 for a in addresses), sizes[2], num_experts)
        self.launch(key, addresses, sizes, (copy_slots, clear, False, block), lambda: pointers)

    def launch(self, key: tuple, addresses: tuple, sizes: tuple, flags: tuple, tensors) -> None:
        """Launch with the six pointer arguments as ``addresses`` (ints; ``fill``'s that of
        a ``_fill_run``), ``sizes`` (the seven integer arguments, in order; ids
        ``[0, clear_numel)`` are refilled) and ``flags`` (``COPY_SLOTS``, ``CLEAR``,
        ``PAD``, ``BLOCK``; with ``PAD`` the rows and slots need room for the
        kernel's padded stores, NOTE 1 of ``_pack_kernel``). ``key`` holds what Triton
        specialises on beyond ``flags`` and the integers' widths (the pointers' dtypes
        and alignment, ``row_elems`` and ``num_experts``); ``tensors()`` returns the
        six pointer arguments as tensors, called only for a call whose key is new (the
        JIT launch specialises on them)."""
        numel, clear_numel, row_elems, num_slots, num_experts, counts_at, slots_at = sizes
        span = max(numel, clear_numel, num_slots)
        if span == 0:
            return
        grid = (-(-span // flags[3]), 1, 1)
        # Offsets past int32 make Triton type an argument int64: such a call always takes the JIT launch.
        key = None if max(span, counts_at, slots_at) > _INT32_MAX else (key, flags)
        entry = self._compiled.get(key)
        if entry is not None:
            compiled, run, function, metadata = entry
            stream = self._stream(self._device_index)
            if run is not None and self._unhooked():
                run(grid[0], 1, 1, stream, function, metadata, None, None, None, *addresses, *sizes, *flags)  # NOTE 2
            else:
                compiled[grid](*addresses, *sizes, *flags, stream=stream)
            return
        copy_slots, clear, pad, block = flags
        compiled = _pack_kernel[grid](*tensors(), *sizes, COPY_SLOTS=copy_slots, CLEAR=clear, PAD=pad, BLOCK=block)
        if key is not None and isinstance(compiled, triton.compiler.CompiledKernel):  # not under the interpreter
            self._compiled[key] = self._launcher_of(compiled)
            self._stream = triton.runtime.driver.active.get_current_stream

    def _unhooked(self) -> bool:
        """Whether no launch hook is set (each is ``None`` or an empty hook chain)."""
        enter, leave = self._runtime.launch_enter_hook, self._runtime.launch_exit_hook
        return (enter is None or not getattr(enter, "calls", True)) and (leave is None or not getattr(leave, "calls", True))

    def _launcher_of(self, compiled) -> tuple:
        """``compiled`` and what calling its launcher takes (NOTE 2): the launcher,
        the kernel's handle and its packed metadata, or three ``None`` where this
        Triton lacks any of them (then ``CompiledKernel[grid]`` launches it)."""
        parts = (None, None, None)
        if self._runtime is not None and hasattr(compiled, "_init_handles"):
            compiled._init_handles()
            found = tuple(getattr(compiled, name, None) for name in ("run", "function", "packed_metadata"))
            if None not in found and hasattr(self._runtime, "launch_enter_hook"):
                parts = found
        return (compiled, *parts)


def pack_snapshot(
    ids, fill, rows, counts, slots_in, slots_out, num_experts: int, clear: bool, block: int,
    numel: int | None = None, counts_at: int = 0, slots_at: int = 0, num_slots: int | None = None,
) -> None:
    """Launch the kernel on the current stream through Triton's JIT launch (arguments
    as :func:`slotroute.capture.pack_snapshot` takes them; ``block`` ids per program).
    ``numel`` ids go to ``rows`` (default: all of it), the counts start at element
    ``counts_at`` of ``counts`` and the ``num_slots`` slots (default: all of
    ``slots_out``) at element ``slots_at`` of ``slots_out``: a ring slot's buffer is
    passed whole, through views made once. A capturer's snapshots launch through its
    :class:`PackLauncher` instead."""
    PackLauncher(ids.device.index)(ids, fill, rows, counts, slots_in, slots_out, num_experts, clear, block,
                                   numel, counts_at, slots_at, num_slots)

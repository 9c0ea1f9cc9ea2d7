"""The one kernel of a CUDA snapshot, in Triton.

:func:`slotroute.capture.pack_snapshot` imports this module on its first call with a
CUDA tensor, so that CPU runs (the demo, the tests, the CPU server) never import Triton.
"""

import triton
import triton.language as tl

@triton.jit(do_not_specialize=["numel", "clear_numel", "num_slots", "counts_at", "slots_at"])
def _pack_kernel(
    ids, fill, rows, counts, slots_in, slots_out, numel, clear_numel, row_elems, num_slots, num_experts,
    counts_at, slots_at, COPY_SLOTS: tl.constexpr, CLEAR: tl.constexpr, BLOCK: tl.constexpr,
):
    # Program p: ids [p * BLOCK, (p + 1) * BLOCK) narrowed into `rows`, its count of ids
    # outside [0, num_experts) into counts[counts_at + p] (every counting program writes
    # its own entry: nothing to zero first); the same span of the capture buffer
    # refilled from `fill` (one token's pattern); the same span of the slot mapping
    # copied as int64 from slots_out[slots_at]. Bounded by memory bandwidth.
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if pid.to(tl.int64) * BLOCK < numel:
        inside = offsets < numel
        found = tl.load(ids + offsets, mask=inside, other=0)
        tl.store(rows + offsets, found.to(rows.dtype.element_ty), mask=inside)
        tl.store(counts + counts_at + pid, tl.sum(((found < 0) | (found >= num_experts)).to(tl.int32), axis=0))
    if CLEAR:
        # After the load above, in program order on the same addresses: it read the ids first.
        cleared = offsets < clear_numel
        tl.store(ids + offsets, tl.load(fill + offsets % row_elems, mask=cleared, other=0), mask=cleared)
    if COPY_SLOTS:
        copied = offsets < num_slots
        tl.store(slots_out + slots_at + offsets, tl.load(slots_in + offsets, mask=copied, other=0).to(tl.int64), mask=copied)


def pack_snapshot(
    ids, fill, rows, counts, slots_in, slots_out, num_experts: int, clear: bool, block: int,
    numel: int | None = None, counts_at: int = 0, slots_at: int = 0, num_slots: int | None = None,
) -> None:
    """Launch the kernel on the current stream (arguments as
    :func:`slotroute.capture.pack_snapshot` takes them; ``block`` ids per program).
    ``numel`` ids go to ``rows`` (default: all of it), the counts start at element
    ``counts_at`` of ``counts`` and the ``num_slots`` slots (default: all of
    ``slots_out``) at element ``slots_at`` of ``slots_out``: a ring slot's buffer is
    passed whole, through views made once."""
    if numel is None:
        numel = rows.numel()
    clear_numel = ids.numel() if clear else 0
    if num_slots is None:
        num_slots = 0 if slots_out is None else slots_out.numel()
    span = max(numel, clear_numel, num_slots)
    if span == 0:
        return
    _pack_kernel[(triton.cdiv(span, block),)](
        ids, fill, rows, counts, rows if slots_in is None else slots_in, counts if slots_out is None else slots_out,
        numel, clear_numel, fill.numel(), num_slots, num_experts, counts_at, slots_at,
        COPY_SLOTS=slots_out is not None, CLEAR=clear, BLOCK=block,
    )

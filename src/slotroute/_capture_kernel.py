"""The fused check-and-narrow pass of a CUDA snapshot, in Triton.

:func:`slotroute.capture.check_and_narrow` imports this module on its first call with a
CUDA tensor, so that CPU runs (the demo, the tests, the CPU server) never import Triton.
"""

import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _check_and_narrow_kernel(src, dst, bad, numel, num_experts, BLOCK: tl.constexpr):
    # One read of the int32 ids, one write in the storage dtype, and a count of ids
    # outside [0, num_experts) added to *bad. Bounded by memory bandwidth.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    ids = tl.load(src + offsets, mask=inside, other=0)
    tl.store(dst + offsets, ids.to(dst.dtype.element_ty), mask=inside)
    count = tl.sum(((ids < 0) | (ids >= num_experts)).to(tl.int32), axis=0)
    if count > 0:
        tl.atomic_add(bad, count)


def check_and_narrow(src, dst, bad, num_experts: int) -> None:
    """Launch the kernel over ``src`` on the current stream (arguments as
    :func:`slotroute.capture.check_and_narrow` takes them)."""
    numel = src.numel()
    _check_and_narrow_kernel[(triton.cdiv(numel, BLOCK),)](src, dst, bad, numel, num_experts, BLOCK=BLOCK)

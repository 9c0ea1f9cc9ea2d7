"""Page faults of vLLM 0.28-0.30's joins at a request's finish (the front end
concatenates its prompt's rows, read by the scheduler when its prefill completed, with
one row a decode step, into a new array), with the prompt reads freed at each join, as
``SlotRouting.read``'s fresh arrays are, against memory kept for the reads (the pool
written through at start that slotroute had until 2026-11-29), under glibc's default
allocation, with its mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``), and with
thresholds a server could set (``GLIBC_TUNABLES``).

Each case runs in a child process of its own: 64 conversations, 4 turns, each turn's
prompt reads made (fresh, or spans of memory written at start), then each
conversation's join followed by its read dropped (vLLM's front end drops a request's
state once it is joined), the turn's joins held until the next turn's are made (a
caller of ``LLM.generate`` holds a turn's outputs while it builds the next turn). The
figure is the joins' minor page faults summed over the turns: a count, not a time, the
same on every run of one machine and glibc.

    python benchmarks/allocator_joins.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
from gpu_engine import allocator_environment

CONVERSATIONS, TURNS = 64, 4
READ_BYTES = 700 << 10  # a turn's prompt rows: 1,866 tokens of 384 B (qwen3 shape)
DECODE_BYTES = 128 * 384  # a turn's decode rows
TUNED = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"
ALLOCATORS = {"glibc default": {}, "mmap threshold fixed at 128 KiB": {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)},
              "GLIBC_TUNABLES (32 MiB mmap, 4 GiB trim)": {"GLIBC_TUNABLES": TUNED}}
READS = ("freed", "kept")


def child(reads: str) -> int:
    """The joins' page faults over every turn, with the reads ``freed`` or ``kept``."""
    from slotroute.tools.bench import minor_faults

    kept = None
    if reads == "kept":
        kept = np.empty(CONVERSATIONS * READ_BYTES, np.uint8)
        kept.fill(0)  # written through at start, never freed

    def read(i: int) -> np.ndarray:
        if kept is not None:
            return kept[i * READ_BYTES:(i + 1) * READ_BYTES]
        rows = np.empty(READ_BYTES, np.uint8)
        rows.fill(1)
        return rows

    faults, previous = 0, []
    for _ in range(TURNS):
        prompts = [read(i) for i in range(CONVERSATIONS)]  # as each prefill completes
        joins = []
        before = minor_faults()
        for i in range(CONVERSATIONS):  # the turn's end: each request joined, then its state dropped
            joins.append(np.concatenate([prompts[i], np.ones(DECODE_BYTES, np.uint8)]))
            prompts[i] = None
        faults += minor_faults() - before
        previous = joins  # the caller holds a turn's outputs until the next turn's return
    del previous
    return faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=READS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    allocator = allocator_environment(os.environ)
    env = {k: v for k, v in os.environ.items() if k not in allocator}
    print(f"{CONVERSATIONS} conversations x {TURNS} turns, reads of {READ_BYTES >> 10} KiB: the joins' page faults")
    print("| allocator | reads freed | reads kept |\n|---|---|---|")
    for name, extra in ALLOCATORS.items():
        counts = [json.loads(subprocess.run([sys.executable, __file__, "--child", reads], env=dict(env, **extra),
                                            capture_output=True, text=True, check=True).stdout) for reads in READS]
        print(f"| {name} | {counts[0]:,} | {counts[1]:,} |")


if __name__ == "__main__":
    main()

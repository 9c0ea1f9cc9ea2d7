"""Where a step's prompt reads land, on vLLM 0.28-0.30's scheduler path: each request
whose prefill completes gets its prompt's rows in an array of its own (``fresh``, as
slotroute and vLLM's own manager read today), against one allocation for all of the
step's reads with each request handed a view of it (``step``: numpy's ``empty``,
which asks for transparent huge pages from 4 MiB; ``step-thp``: an anonymous mapping
rounded up to 2 MiB with ``MADV_HUGEPAGE``, whatever its size).

Two workloads of the GPU engine benchmark's shape (qwen3: 48 layers x top-8, one byte
an expert id, 384 B a token), the rows gathered from a store of scattered 16-token
blocks written before the clock starts:

- ``multi-turn``: 64 conversations, 4 turns of 1,024, 1,280, 1,536 and 1,792 prompt
  tokens, all 64 prompts completing in one step; a turn's reads are held until the
  next turn's are made, then dropped (a caller holds a turn's outputs while it builds
  the next);
- ``rollout``: 32 steps of 8 prompts of 1,024 tokens, every read held to the end.

Each layout and workload runs in a child process of its own (a fresh allocator, as a
fresh engine has), in an order that rotates between rounds. Printed: per layout the
median, min and max over rounds of the reads' ms per workload and their minor page
faults, and each ``step`` layout's time against ``fresh`` in the same round. Off the
clock, each child checks that every read holds its own rows.

    python benchmarks/prompt_buffers.py [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import subprocess
import sys
import time

import numpy as np

TOKEN_BYTES = 48 * 8
BLOCK = 16
STORE_TOKENS = 1 << 18  # 96 MiB of scattered blocks
HUGE = 2 << 20
LAYOUTS = ("fresh", "step", "step-thp")
WORKLOADS = {"multi-turn": [[1024 + 256 * turn] * 64 for turn in range(4)], "rollout": [[1024] * 8] * 32}


def step_buffer(layout: str, tokens: int) -> np.ndarray:
    """One allocation for a step's reads: numpy's, or a mapping advised huge."""
    if layout == "step":
        return np.empty((tokens, TOKEN_BYTES), np.uint8)
    size = -(-tokens * TOKEN_BYTES // HUGE) * HUGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared would be shmem's THP
    region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, np.uint8, tokens * TOKEN_BYTES).reshape(tokens, TOKEN_BYTES)


def child(layout: str, workload: str) -> dict:
    """The reads' seconds and page faults over one workload in this process."""
    from slotroute.tools.bench import minor_faults

    rng = np.random.default_rng(0)
    store = np.empty((STORE_TOKENS, TOKEN_BYTES), np.uint8)
    store[:] = (np.arange(STORE_TOKENS) % 251)[:, None]  # written before the clock, as a committed store is
    blocks = rng.permutation(STORE_TOKENS // BLOCK)
    held, seconds, faults, next_block = [], 0.0, 0, 0
    for step in WORKLOADS[workload]:
        if workload == "multi-turn":
            previous, held = held, []
        plans = []
        for tokens in step:
            count = -(-tokens // BLOCK)
            plans.append((tokens, blocks[next_block:next_block + count]))
            next_block = (next_block + count) % (len(blocks) - 256)
        before, began = minor_faults(), time.perf_counter()
        buffer = step_buffer(layout, sum(t for t, _ in plans)) if layout != "fresh" else None
        offset = 0
        for tokens, ids in plans:
            rows = np.empty((tokens, TOKEN_BYTES), np.uint8) if buffer is None else buffer[offset:offset + tokens]
            offset += tokens
            for i, block in enumerate(ids):
                take = min(BLOCK, tokens - i * BLOCK)
                rows[i * BLOCK:i * BLOCK + take] = store[block * BLOCK:block * BLOCK + take]
            held.append(rows)
        seconds += time.perf_counter() - began
        faults += minor_faults() - before
        for (tokens, ids), rows in zip(plans, held[-len(plans):]):  # off the clock: each read its own rows
            expected = store[(ids[:, None] * BLOCK + np.arange(BLOCK)).ravel()[:tokens]]
            if not np.array_equal(rows, expected):
                raise SystemExit(f"{layout}: a read of {tokens} tokens does not hold its rows")
        if workload == "multi-turn":
            del previous
    return dict(ms=1e3 * seconds, faults=faults)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="every child's figures")
    parser.add_argument("--child", nargs=2, metavar=("LAYOUT", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    runs = []
    for r in range(args.rounds):
        order = LAYOUTS[r % len(LAYOUTS):] + LAYOUTS[:r % len(LAYOUTS)]
        for workload in WORKLOADS:
            for layout in order:
                out = subprocess.run([sys.executable, __file__, "--child", layout, workload],
                                     check=True, capture_output=True, text=True).stdout
                runs.append(dict(round=r, layout=layout, workload=workload, **json.loads(out)))
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    print(f"numpy {np.__version__}, transparent huge pages: {thp}; {args.rounds} rounds, one child a run")
    print("| workload | layout | reads ms, median (min-max) | page faults, median | ms / fresh, same round: median (min-max) |")
    print("|---|---|---|---|---|")
    for workload in WORKLOADS:
        fresh = {x["round"]: x["ms"] for x in runs if x["workload"] == workload and x["layout"] == "fresh"}
        for layout in LAYOUTS:
            mine = [x for x in runs if x["workload"] == workload and x["layout"] == layout]
            ms = [x["ms"] for x in mine]
            ratios = [x["ms"] / fresh[x["round"]] for x in mine]
            print(f"| {workload} | {layout} | {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) | "
                  f"{statistics.median(x['faults'] for x in mine):.0f} | "
                  f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(thp=thp, numpy=np.__version__, rounds=args.rounds, runs=runs), f, indent=1)


if __name__ == "__main__":
    main()

"""store_batch of this checkout against the ``store.py`` of another commit, timed in
the same interleaved rounds (``slotroute bench``'s 8192-token workload, cold and
cache-hot destinations), next to the memcpy and vLLM-baseline references.

Figures from separate runs of a shared machine differ by more than most changes to
the store; ratios taken in the same rounds do not.

    python benchmarks/core_store_ab.py f0fd139 --rounds 15
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

from slotroute import store as current
from slotroute.tools import bench


def load_store(rev: str):
    """The ``slotroute/store.py`` of commit ``rev``, imported as a separate module."""
    source = subprocess.run(
        ["git", "show", f"{rev}:src/slotroute/store.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "store_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("store_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(before, spec, rounds: int) -> dict[str, float]:
    w = bench.make_store_workload(spec)
    cases = {}
    for hot in (False, True):
        refs = bench.store_cases(w, hot=hot)
        period = 1 if hot else len(w.steps)
        tag = "hot " if hot else ""
        cases[tag + "memcpy"] = refs["memcpy"]
        cases[tag + "baseline"] = refs["baseline"]
        for name, module in (("before", before), ("after", current)):
            mgr = module.RoutedExpertsManager(spec, w.num_blocks, w.block_size)
            cases[tag + name] = bench._cycle(lambda k, m=mgr: m.store_batch(w.data, w.steps[k]), period)
    return bench.measure(cases, rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="commit whose store.py is the 'before'")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--preset", action="append", choices=sorted(bench.PRESETS))
    args = parser.parse_args(argv)
    before = load_store(args.rev)
    print(f"machine: {bench.machine()}; before = {args.rev}")
    print("| preset | destinations | before, µs | after, µs | after / before | after vs memcpy | after vs baseline |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.preset or list(bench.PRESETS):
        t = compare(before, bench.PRESETS[name], args.rounds)
        for tag, label in (("", "cold"), ("hot ", "cache-hot")):
            b, a = t[tag + "before"], t[tag + "after"]
            print(
                f"| {name} | {label} | {b * 1e6:.0f} | {a * 1e6:.0f} | {a / b:.2f} | "
                f"{t[tag + 'memcpy'] / a:.2f}x | {t[tag + 'baseline'] / a:.2f}x |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

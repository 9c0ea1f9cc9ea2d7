"""benchmarks/allocator_joins.py as a smoke test: a child per allocator and way of
reading, the report's rows well formed. The counts are glibc's and this machine's; the
one asserted is that the joins take page faults at all where glibc's threshold is
fixed at 128 KiB, every join then a mapping of its own."""

from __future__ import annotations

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).with_name("allocator_joins.py")


def test_allocator_joins_reports_each_allocator_with_the_joins_faults_both_ways():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    assert out.startswith("64 conversations x 4 turns, reads of 700 KiB: the joins' page faults")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "allocator" not in line]
    assert [row[0].strip() for row in rows] == ["glibc default", "mmap threshold fixed at 128 KiB",
                                                "GLIBC_TUNABLES (32 MiB mmap, 4 GiB trim)"]
    counts = {row[0].strip(): [int(cell.replace(",", "")) for cell in row[1:]] for row in rows}
    pages = 4 * 64 * (700 * 1024 + 128 * 384) // 4096  # every join's pages, every turn
    assert all(count >= 0.9 * pages for count in counts["mmap threshold fixed at 128 KiB"])

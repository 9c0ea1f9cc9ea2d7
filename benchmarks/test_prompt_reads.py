"""benchmarks/prompt_reads.py as a smoke test: a round per allocator, each child's
reads checked by the script's own run, the report's rows well formed. No timing is
asserted (these machines are shared)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).with_name("prompt_reads.py")


def test_prompt_reads_reports_each_allocator_with_its_faults_and_same_round_ratio():
    out = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "2", "--steps", "10", "--num-blocks", "8192",
                          "--prompt-tokens", "2048"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("2 rounds; a step: 4 reads of 2048 rows (qwen3-30b-a3b), each step's results kept to the end")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [row[0].strip() for row in rows] == ["glibc default", "mmap threshold fixed at 128 KiB"]
    for row in rows:
        fresh, fresh_faults, pooled, pooled_faults, ratio = (float(cell.split()[0]) for cell in row[1:])
        assert fresh > 0 and pooled > 0 and ratio > 0
        assert pooled_faults < 2 < fresh_faults  # a 768 KiB read: 192 pages, written through at start or not

"""benchmarks/prompt_buffers.py as a smoke test: one round, a child per layout and
workload, each child checking off the clock that every read holds its own rows (a
view handed out at the wrong offset exits the child non-zero), the report's rows well
formed. The times are this machine's and are not asserted; the one count asserted is
that fresh arrays on the rollout, every read held to the end, take page faults for
most of the rows' pages."""

from __future__ import annotations

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).with_name("prompt_buffers.py")


def test_prompt_buffers_reports_every_layout_and_the_fresh_reads_faults():
    out = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1"], capture_output=True, text=True,
                         check=True).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "layout" not in line]
    assert [(row[0].strip(), row[1].strip()) for row in rows] == [
        (workload, layout) for workload in ("multi-turn", "rollout") for layout in ("fresh", "step", "step-thp")]
    faults = {(row[0].strip(), row[1].strip()): int(row[3]) for row in rows}
    pages = 256 * 1024 * 384 // 4096  # the rollout's reads, all alive at its end
    assert faults["rollout", "fresh"] >= pages // 2
    assert all(row[4].strip().startswith("1.000") for row in rows if row[1].strip() == "fresh")

"""benchmarks/frontend_rows.py as a smoke test: both ways on both workloads, every
figure reported, the JSON holding each round and each same-round ratio. The times are
this machine's and are not asserted (that no join runs at finish is
tests/test_outputs.py's and the engine tests')."""

from __future__ import annotations

import json

import frontend_rows
import pytest


def test_frontend_rows_reports_both_ways_and_the_finishing_steps_without_joins(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert frontend_rows.main(["--rounds", "2", "--json", str(out)]) == 0
    report = capsys.readouterr().out
    assert report.startswith("2 rounds, the two ways interleaved, vLLM 0.28-0.30's arrays")
    rows = [line.split("|")[1:3] for line in report.splitlines() if line.startswith(("| rollout", "| multi-turn"))]
    assert [(w.strip(), way.strip()) for w, way in rows[:4]] == [
        ("rollout", "vllm"), ("rollout", "slotroute"), ("multi-turn", "vllm"), ("multi-turn", "slotroute")]
    found = json.loads(out.read_text())
    assert len(found["rounds"]) == 2
    for workload in ("rollout", "multi-turn"):
        for way in ("vllm", "slotroute"):
            assert all(r[workload][way]["total_ms"] > 0 for r in found["rounds"])
        ratio = found["summary"][f"{workload} ratios"]["finishing_ms"]
        assert ratio["min"] <= ratio["median"] <= ratio["max"]


def test_frontend_rows_with_the_connectors_arrays_times_the_finishing_step(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert frontend_rows.main(["--rounds", "1", "--connector", "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("1 rounds, the two ways interleaved, vLLM 0.31+'s arrays")
    found = json.loads(out.read_text())
    for workload in ("rollout", "multi-turn"):
        for way in ("vllm", "slotroute"):
            figures = found["rounds"][0][workload][way]
            assert figures["finishing_ms"] > 0 and figures["total_ms"] == figures["finishing_ms"]


def test_rounds_below_one_are_refused(capsys):
    with pytest.raises(SystemExit):
        frontend_rows.main(["--rounds", "0"])
    assert "--rounds takes a count of 1 or more, got 0" in capsys.readouterr().err

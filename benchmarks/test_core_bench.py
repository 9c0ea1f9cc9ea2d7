"""pytest-benchmark for the core: store_batch, get and the wire format on each preset,
next to the vLLM-style baseline and a memcpy of the same bytes (same workloads as
``slotroute bench``). ``pytest benchmarks --benchmark-enable`` measures; without it
each case runs once as a smoke test."""

from __future__ import annotations

import pathlib
import platform
import shutil
import subprocess

import pytest

from slotroute.tools import bench

PRESETS = list(bench.PRESETS)


@pytest.fixture(scope="module", params=PRESETS)
def preset(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def step_workload(preset):
    return bench.make_store_workload(bench.PRESETS[preset])


@pytest.fixture(scope="module")
def store_cases(step_workload):
    return bench.store_cases(step_workload)


@pytest.fixture(scope="module")
def one_token_cases(preset):
    return bench.store_cases(bench.make_store_workload(bench.PRESETS[preset], num_tokens=1))


@pytest.fixture(scope="module")
def get_cases(preset):
    return bench.get_cases(bench.make_get_workload(bench.PRESETS[preset]))


@pytest.fixture(scope="module")
def scheduler_reads(preset):
    return bench.make_scheduler_read_workload(bench.PRESETS[preset])


def run(benchmark, group: str, fn):
    benchmark.group = group
    bench.warm_up(fn)
    return benchmark(fn)


@pytest.mark.parametrize("case", ["narrow", "int32", "baseline", "memcpy", "id check"])
def test_store_batch_of_an_8192_token_step(benchmark, preset, store_cases, case):
    run(benchmark, f"store_batch 8192 tok {preset}", store_cases[case])


@pytest.mark.parametrize("case", ["narrow", "baseline"])
def test_store_batch_of_one_decode_token(benchmark, preset, one_token_cases, case):
    run(benchmark, f"store_batch 1 tok {preset}", one_token_cases[case])


@pytest.mark.parametrize("case", ["ours", "baseline", "memcpy", "block gather"])
def test_get_of_a_32768_token_request(benchmark, preset, get_cases, case):
    out = run(benchmark, f"get 32768 tok {preset}", get_cases[case])
    token_shape = bench.PRESETS[preset].token_shape
    assert out.reshape(-1, *token_shape).shape == (bench.REQUEST_TOKENS, *token_shape)


@pytest.mark.parametrize("case", ["encode+decode", "memcpy"])
def test_encode_and_decode_of_an_8192_token_step(benchmark, preset, step_workload, case):
    out = run(benchmark, f"wire 8192 tok {preset}", bench.wire_cases(step_workload)[case])
    if case == "encode+decode":
        assert out.routing_data.shape == step_workload.data.shape


@pytest.mark.parametrize("case", ["ours", "baseline", "memcpy"])
def test_scheduler_reads_of_one_decode_step_of_256_requests(benchmark, preset, scheduler_reads, case):
    out = run(benchmark, f"scheduler reads 256 requests {preset}", bench.scheduler_read_cases(scheduler_reads)[case])
    token_shape = bench.PRESETS[preset].token_shape
    if case == "memcpy":
        assert out.shape == (256, *token_shape)
    elif case == "ours":  # no request finished: its read waits for its finish
        assert out == [None] * 256
    else:
        assert [row.shape for row in out] == [(1, *token_shape)] * 256


@pytest.mark.parametrize("case", ["ours", "memcpy"])
def test_scheduler_reads_of_256_requests_finishing(benchmark, preset, scheduler_reads, case):
    cases = bench.scheduler_finish_cases(scheduler_reads)
    out = run(benchmark, f"scheduler finish 256 requests {preset}", cases[case])
    expected = cases["memcpy"]()  # the slot buffer's rows at each request's slots, in order
    assert len(out) == 256 and all(a.tobytes() == b.tobytes() for a, b in zip(out, expected))


def test_slotroute_bench_prints_a_table_per_preset_and_writes_the_plot(tmp_path, capsys):
    from slotroute.cli import main

    png = tmp_path / "scaling.png"
    assert main(["bench", "--rounds", "1", "--preset", "gpt-oss-120b", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "### gpt-oss-120b: 36 layers, top-4, 128 experts, uint8 (144 B/token)" in out
    assert out.count("| store_batch ") == 3 and "| get 32768 tok" in out and "| encode+decode" in out
    assert "| scheduler reads, 256 decoding requests" in out
    assert "|   memcpy + id check" in out and "|   gather of the same blocks" in out
    assert "|   store_batch 8192 tok, uint8 in, cache-hot" in out
    assert "demand paging" in out and "first writes (1 rounds, 8192-token steps into blocks no step wrote)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the probe reads with AVX2")
def test_read_ceiling_probe_builds_and_reports_each_block_size(tmp_path):
    """benchmarks/read_ceiling.c: the scattered-read ceiling docs/benchmarks.md cites."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None, "a C compiler is needed to build slotroute's extension anyway"
    exe = tmp_path / "read_ceiling"
    source = pathlib.Path(__file__).with_name("read_ceiling.c")
    subprocess.run([cc, "-O2", "-mavx2", "-o", str(exe), str(source)], check=True)
    out = subprocess.run([str(exe), "16", "2304", "6144"], check=True, capture_output=True, text=True).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines()[2:]]
    assert [int(r[0]) for r in rows] == [2304, 6144]
    for row in rows:
        assert all(float(cell) > 0 for cell in row[1:4]) and row[4].strip().endswith("x")


def test_first_writes_are_timed_into_a_lazy_and_a_populated_store_with_the_same_rows(monkeypatch):
    import numpy as np

    stores = []
    real = bench.RoutedExpertsManager

    def kept(*args):
        stores.append(real(*args))
        return stores[-1]

    monkeypatch.setattr(bench, "RoutedExpertsManager", kept)
    report = bench.first_write_report(bench.PRESETS["gpt-oss-120b"], rounds=2, num_slots=1 << 16, steps=2)
    assert report.startswith("first writes (2 rounds, 8192-token steps into blocks no step wrote): a lazy store ")
    assert "a populated one" in report and "populate() of 10 MiB" in report
    # two stores a round, populated first in the first round and second in the next, each with both steps
    assert len(stores) == 4
    assert all(s.stats().slots_written == 2 * 8192 for s in stores)
    np.testing.assert_array_equal(stores[0].routed_experts_by_slot[:16384], stores[3].routed_experts_by_slot[:16384])

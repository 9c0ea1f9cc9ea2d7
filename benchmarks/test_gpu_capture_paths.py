"""The data paths of ``benchmarks/gpu_capture_paths.py``, on CPU at a small shape: each
way of capturing a step leaves the rows the per-layer copy leaves (its CUDA graphs and
timings run on the device machine)."""

from __future__ import annotations

import importlib.util
import pathlib
from types import SimpleNamespace

import pytest
import torch

_spec = importlib.util.spec_from_file_location("gpu_capture_paths", pathlib.Path(__file__).with_name("gpu_capture_paths.py"))
paths = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paths)


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(paths, "LAYERS", 6)
    monkeypatch.setattr(paths, "HIDDEN", 64)
    monkeypatch.setattr(paths, "EXPERT_WIDTH", 96)
    gen = torch.Generator().manual_seed(0)
    bf16 = dict(dtype=torch.bfloat16, generator=gen)
    weights = {"gate": torch.randn(6, 64, paths.EXPERTS, **bf16) / 8, "up": torch.randn(6, 64, 96, **bf16) / 8,
               "down": torch.randn(6, 96, 64, **bf16) / 60}
    return weights, torch.randn(5, 64, **bf16)


@pytest.mark.parametrize("path", ["foreach", "cat", "stack"])
def test_a_step_captured_once_at_its_end_holds_the_per_layer_copys_rows(small, path):
    weights, x = small
    reference = paths.Step("per-layer", 5, weights, x)
    reference()
    rows = reference.rows()
    assert rows.shape == (5, 6, paths.TOP_K) and (rows >= 0).all() and (rows < paths.EXPERTS).all()
    step = paths.Step(path, 5, weights, x)
    step()
    assert torch.equal(step.rows(), rows) and step.held == []
    # a layer whose ids never arrived stays -1, so the comparison above could fail
    none = paths.Step("none", 5, weights, x)
    none()
    assert (none.rows() == -1).all()


def test_without_a_cuda_device_it_says_so_and_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the benchmark would run")
    assert paths.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_each_recording_is_checked_by_its_replay_alone_and_a_path_that_writes_other_rows_is_flagged(small, monkeypatch):
    """``record_paths`` resets each path's buffers after recording, so only the replay's
    writes are compared with the per-layer path's; a refused path is reported, not fatal."""
    weights, x = small

    def record(fn):  # a stand-in for the CUDA graph: its replay reruns the step
        fn()
        return SimpleNamespace(replay=fn)

    monkeypatch.setattr(paths.cuda_graph, "record", record)
    monkeypatch.setattr(paths.torch.cuda, "synchronize", lambda: None)
    errors, equal = {"forked": "RuntimeError: no side stream here"}, {p: True for p in paths.PATHS if p != "none"}
    graphs = paths.record_paths(5, weights, x, errors, equal)
    assert set(graphs) == set(paths.PATHS) - {"forked"} and equal == {p: True for p in equal}
    # replays that write nothing, after a recording's own run that did: the reset
    # buffers are what is compared, so those paths are flagged, and stay flagged
    monkeypatch.setattr(paths.cuda_graph, "record", lambda step: (step(), SimpleNamespace(
        replay=step if step.path in ("none", "per-layer") else (lambda: None)))[1])
    paths.record_paths(5, weights, x, errors, equal)
    assert [p for p, ok in equal.items() if not ok] == ["foreach", "cat", "stack"]
    paths.record_paths(5, weights, x, errors, equal)  # a later round's recordings
    assert [p for p, ok in equal.items() if not ok] == ["foreach", "cat", "stack"]

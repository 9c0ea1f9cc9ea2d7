"""The data paths of ``benchmarks/gpu_capture_paths.py``, on CPU at a small shape: each
way of capturing a step leaves the rows the per-layer copy leaves (its CUDA graphs and
timings run on the device machine)."""

from __future__ import annotations

import importlib.util
import pathlib

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

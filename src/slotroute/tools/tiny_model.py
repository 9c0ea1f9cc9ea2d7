"""A tiny random Qwen3-MoE checkpoint, written locally so the demo and tests need no download.

The checkpoint is a ``config.json`` plus one float32 ``model.safetensors`` holding every
weight vLLM's Qwen3-MoE loader (``vllm/model_executor/models/qwen3_moe.py``) expects.
Weights are drawn from a seeded numpy generator, so the same parameters always give the
same bytes. Router weights are scaled so that top-k choices differ across tokens and
layers and are rarely near ties: routing comparisons between runs are then meaningful.

Needs numpy and ``safetensors`` (imported only when a checkpoint is written).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

__all__ = ["default_model_dir", "tiny_moe_params", "write_tiny_moe"]

# Bumped whenever the weights written for the same parameters change, so cached
# checkpoints from an older layout are never reused.
FORMAT_VERSION = 1

# Router logits are W @ h with h of unit RMS (it leaves an RMSNorm with unit weight), so
# their spread is ROUTER_LOGIT_STD whatever the hidden size. A spread of 3 makes the
# top-k decisive (gaps between ranked logits well above float32 noise) while still
# varying from token to token and from layer to layer.
ROUTER_LOGIT_STD = 3.0

def tiny_moe_params(
    *,
    num_layers: int = 4,
    num_experts: int = 16,
    top_k: int = 4,
    hidden_size: int = 128,
    head_dim: int = 32,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 1024,
    moe_intermediate_size: int = 64,
    intermediate_size: int = 256,
    max_position_embeddings: int = 4096,
    dense_layers: tuple[int, ...] | list[int] = (),
    seed: int = 0,
) -> dict:
    """Validate and normalise the parameters of a tiny checkpoint.

    Returns
    -------
    dict
        The parameters as plain ints (``dense_layers`` a sorted tuple), suitable for
        ``write_tiny_moe(path, **params)`` and as a cache key.

    Raises
    ------
    ValueError
        If a size is not a positive int, ``top_k > num_experts``, a dense layer index is
        outside ``[0, num_layers)``, or every layer is dense (vLLM's Qwen3-MoE needs at
        least one MoE layer).
    """
    sizes = dict(
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden_size,
        head_dim=head_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        vocab_size=vocab_size,
        moe_intermediate_size=moe_intermediate_size,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k ({top_k}) must not exceed num_experts ({num_experts})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    dense = tuple(sorted({int(i) for i in dense_layers}))
    if any(not 0 <= i < num_layers for i in dense):
        raise ValueError(f"dense_layers must lie in [0, {num_layers}), got {list(dense_layers)}")
    if len(dense) == num_layers:
        raise ValueError(f"at least one layer must be MoE; dense_layers covers all {num_layers}")
    return {**{k: int(v) for k, v in sizes.items()}, "dense_layers": dense, "seed": int(seed)}


def hf_config(params: dict) -> dict:
    """The ``config.json`` contents for ``params`` (as returned by ``tiny_moe_params``)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": params["vocab_size"],
        "hidden_size": params["hidden_size"],
        "intermediate_size": params["intermediate_size"],
        "moe_intermediate_size": params["moe_intermediate_size"],
        "num_hidden_layers": params["num_layers"],
        "num_attention_heads": params["num_heads"],
        "num_key_value_heads": params["num_kv_heads"],
        "head_dim": params["head_dim"],
        "num_experts": params["num_experts"],
        "num_experts_per_tok": params["top_k"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(params["dense_layers"]),
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": params["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "slotroute_tiny_moe": {"format_version": FORMAT_VERSION, "seed": params["seed"]},
    }


def _weights(params: dict) -> Iterator[tuple[str, np.ndarray]]:
    # One generator, consumed in a fixed order: the same params give the same bytes.
    rng = np.random.default_rng(params["seed"])
    hidden, head_dim = params["hidden_size"], params["head_dim"]
    q_dim, kv_dim = params["num_heads"] * head_dim, params["num_kv_heads"] * head_dim

    def linear(out_features: int, in_features: int, std: float | None = None) -> np.ndarray:
        # 1/sqrt(fan_in) keeps activations of order one through the random network.
        scale = std if std is not None else in_features**-0.5
        return rng.normal(0.0, scale, (out_features, in_features)).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    yield "model.embed_tokens.weight", rng.normal(0.0, 1.0, (params["vocab_size"], hidden)).astype(np.float32)
    for i in range(params["num_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", ones(hidden)
        yield f"{p}.post_attention_layernorm.weight", ones(hidden)
        yield f"{p}.self_attn.q_proj.weight", linear(q_dim, hidden)
        yield f"{p}.self_attn.k_proj.weight", linear(kv_dim, hidden)
        yield f"{p}.self_attn.v_proj.weight", linear(kv_dim, hidden)
        yield f"{p}.self_attn.o_proj.weight", linear(hidden, q_dim)
        yield f"{p}.self_attn.q_norm.weight", ones(head_dim)
        yield f"{p}.self_attn.k_norm.weight", ones(head_dim)
        if i in params["dense_layers"]:
            inter = params["intermediate_size"]
            yield f"{p}.mlp.gate_proj.weight", linear(inter, hidden)
            yield f"{p}.mlp.up_proj.weight", linear(inter, hidden)
            yield f"{p}.mlp.down_proj.weight", linear(hidden, inter)
            continue
        inter = params["moe_intermediate_size"]
        yield f"{p}.mlp.gate.weight", linear(params["num_experts"], hidden, ROUTER_LOGIT_STD * hidden**-0.5)
        for e in range(params["num_experts"]):
            yield f"{p}.mlp.experts.{e}.gate_proj.weight", linear(inter, hidden)
            yield f"{p}.mlp.experts.{e}.up_proj.weight", linear(inter, hidden)
            yield f"{p}.mlp.experts.{e}.down_proj.weight", linear(hidden, inter)
    yield "model.norm.weight", ones(hidden)
    yield "lm_head.weight", linear(params["vocab_size"], hidden)


def write_tiny_moe(path: str | os.PathLike[str], **kwargs) -> Path:
    """Write a random Qwen3-MoE checkpoint (float32) into the directory ``path``.

    Keyword arguments are those of ``tiny_moe_params`` (``num_layers=4``,
    ``num_experts=16``, ``top_k=4``, ``hidden_size=128``, ``head_dim=32``,
    ``num_heads=4``, ``num_kv_heads=2``, ``vocab_size=1024``, ``dense_layers=()``,
    ``seed=0``, ...). Layers listed in ``dense_layers`` become ``mlp_only_layers``: a
    dense MLP of ``intermediate_size`` instead of experts. The directory is created if
    needed; existing ``config.json`` and ``model.safetensors`` are overwritten.

    Returns
    -------
    Path
        ``path``, holding ``config.json`` and ``model.safetensors``.

    Raises
    ------
    ValueError
        As ``tiny_moe_params``, before anything is written.
    """
    params = tiny_moe_params(**kwargs)
    from safetensors.numpy import save_file  # lazy: only writers need safetensors

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(_weights(params)), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(params), indent=2) + "\n")
    return out


def cache_root() -> Path:
    """``$SLOTROUTE_CACHE_DIR``, else ``$XDG_CACHE_HOME/slotroute``, else ``~/.cache/slotroute``."""
    if os.environ.get("SLOTROUTE_CACHE_DIR"):
        return Path(os.environ["SLOTROUTE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "slotroute"


def default_model_dir(**kwargs) -> Path:
    """The cached checkpoint for these parameters, written on first use.

    The directory name is keyed by the normalised parameters and ``FORMAT_VERSION``,
    so different parameters never share a checkpoint and repeated calls return the
    existing one without rewriting it. A checkpoint is written into a temporary
    sibling and renamed into place, so concurrent callers never see a partial one.

    Returns
    -------
    Path
        A directory holding ``config.json`` and ``model.safetensors``.

    Raises
    ------
    ValueError
        As ``tiny_moe_params``.
    """
    params = tiny_moe_params(**kwargs)
    key = json.dumps({**params, "dense_layers": list(params["dense_layers"]), "v": FORMAT_VERSION}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = cache_root()
    target = root / f"tiny-qwen3-moe-{digest}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        write_tiny_moe(staging, **params)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished first; its checkpoint is identical.
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target

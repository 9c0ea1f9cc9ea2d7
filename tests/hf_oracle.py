"""An oracle no one here wrote: Hugging Face transformers' own Qwen3-MoE, run over the
same tokens, and the experts its routers pick.

transformers' router (``Qwen3MoeTopKRouter`` in 5.x, a plain ``gate`` linear whose
top-k the sparse block takes in 4.x) is hooked; its top-k per token and MoE layer is
compared, as a set, with the row vLLM returned (the order within a row is the kernel's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RouterChoice:
    """transformers' routing of one token sequence."""

    experts: np.ndarray  # (tokens, num_layers, top_k), sorted within a row; dense layers 0
    margin: np.ndarray  # (tokens, num_layers): k-th minus (k+1)-th router probability; inf for dense


def router_topk(model_dir: str, token_ids: list[int], device: str = "cpu") -> RouterChoice:
    """Run ``token_ids`` through transformers' model in float32 and return the top-k
    of every MoE layer's router for every token, with how far each choice is from a tie."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).to(device).eval()
    top_k, num_layers = config.num_experts_per_tok, config.num_hidden_layers
    probs: dict[int, torch.Tensor] = {}
    chosen: dict[int, torch.Tensor] = {}

    def hook(layer: int):
        def record(module, args, output):
            if isinstance(output, tuple):  # transformers 5: (logits, scores, indices)
                logits, indices = output[0], output[2]
            else:  # transformers 4: the gate is a linear layer; the block takes the top-k
                logits = output
                indices = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), top_k, dim=-1).indices
            probs[layer] = torch.softmax(logits.reshape(-1, logits.shape[-1]).double(), dim=-1).cpu()
            chosen[layer] = indices.reshape(-1, top_k).cpu()

        return record

    handles = []
    for layer, block in enumerate(model.model.layers):
        gate = getattr(block.mlp, "gate", None)
        if gate is not None and hasattr(block.mlp, "experts"):
            handles.append(gate.register_forward_hook(hook(layer)))
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids], device=device))
    finally:
        for handle in handles:
            handle.remove()
    tokens = len(token_ids)
    experts = np.zeros((tokens, num_layers, top_k), dtype=np.int64)
    margin = np.full((tokens, num_layers), np.inf)
    for layer, indices in chosen.items():
        experts[:, layer] = np.sort(indices.numpy(), axis=1)
        ranked = torch.sort(probs[layer], dim=-1, descending=True).values.numpy()
        margin[:, layer] = ranked[:, top_k - 1] - ranked[:, top_k]
    return RouterChoice(experts=experts, margin=margin)


def disagreements(routed: np.ndarray, oracle: RouterChoice) -> np.ndarray:
    """``(token, layer)`` pairs where vLLM's row is not the oracle's set of experts."""
    if routed.shape != oracle.experts.shape:
        raise AssertionError(f"routed_experts has shape {routed.shape}, the oracle {oracle.experts.shape}")
    return np.argwhere((np.sort(routed.astype(np.int64), axis=2) != oracle.experts).any(axis=2))

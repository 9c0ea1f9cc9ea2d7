"""What routing looks like: the shape and storage dtype of one token's routed experts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ID_DTYPES", "MissingRoutingError", "RoutingSpec", "split_routed_experts"]

# The dtypes expert ids may arrive in, everywhere slotroute takes them (the wire format,
# store_batch, the store's C loops): the two storage dtypes and the two of top-k ids.
ID_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32), np.dtype(np.int64))

# Naming variants used by real Hugging Face MoE configs, most common first.
EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
TOP_K_KEYS = (
    "num_experts_per_tok",
    "top_k_experts",
    "num_experts_per_token",
    "moe_topk",
    "experts_per_token",
)
LAYER_KEYS = ("num_hidden_layers",)
# Multimodal checkpoints nest the language model's config under one of these.
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")


class MissingRoutingError(LookupError):
    """Routing was asked for slots that were never written since their block was
    last invalidated. slotroute never returns routing it did not store."""


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    """The shape of one token's routing: ``(num_layers, top_k)`` expert ids, each in
    ``[0, num_experts)``.

    ``num_layers`` counts MoE layers only, in the order the model runs them. The spec
    is validated on construction and immutable afterwards.

    Raises
    ------
    ValueError
        If a field is not a positive integer, ``top_k > num_experts``, or
        ``num_experts`` exceeds 65536 (no storage dtype holds its ids).
    """

    num_layers: int
    top_k: int
    num_experts: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "top_k", "num_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"RoutingSpec.{name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"RoutingSpec.{name} must be positive, got {value}")
            object.__setattr__(self, name, int(value))
        if self.top_k > self.num_experts:
            raise ValueError(
                f"RoutingSpec.top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})"
            )
        if self.num_experts > 65536:
            raise ValueError(
                f"RoutingSpec.num_experts must be <= 65536 to fit uint16 storage, got {self.num_experts}"
            )

    @property
    def storage_dtype(self) -> np.dtype:
        """The narrowest unsigned dtype that holds every expert id: uint8 up to 256
        experts, uint16 up to 65536."""
        return np.dtype(np.uint8) if self.num_experts <= 256 else np.dtype(np.uint16)

    @property
    def token_shape(self) -> tuple[int, int]:
        """``(num_layers, top_k)``: the shape of one token's routing."""
        return (self.num_layers, self.top_k)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's routing occupies in the storage dtype."""
        return self.num_layers * self.top_k * self.storage_dtype.itemsize

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any) -> RoutingSpec:
        """Build a spec from a Hugging Face config, given as a dict or a config object.

        Resolves the naming variants real checkpoints use (see ``EXPERT_KEYS``,
        ``TOP_K_KEYS``, ``LAYER_KEYS``), looking first at the top level and then in a
        nested text config (``text_config`` and its siblings).

        ``num_layers`` is ``num_hidden_layers``: every decoder layer. For models that
        interleave dense layers, pass the MoE layer count to the constructor instead.

        Raises
        ------
        ValueError
            If a field is missing under every key tried (the message names them all),
            or the values found do not form a valid spec.
        """
        scopes = [config]
        for key in TEXT_CONFIG_KEYS:
            nested = _lookup(config, key)
            if nested is not None:
                scopes.append(nested)

        def resolve(field: str, keys: tuple[str, ...]) -> int:
            for scope in scopes:
                for key in keys:
                    value = _lookup(scope, key)
                    if value is not None:
                        return value
            where = "the config" + "".join(
                f" or its {k!r}" for k in TEXT_CONFIG_KEYS if _lookup(config, k) is not None
            )
            raise ValueError(f"cannot find {field} in {where}: tried keys {', '.join(keys)}")

        return cls(
            num_layers=resolve("the number of layers", LAYER_KEYS),
            top_k=resolve("the experts per token (top-k)", TOP_K_KEYS),
            num_experts=resolve("the number of routed experts", EXPERT_KEYS),
        )


def _lookup(config: Mapping[str, Any] | Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def split_routed_experts(
    routed: np.ndarray, prompt_len: int, num_output_tokens: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Split one request's routing ``(seq_len, L, K)`` into its prompt and generated parts.

    Row ``i`` is the routing of the ``i``-th token the model forwarded. The generated
    part starts at ``prompt_len``; when ``num_output_tokens`` is given it is clipped to
    at most that many rows, since speculative or multi-token-prediction steps can
    capture rows for tokens that were never output.

    Returns
    -------
    (prompt, generated)
        Views of ``routed`` (no copy).

    Raises
    ------
    ValueError
        If ``routed`` is not 3-D, ``prompt_len`` is negative or exceeds ``seq_len``, or
        ``num_output_tokens`` is negative.
    """
    routed = np.asarray(routed)
    if routed.ndim != 3:
        raise ValueError(f"routed must have shape (seq_len, num_layers, top_k), got {routed.shape}")
    if not 0 <= prompt_len <= routed.shape[0]:
        raise ValueError(f"prompt_len must be in [0, {routed.shape[0]}] (seq_len), got {prompt_len}")
    generated = routed[prompt_len:]
    if num_output_tokens is not None:
        if num_output_tokens < 0:
            raise ValueError(f"num_output_tokens must be >= 0, got {num_output_tokens}")
        generated = generated[:num_output_tokens]
    return routed[:prompt_len], generated

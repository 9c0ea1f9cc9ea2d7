import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from slotroute.spec import (
    EXPERT_KEYS,
    LAYER_KEYS,
    TOP_K_KEYS,
    MissingRoutingError,
    RoutingSpec,
    split_routed_experts,
)


def test_spec_keeps_its_fields():
    spec = RoutingSpec(num_layers=48, top_k=8, num_experts=128)
    assert (spec.num_layers, spec.top_k, spec.num_experts) == (48, 8, 128)
    assert spec.token_shape == (48, 8)
    assert spec.bytes_per_token == 48 * 8


@pytest.mark.parametrize(
    ("num_experts", "dtype"),
    [(1, np.uint8), (128, np.uint8), (256, np.uint8), (257, np.uint16), (384, np.uint16), (65536, np.uint16)],
)
def test_storage_dtype_is_the_narrowest_that_holds_every_id(num_experts, dtype):
    spec = RoutingSpec(num_layers=1, top_k=1, num_experts=num_experts)
    assert spec.storage_dtype == np.dtype(dtype)
    assert np.iinfo(spec.storage_dtype).max >= num_experts - 1


def test_more_than_65536_experts_is_refused_with_the_limit_named():
    with pytest.raises(ValueError, match="65536"):
        RoutingSpec(num_layers=1, top_k=1, num_experts=65537)


@pytest.mark.parametrize("field", ["num_layers", "top_k", "num_experts"])
@pytest.mark.parametrize("value", [0, -3])
def test_non_positive_fields_are_refused(field, value):
    kwargs = dict(num_layers=4, top_k=2, num_experts=8) | {field: value}
    with pytest.raises(ValueError, match=field):
        RoutingSpec(**kwargs)


@pytest.mark.parametrize("value", [2.0, "4", True, None])
def test_non_integer_fields_are_refused(value):
    with pytest.raises(ValueError, match="num_layers must be an int"):
        RoutingSpec(num_layers=value, top_k=1, num_experts=8)


def test_numpy_integers_are_accepted_as_plain_ints():
    spec = RoutingSpec(num_layers=np.int64(4), top_k=np.int32(2), num_experts=np.uint16(8))
    assert type(spec.num_layers) is int and spec == RoutingSpec(4, 2, 8)


def test_top_k_above_num_experts_is_refused():
    with pytest.raises(ValueError, match=r"top_k \(9\) must not exceed num_experts \(8\)"):
        RoutingSpec(num_layers=4, top_k=9, num_experts=8)


def test_spec_is_immutable():
    spec = RoutingSpec(4, 2, 8)
    with pytest.raises(AttributeError):
        spec.top_k = 3


@pytest.mark.parametrize("experts_key", EXPERT_KEYS)
@pytest.mark.parametrize("top_k_key", TOP_K_KEYS)
def test_from_hf_config_resolves_every_naming_variant(experts_key, top_k_key):
    cfg = {"num_hidden_layers": 61, experts_key: 256, top_k_key: 8, "hidden_size": 7168}
    assert RoutingSpec.from_hf_config(cfg) == RoutingSpec(61, 8, 256)


def test_from_hf_config_reads_config_objects():
    cfg = SimpleNamespace(num_hidden_layers=36, num_local_experts=128, num_experts_per_tok=4)
    assert RoutingSpec.from_hf_config(cfg) == RoutingSpec(36, 4, 128)


def test_from_hf_config_looks_into_the_text_sub_config():
    cfg = {"model_type": "vl", "text_config": {"num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8}}
    assert RoutingSpec.from_hf_config(cfg) == RoutingSpec(48, 8, 128)
    obj = SimpleNamespace(text_config=SimpleNamespace(**cfg["text_config"]))
    assert RoutingSpec.from_hf_config(obj) == RoutingSpec(48, 8, 128)


def test_from_hf_config_prefers_top_level_keys_over_the_text_config():
    cfg = {"num_hidden_layers": 2, "num_experts": 4, "moe_topk": 1, "text_config": {"num_hidden_layers": 9}}
    assert RoutingSpec.from_hf_config(cfg).num_layers == 2


def test_from_hf_config_error_names_every_key_it_tried():
    with pytest.raises(ValueError) as excinfo:
        RoutingSpec.from_hf_config({"num_hidden_layers": 4, "num_experts_per_tok": 2})
    for key in EXPERT_KEYS:
        assert key in str(excinfo.value)
    with pytest.raises(ValueError) as excinfo:
        RoutingSpec.from_hf_config({"num_hidden_layers": 4, "num_experts": 8})
    for key in TOP_K_KEYS:
        assert key in str(excinfo.value)
    with pytest.raises(ValueError, match=LAYER_KEYS[0]):
        RoutingSpec.from_hf_config({"num_experts": 8, "moe_topk": 2})


def test_from_hf_config_validates_what_it_found():
    with pytest.raises(ValueError, match="must not exceed"):
        RoutingSpec.from_hf_config({"num_hidden_layers": 4, "num_experts": 4, "moe_topk": 8})


def test_missing_routing_error_is_a_lookup_error():
    assert issubclass(MissingRoutingError, LookupError)


def test_split_routed_experts_returns_views_of_prompt_and_generated_rows():
    routed = np.arange(10 * 2 * 3, dtype=np.uint8).reshape(10, 2, 3)
    prompt, generated = split_routed_experts(routed, prompt_len=6)
    np.testing.assert_array_equal(prompt, routed[:6])
    np.testing.assert_array_equal(generated, routed[6:])
    assert np.shares_memory(prompt, routed) and np.shares_memory(generated, routed)


def test_split_routed_experts_clips_generated_rows_to_the_tokens_output():
    routed = np.zeros((10, 2, 3), dtype=np.uint16)
    _, generated = split_routed_experts(routed, prompt_len=6, num_output_tokens=2)
    assert generated.shape == (2, 2, 3)
    _, generated = split_routed_experts(routed, prompt_len=6, num_output_tokens=50)
    assert generated.shape == (4, 2, 3)


@pytest.mark.parametrize(
    ("shape", "prompt_len", "num_output_tokens", "match"),
    [
        ((4, 2), 1, None, "shape"),
        ((4, 2, 3), 5, None, "prompt_len"),
        ((4, 2, 3), -1, None, "prompt_len"),
        ((4, 2, 3), 2, -1, "num_output_tokens"),
    ],
)
def test_split_routed_experts_rejects_bad_arguments(shape, prompt_len, num_output_tokens, match):
    with pytest.raises(ValueError, match=match):
        split_routed_experts(np.zeros(shape, np.uint8), prompt_len, num_output_tokens)


def test_importing_slotroute_imports_neither_torch_nor_vllm():
    code = "import sys, slotroute; print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"

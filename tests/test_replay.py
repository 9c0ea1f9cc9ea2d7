"""``slotroute.replay``: from a server's ``routed_experts`` to per-MoE-layer replay
indices, every bad input refused with an error that says what was expected and found."""

from __future__ import annotations

import base64
import io
import pickle
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import slotroute.replay
from slotroute.replay import (
    check_routed_experts,
    decode_routed_experts,
    moe_layer_indices,
    router_replay_indices,
    select_layers,
)
from slotroute.spec import MissingRoutingError
from slotroute.tools.tiny_model import hf_config, tiny_moe_params

ID_DTYPES = [np.uint8, np.uint16, np.int32, np.int64]


def npy_base64(array: np.ndarray, **save) -> str:
    """What vLLM's OpenAI server sends: base64 of ``np.save(array)``."""
    buffer = io.BytesIO()
    np.save(buffer, array, **save)
    return base64.b64encode(buffer.getvalue()).decode()


def raw_int32_base64(array: np.ndarray) -> str:
    """What SGLang sends: base64 of the ids as raw little-endian int32, no shape."""
    return base64.b64encode(np.asarray(array).astype("<i4").tobytes()).decode()


def routing(tokens: int = 5, layers: int = 4, top_k: int = 2, num_experts: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, num_experts, (tokens, layers, top_k)).astype(np.uint8)


# Set by unpickling a ``Tripwire``: nothing in slotroute.replay may ever do that.
UNPICKLED: list[str] = []


def _trip(note: str) -> None:
    UNPICKLED.append(note)


class Tripwire:
    def __reduce__(self):
        return (_trip, ("unpickled",))


@pytest.fixture
def tripwire():
    UNPICKLED.clear()
    yield
    assert UNPICKLED == [], "a pickle was executed"


# --- the module --------------------------------------------------------------------------


def test_module_exports_exactly_the_five_functions():
    assert sorted(slotroute.replay.__all__) == [
        "check_routed_experts",
        "decode_routed_experts",
        "moe_layer_indices",
        "router_replay_indices",
        "select_layers",
    ]


def test_importing_slotroute_replay_imports_neither_torch_nor_vllm():
    code = "import sys, slotroute, slotroute.replay; print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- decode_routed_experts: numpy arrays ---------------------------------------------------


@pytest.mark.parametrize("dtype", ID_DTYPES)
def test_decode_returns_an_integer_array_itself(dtype):
    routed = routing().astype(dtype)
    assert decode_routed_experts(routed) is routed


@pytest.mark.parametrize("shape", [(5,), (5, 4), (1, 5, 4, 2)])
def test_decode_refuses_an_array_that_is_not_3d(shape):
    with pytest.raises(ValueError, match=r"3-D .*got shape"):
        decode_routed_experts(np.zeros(shape, dtype=np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.bool_, object])
def test_decode_refuses_an_array_of_non_integer_dtype(dtype):
    with pytest.raises(ValueError, match="integer expert ids, got dtype"):
        decode_routed_experts(np.zeros((2, 3, 4), dtype=dtype))


def test_decode_checks_num_layers_and_top_k_against_an_array():
    routed = routing(layers=4, top_k=2)
    assert decode_routed_experts(routed, num_layers=4, top_k=2) is routed
    with pytest.raises(ValueError, match=r"expected num_layers = 3 on axis 1, found 4"):
        decode_routed_experts(routed, num_layers=3)
    with pytest.raises(ValueError, match=r"expected top_k = 4 on axis 2, found 2"):
        decode_routed_experts(routed, top_k=4)


# --- decode_routed_experts: base64 .npy (vLLM's OpenAI server) --------------------------------


@pytest.mark.parametrize("dtype", ID_DTYPES)
def test_decode_loads_base64_npy_given_as_str_or_bytes(dtype):
    routed = routing().astype(dtype)
    field = npy_base64(routed)
    for value in (field, field.encode()):
        got = decode_routed_experts(value)
        assert got.dtype == routed.dtype
        np.testing.assert_array_equal(got, routed)


def test_decode_of_npy_returns_a_writable_c_contiguous_native_array():
    routed = np.asfortranarray(routing().astype(">u2"))
    got = decode_routed_experts(npy_base64(routed))
    assert got.dtype == np.dtype(np.uint16) and got.dtype.isnative
    assert got.flags.c_contiguous and got.flags.writeable
    np.testing.assert_array_equal(got, routed)


def test_decode_checks_num_layers_and_top_k_against_an_npy():
    with pytest.raises(ValueError, match=r"expected num_layers = 3 on axis 1, found 4"):
        decode_routed_experts(npy_base64(routing(layers=4)), num_layers=3, top_k=2)


def test_decode_refuses_an_object_npy_without_unpickling_it(tripwire):
    field = npy_base64(np.array([[[Tripwire()]]], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"dtype object .*pickles are refused"):
        decode_routed_experts(field)


def test_decode_refuses_a_pickle_payload_without_unpickling_it(tripwire):
    field = base64.b64encode(pickle.dumps(Tripwire())).decode()
    with pytest.raises(ValueError, match="looks like a pickle"):
        decode_routed_experts(field)


def test_decode_refuses_a_pickled_array_without_unpickling_it(tripwire):
    field = base64.b64encode(pickle.dumps([routing(), Tripwire()])).decode()
    with pytest.raises(ValueError, match="pickles are refused"):
        decode_routed_experts(field)


def test_decode_refuses_an_npz_archive():
    buffer = io.BytesIO()
    np.savez(buffer, routed=routing())
    with pytest.raises(ValueError, match=r"\.npy file .*got \d+ bytes starting b'PK"):
        decode_routed_experts(base64.b64encode(buffer.getvalue()))


@pytest.mark.parametrize("dtype", [np.float32, np.bool_, "U3"])
def test_decode_refuses_an_npy_of_non_integer_dtype(dtype):
    with pytest.raises(ValueError, match="must be an integer .npy array, got dtype"):
        decode_routed_experts(npy_base64(np.zeros((2, 3, 4), dtype=dtype)))


def test_decode_refuses_an_npy_that_is_not_3d():
    with pytest.raises(ValueError, match=r"3-D .*shape \(6, 4\)"):
        decode_routed_experts(npy_base64(np.zeros((6, 4), dtype=np.uint8)))


def test_decode_refuses_a_truncated_npy_naming_the_sizes():
    raw = base64.b64decode(npy_base64(routing()))
    with pytest.raises(ValueError, match=r"\(40 bytes of data\), found 39 bytes after the header"):
        decode_routed_experts(base64.b64encode(raw[:-1]))


def test_decode_refuses_an_npy_with_trailing_bytes():
    raw = base64.b64decode(npy_base64(routing()))
    with pytest.raises(ValueError, match="found 41 bytes after the header"):
        decode_routed_experts(base64.b64encode(raw + b"\0"))


def test_decode_refuses_a_short_npy_whose_header_claims_a_huge_array_before_allocating_it():
    buffer = io.BytesIO()
    header = {"descr": "<u2", "fortran_order": False, "shape": (10**9, 10**6, 8)}
    np.lib.format.write_array_header_1_0(buffer, header)
    buffer.write(b"\0\0")
    with pytest.raises(ValueError, match=r"\(16000000000000000 bytes of data\), found 2 bytes after the header"):
        decode_routed_experts(base64.b64encode(buffer.getvalue()))


def test_decode_refuses_a_corrupt_npy_header():
    raw = base64.b64decode(npy_base64(routing()))
    with pytest.raises(ValueError, match="not a valid .npy payload"):
        decode_routed_experts(base64.b64encode(raw.replace(b"'descr'", b"'dxscr'")))


@pytest.mark.parametrize("value", ["not base64!", "abc", "äöü", b"\xff\xfe", "QUJD\n"])
def test_decode_refuses_what_is_not_base64(value):
    with pytest.raises(ValueError, match="must be valid base64, got"):
        decode_routed_experts(value)


@pytest.mark.parametrize("value", [None, 17, 1.5, [[[1, 2]]], {"routed_experts": ""}, bytearray(b"AAAA")])
def test_decode_refuses_anything_else_naming_its_type(value):
    with pytest.raises(ValueError, match=f"numpy array or base64 .*got {type(value).__name__}"):
        decode_routed_experts(value)


def test_decode_refuses_a_base64_payload_that_is_neither_npy_nor_shaped_raw_int32():
    with pytest.raises(ValueError, match="for raw int32 .*pass num_layers and top_k"):
        decode_routed_experts(raw_int32_base64(routing()))


# --- decode_routed_experts: base64 raw int32 (SGLang) --------------------------------------


def test_decode_reshapes_raw_int32_to_num_layers_and_top_k():
    routed = routing(tokens=5, layers=4, top_k=2)
    got = decode_routed_experts(raw_int32_base64(routed), num_layers=4, top_k=2)
    assert got.dtype == np.int32 and got.shape == (5, 4, 2) and got.flags.writeable
    np.testing.assert_array_equal(got, routed)


def test_decode_of_raw_int32_reads_little_endian():
    field = base64.b64encode(b"\x01\x00\x00\x00\x00\x01\x00\x00").decode()
    assert decode_routed_experts(field, num_layers=1, top_k=2).tolist() == [[[1, 256]]]


def test_decode_refuses_raw_int32_that_does_not_divide_into_rows_naming_the_sizes():
    field = raw_int32_base64(np.zeros(10, dtype=np.int32))
    with pytest.raises(ValueError, match=r"holds 10 ids, .*num_layers \* top_k = 4 \* 2 = 8"):
        decode_routed_experts(field, num_layers=4, top_k=2)


def test_decode_refuses_raw_bytes_that_are_not_whole_int32():
    field = base64.b64encode(b"\x01\x00\x00\x00\x02\x00").decode()
    with pytest.raises(ValueError, match="whole number of 4-byte ids, got 6 bytes"):
        decode_routed_experts(field, num_layers=1, top_k=1)


def test_decode_of_an_empty_raw_payload_is_zero_rows():
    assert decode_routed_experts("", num_layers=4, top_k=2).shape == (0, 4, 2)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_decode_refuses_a_num_layers_or_top_k_that_is_not_a_positive_int(bad):
    field = raw_int32_base64(routing())
    with pytest.raises(ValueError, match="num_layers must be"):
        decode_routed_experts(field, num_layers=bad, top_k=2)
    with pytest.raises(ValueError, match="top_k must be"):
        decode_routed_experts(field, num_layers=4, top_k=bad)


# --- decode_routed_experts: properties ------------------------------------------------------

routed_arrays = hnp.arrays(
    dtype=st.sampled_from(ID_DTYPES),
    shape=st.tuples(st.integers(0, 12), st.integers(1, 6), st.integers(1, 4)),
    elements=st.integers(0, 255),
)


@given(routed_arrays)
def test_decode_round_trips_every_npy_the_server_can_send(routed):
    got = decode_routed_experts(npy_base64(routed))
    assert got.dtype == routed.dtype
    np.testing.assert_array_equal(got, routed)


@given(routed_arrays)
def test_decode_round_trips_every_raw_int32_payload(routed):
    got = decode_routed_experts(raw_int32_base64(routed), num_layers=routed.shape[1], top_k=routed.shape[2])
    np.testing.assert_array_equal(got, routed)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    routed_arrays,
    st.data(),
    st.sampled_from([{}, {"num_layers": 2, "top_k": 2}]),
)
def test_decode_of_a_corrupted_npy_returns_a_3d_integer_array_or_raises_value_error(routed, data, shape):
    raw = bytearray(base64.b64decode(npy_base64(routed)))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        got = decode_routed_experts(base64.b64encode(bytes(raw[:cut])), **shape)
    except ValueError:
        return
    assert got.ndim == 3 and got.dtype.kind in "iu"


@given(st.binary(max_size=256), st.booleans())
def test_decode_of_arbitrary_bytes_returns_or_raises_value_error_only(payload, with_magic):
    raw = (b"\x93NUMPY" + payload) if with_magic else payload
    for shape in ({}, {"num_layers": 1, "top_k": 1}):
        try:
            got = decode_routed_experts(base64.b64encode(raw), **shape)
        except ValueError:
            continue
        assert got.ndim == 3 and got.dtype.kind in "iu"


# --- check_routed_experts ----------------------------------------------------------------------


def test_check_accepts_one_row_per_forwarded_token():
    # 6 prompt tokens, 3 generated: the last generated token was never forwarded.
    check_routed_experts(routing(tokens=8), prompt_len=6, num_output_tokens=3, num_experts=8)


def test_check_counts_rows_from_prompt_start():
    check_routed_experts(routing(tokens=5), prompt_len=6, num_output_tokens=3, prompt_start=3)


def test_check_accepts_prompt_start_at_the_prompt_length():
    check_routed_experts(routing(tokens=2), prompt_len=6, num_output_tokens=3, prompt_start=6)


def test_check_raises_missing_routing_error_for_a_missing_row():
    with pytest.raises(MissingRoutingError, match=r"has 7 rows, expected .* = 6 \+ 3 - 1 - 0 = 8 \(1 missing\)"):
        check_routed_experts(routing(tokens=7), prompt_len=6, num_output_tokens=3)


def test_check_raises_missing_routing_error_for_a_row_too_many():
    with pytest.raises(MissingRoutingError, match=r"has 9 rows, .* = 8 \(1 more than forwarded\)"):
        check_routed_experts(routing(tokens=9), prompt_len=6, num_output_tokens=3)


def test_check_raises_value_error_for_an_id_at_num_experts_naming_where():
    routed = routing(tokens=8, num_experts=8)
    routed[4, 2, 1] = 8
    with pytest.raises(ValueError, match=r"\[0, 8\), found 8 at row 4, layer 2, slot 1 \(1 bad ids in all\)"):
        check_routed_experts(routed, prompt_len=6, num_output_tokens=3, num_experts=8)


def test_check_raises_value_error_for_a_negative_id_without_num_experts():
    routed = routing(tokens=8).astype(np.int32)
    routed[0, 0, 0] = -1
    with pytest.raises(ValueError, match="must be >= 0, found -1 at row 0, layer 0, slot 0"):
        check_routed_experts(routed, prompt_len=6, num_output_tokens=3)


def test_check_counts_rows_before_ids():
    routed = routing(tokens=7).astype(np.int32)
    routed[0, 0, 0] = -1
    with pytest.raises(MissingRoutingError):
        check_routed_experts(routed, prompt_len=6, num_output_tokens=3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt_len": 0, "num_output_tokens": 3}, "prompt_len must be >= 1, got 0"),
        ({"prompt_len": 6, "num_output_tokens": 0}, "num_output_tokens must be >= 1, got 0"),
        ({"prompt_len": 6, "num_output_tokens": 3, "prompt_start": -1}, "prompt_start must be >= 0"),
        ({"prompt_len": 6, "num_output_tokens": 3, "prompt_start": 7}, r"prompt_start must be in \[0, 6\]"),
        ({"prompt_len": 6.0, "num_output_tokens": 3}, "prompt_len must be an int"),
        ({"prompt_len": True, "num_output_tokens": 3}, "prompt_len must be an int"),
        ({"prompt_len": 6, "num_output_tokens": 3, "num_experts": 0}, "num_experts must be >= 1"),
    ],
)
def test_check_refuses_counts_out_of_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_routed_experts(routing(tokens=8), **kwargs)


@pytest.mark.parametrize("routed", [[[[0, 1]]], np.zeros((8, 4)), np.zeros((8, 4, 2), dtype=np.float64)])
def test_check_refuses_what_is_not_a_3d_integer_array(routed):
    with pytest.raises(ValueError, match="routed must"):
        check_routed_experts(routed, prompt_len=6, num_output_tokens=3)


@given(
    prompt_len=st.integers(1, 40),
    num_output_tokens=st.integers(1, 20),
    data=st.data(),
)
def test_check_passes_exactly_the_forwarded_row_count(prompt_len, num_output_tokens, data):
    prompt_start = data.draw(st.integers(0, prompt_len))
    rows = data.draw(st.integers(0, prompt_len + num_output_tokens + 2))
    routed = np.zeros((rows, 2, 2), dtype=np.uint8)
    expected = prompt_len + num_output_tokens - 1 - prompt_start
    kwargs = dict(prompt_len=prompt_len, num_output_tokens=num_output_tokens, prompt_start=prompt_start)
    if rows == expected:
        check_routed_experts(routed, **kwargs)
    else:
        with pytest.raises(MissingRoutingError):
            check_routed_experts(routed, **kwargs)


# --- moe_layer_indices ---------------------------------------------------------------------------


def test_moe_layers_of_the_tiny_qwen3_moe_skip_its_mlp_only_layer():
    config = hf_config(tiny_moe_params(num_layers=4, dense_layers=(1,)))
    assert moe_layer_indices(config) == [0, 2, 3]


@pytest.mark.parametrize(
    "config, layers",
    [
        ({"num_hidden_layers": 6, "num_experts": 8, "decoder_sparse_step": 2}, [1, 3, 5]),
        ({"num_hidden_layers": 6, "num_experts": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]}, [1, 5]),
        ({"num_hidden_layers": 4, "num_experts": 8, "mlp_only_layers": []}, [0, 1, 2, 3]),
        ({"num_hidden_layers": 4, "num_experts": 0, "mlp_only_layers": []}, []),
    ],
)
def test_moe_layers_follow_qwen_moe_mlp_only_layers_and_decoder_sparse_step(config, layers):
    assert moe_layer_indices(config) == layers


@pytest.mark.parametrize(
    "config, layers",
    [
        ({"num_hidden_layers": 6, "n_routed_experts": 8, "first_k_dense_replace": 3}, [3, 4, 5]),
        ({"num_hidden_layers": 6, "n_routed_experts": 8, "first_k_dense_replace": 1, "moe_layer_freq": 2}, [2, 4]),
        ({"num_hidden_layers": 4, "n_routed_experts": 8}, [0, 1, 2, 3]),
        ({"num_hidden_layers": 4, "n_routed_experts": None, "first_k_dense_replace": 1}, []),
    ],
)
def test_moe_layers_follow_deepseek_first_k_dense_replace_and_moe_layer_freq(config, layers):
    assert moe_layer_indices(config) == layers


def test_moe_layers_are_every_layer_for_a_config_without_dense_layer_keys():
    assert moe_layer_indices({"num_hidden_layers": 3, "num_local_experts": 8}) == [0, 1, 2]


def test_moe_layers_are_read_from_a_nested_text_config():
    config = {
        "vision_config": {"num_hidden_layers": 27},
        "text_config": {"num_hidden_layers": 4, "num_experts": 8, "mlp_only_layers": [0]},
    }
    assert moe_layer_indices(config) == [1, 2, 3]


def test_moe_layers_are_read_from_a_config_object():
    config = SimpleNamespace(num_hidden_layers=4, num_experts=8, mlp_only_layers=[2], decoder_sparse_step=1)
    assert moe_layer_indices(config) == [0, 1, 3]


QWEN = {"num_hidden_layers": 4, "num_experts": 8}
DEEPSEEK = {"num_hidden_layers": 4, "n_routed_experts": 8}


@pytest.mark.parametrize(
    "config, message",
    [
        ({"num_experts": 8}, "cannot find the number of layers .*num_hidden_layers"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be >= 1"),
        ({"num_hidden_layers": 4, "mlp_only_layers": [1]}, "cannot find the number of routed experts .*num_experts"),
        ({**QWEN, "mlp_only_layers": 1}, "mlp_only_layers must be a list .*got int"),
        ({**QWEN, "mlp_only_layers": ["1"]}, "an mlp_only_layers entry must be an int"),
        ({**QWEN, "decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1, got 0"),
        ({**DEEPSEEK, "moe_layer_freq": 0}, "moe_layer_freq must be >= 1, got 0"),
        ({**DEEPSEEK, "first_k_dense_replace": -1}, "first_k_dense_replace must be >= 0"),
        (
            {**QWEN, "mlp_only_layers": [], "first_k_dense_replace": 1},
            r"one convention .*found keys \['first_k_dense_replace', 'mlp_only_layers'\]",
        ),
    ],
)
def test_moe_layers_refuse_a_config_they_cannot_read(config, message):
    with pytest.raises(ValueError, match=message):
        moe_layer_indices(config)


@given(num_layers=st.integers(1, 48), step=st.integers(1, 4), data=st.data())
def test_moe_layers_of_a_qwen_config_are_the_sparse_steps_minus_mlp_only_layers(num_layers, step, data):
    dense = data.draw(st.lists(st.integers(0, num_layers - 1), unique=True))
    config = {"num_hidden_layers": num_layers, "num_experts": 8, "mlp_only_layers": dense, "decoder_sparse_step": step}
    assert moe_layer_indices(config) == sorted(set(range(step - 1, num_layers, step)) - set(dense))


def _transformers_moe_layers(config) -> list[int]:
    """The decoder layers transformers builds with experts, built on the meta device."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def _small(**kwargs) -> dict:
    sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
    return {**sizes, **kwargs}


@pytest.mark.parametrize(
    "model_type, kwargs",
    [
        ("qwen3_moe", dict(num_hidden_layers=5, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1, 4])),
        (
            "qwen2_moe",
            dict(num_hidden_layers=6, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3]),
        ),
        (
            "deepseek_v3",
            dict(num_hidden_layers=5, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2, n_group=1,
                 topk_group=1),
        ),
        ("mixtral", dict(num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2)),
    ],
)
def test_moe_layers_are_the_layers_transformers_builds_with_experts(model_type, kwargs):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type, **_small(**kwargs))
    expected = _transformers_moe_layers(config)
    assert moe_layer_indices(config) == expected
    assert moe_layer_indices(config.to_dict()) == expected


# --- select_layers -----------------------------------------------------------------------------


def test_select_layers_returns_the_layers_in_the_order_given():
    routed = routing(layers=6)
    for layers in ([0, 2, 3], [3, 0], [5, 4, 3, 2, 1, 0], [1]):
        np.testing.assert_array_equal(select_layers(routed, layers), routed[:, layers, :])


@pytest.mark.parametrize("layers", [[0, 2, 4], [5, 3, 1], [1, 2, 3], [4], list(range(6))])
def test_select_layers_of_evenly_spaced_layers_is_a_view(layers):
    routed = routing(layers=6)
    assert np.shares_memory(select_layers(routed, layers), routed)


def test_select_layers_of_an_irregular_selection_is_a_copy():
    routed = routing(layers=4)
    selected = select_layers(routed, [0, 2, 3])
    assert not np.shares_memory(selected, routed)


def test_select_layers_of_no_layers_is_an_empty_layer_axis():
    assert select_layers(routing(tokens=5, layers=4, top_k=2), []).shape == (5, 0, 2)


def test_select_layers_accepts_a_numpy_array_of_layers():
    routed = routing(layers=4)
    np.testing.assert_array_equal(select_layers(routed, np.array([0, 2, 3])), routed[:, [0, 2, 3], :])


@pytest.mark.parametrize("layers", [[4], [0, 7], [-1]])
def test_select_layers_raises_index_error_for_a_layer_outside_the_array(layers):
    with pytest.raises(IndexError, match=r"layers must be in \[0, 4\) \(routed has 4 layers\), got \[-?\d\]"):
        select_layers(routing(layers=4), layers)


def test_select_layers_refuses_a_layer_named_twice():
    with pytest.raises(ValueError, match=r"distinct, got \[2\] more than once in \[0, 2, 2\]"):
        select_layers(routing(layers=4), [0, 2, 2])


@pytest.mark.parametrize("layers", [[1.0], ["0"], [True], [None]])
def test_select_layers_refuses_a_layer_that_is_not_an_int(layers):
    with pytest.raises(ValueError, match="layers must be ints"):
        select_layers(routing(layers=4), layers)


@pytest.mark.parametrize("layers", [2, {0, 2}, "02", None])
def test_select_layers_refuses_layers_that_are_not_a_sequence(layers):
    with pytest.raises(ValueError, match="layers must be a sequence of ints, got"):
        select_layers(routing(layers=4), layers)


def test_select_layers_refuses_what_is_not_a_3d_integer_array():
    with pytest.raises(ValueError, match="routed must be 3-D"):
        select_layers(np.zeros((4, 2), dtype=np.uint8), [0])


@given(num_layers=st.integers(1, 10), data=st.data())
def test_select_layers_equals_fancy_indexing_and_views_exactly_the_slices(num_layers, data):
    routed = routing(tokens=3, layers=num_layers)
    layers = data.draw(st.lists(st.integers(0, num_layers - 1), unique=True))
    selected = select_layers(routed, layers)
    np.testing.assert_array_equal(selected, routed[:, layers, :])
    evenly_spaced = len(set(np.diff(layers).tolist())) <= 1
    assert np.shares_memory(selected, routed) == (evenly_spaced and len(layers) > 0)


# --- router_replay_indices -------------------------------------------------------------------------


def test_router_replay_indices_are_one_c_contiguous_int64_tk_array_per_layer():
    routed = routing(tokens=5, layers=3, top_k=2)
    indices = router_replay_indices(routed)
    assert len(indices) == 3
    for layer, replay in enumerate(indices):
        assert replay.shape == (5, 2) and replay.dtype == np.int64 and replay.flags.c_contiguous
        np.testing.assert_array_equal(replay, routed[:, layer, :])


def test_router_replay_indices_share_no_memory_with_the_routing():
    routed = routing()
    assert not any(np.shares_memory(replay, routed) for replay in router_replay_indices(routed, dtype=np.uint8))


def test_router_replay_indices_take_the_dtype_asked_for():
    assert {r.dtype for r in router_replay_indices(routing(), dtype=np.int32)} == {np.dtype(np.int32)}


def test_router_replay_indices_of_no_tokens_are_empty_rows():
    assert [r.shape for r in router_replay_indices(routing(tokens=0, layers=2, top_k=3))] == [(0, 3), (0, 3)]


def test_router_replay_indices_refuse_a_non_integer_dtype():
    with pytest.raises(ValueError, match="dtype must be an integer dtype, got float32"):
        router_replay_indices(routing(), dtype=np.float32)
    with pytest.raises(ValueError, match="dtype must be an integer dtype"):
        router_replay_indices(routing(), dtype="not a dtype")


def test_router_replay_indices_refuse_ids_that_do_not_fit_the_dtype():
    routed = routing().astype(np.uint16)
    routed[0, 0, 0] = 300
    with pytest.raises(ValueError, match=r"fit in int8 \[-128, 127\], found ids in \[0, 300\]"):
        router_replay_indices(routed, dtype=np.int8)


def test_router_replay_indices_refuse_what_is_not_a_3d_integer_array():
    with pytest.raises(ValueError, match="routed must be a numpy array"):
        router_replay_indices([[[0]]])


@given(routed_arrays, st.sampled_from([np.int64, np.int32, np.uint16]))
def test_router_replay_indices_stacked_are_the_routing(routed, dtype):
    indices = router_replay_indices(routed, dtype=dtype)
    assert len(indices) == routed.shape[1]
    assert all(r.flags.c_contiguous and r.shape == (routed.shape[0], routed.shape[2]) for r in indices)
    np.testing.assert_array_equal(np.stack(indices, axis=1), routed)

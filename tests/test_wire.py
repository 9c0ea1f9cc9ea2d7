"""RoutedExpertsLists: one step on the wire, zero-copy on arrival, ValueError on anything corrupt."""

from __future__ import annotations

import pickle

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from slotroute.wire import RoutedExpertsLists

ROUTING_DTYPES = (np.uint8, np.uint16, np.int32, np.int64)
SLOT_DTYPES = (np.int32, np.int64)


def step(n: int = 3, layers: int = 2, top_k: int = 4, dtype=np.uint8, slot_dtype=np.int64, seed: int = 0):
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    data = rng.integers(info.min, info.max, (n, layers, top_k), dtype=dtype, endpoint=True)
    slots = rng.integers(-1, 1 << 20, n).astype(slot_dtype)
    return RoutedExpertsLists(routing_data=data, slot_mapping=slots)


def assert_same(a: RoutedExpertsLists, b: RoutedExpertsLists) -> None:
    assert a.routing_data.dtype == b.routing_data.dtype
    assert a.slot_mapping.dtype == b.slot_mapping.dtype
    np.testing.assert_array_equal(a.routing_data, b.routing_data)
    np.testing.assert_array_equal(a.slot_mapping, b.slot_mapping)
    assert a.routing_data.shape == b.routing_data.shape


def header(**overrides) -> list:
    """A well-formed payload as a msgpack array, with fields replaced."""
    fields = {
        "format": "slotroute.step/1",
        "routing_dtype": "|u1",
        "routing_shape": [2, 3, 4],
        "routing": bytes(24),
        "slot_dtype": "<i8",
        "slots": bytes(16),
    }
    fields.update(overrides)
    return list(fields.values())


# -- round trip -----------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 5000], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("dtype", ROUTING_DTYPES, ids=lambda d: d.__name__)
def test_round_trip_preserves_arrays_for_every_dtype_and_size(dtype, slot_dtype, n):
    original = step(n, dtype=dtype, slot_dtype=slot_dtype)
    decoded = RoutedExpertsLists.decode(original.encode())
    assert_same(decoded, original)
    assert decoded.num_tokens == n


def test_round_trip_of_a_deepseek_sized_step():
    original = step(8192, layers=61, top_k=8)
    assert_same(RoutedExpertsLists.decode(original.encode()), original)


@settings(max_examples=60, deadline=None)
@given(
    data=hnp.arrays(
        st.sampled_from(ROUTING_DTYPES),
        st.tuples(st.integers(0, 20), st.integers(1, 4), st.integers(1, 4)),
    ),
    slot_dtype=st.sampled_from(SLOT_DTYPES),
    order=st.sampled_from(["C", "F", "strided"]),
)
def test_round_trip_holds_for_any_array_layout(data, slot_dtype, order):
    if order == "F":
        data = np.asfortranarray(data)
    elif order == "strided":
        data = np.repeat(data, 2, axis=2)[:, :, ::2]
    slots = np.arange(data.shape[0], dtype=slot_dtype) - 1
    original = RoutedExpertsLists(data, slots)
    assert_same(RoutedExpertsLists.decode(original.encode()), original)


def test_pickle_round_trip():
    original = step(7, dtype=np.uint16)
    for protocol in (pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL):
        assert_same(pickle.loads(pickle.dumps(original, protocol=protocol)), original)


def test_pickle_round_trip_of_a_decoded_step():
    decoded = RoutedExpertsLists.decode(step(4).encode())
    assert_same(pickle.loads(pickle.dumps(decoded)), decoded)


# -- views and copies -----------------------------------------------------------------


def test_decode_returns_views_of_the_buffer():
    payload = step(64, dtype=np.int32).encode()
    decoded = RoutedExpertsLists.decode(payload)
    raw = np.frombuffer(payload, dtype=np.uint8)
    assert np.shares_memory(decoded.routing_data, raw)
    assert np.shares_memory(decoded.slot_mapping, raw)


def test_decoded_arrays_of_bytes_are_read_only():
    decoded = RoutedExpertsLists.decode(step().encode())
    assert not decoded.routing_data.flags.writeable
    with pytest.raises(ValueError):
        decoded.routing_data[0, 0, 0] = 1


def test_decoded_arrays_see_writes_to_a_mutable_buffer():
    buf = bytearray(step(2).encode())
    decoded = RoutedExpertsLists.decode(buf)
    offset = bytes(buf).index(decoded.routing_data.tobytes())
    buf[offset] = (buf[offset] + 1) % 256
    assert decoded.routing_data.flat[0] == buf[offset]


def test_decode_accepts_a_memoryview():
    original = step(3)
    assert_same(RoutedExpertsLists.decode(memoryview(original.encode())), original)


def test_encode_returns_a_copy():
    original = step(3)
    payload = original.encode()
    original.routing_data[:] = 0
    assert RoutedExpertsLists.decode(payload).routing_data.any()


def test_constructor_keeps_the_arrays_it_was_given():
    data, slots = np.zeros((1, 1, 1), np.uint8), np.zeros(1, np.int64)
    lists = RoutedExpertsLists(data, slots)
    assert lists.routing_data is data and lists.slot_mapping is slots


def test_equality_is_identity_not_element_wise():
    a = step()
    b = RoutedExpertsLists(a.routing_data, a.slot_mapping)
    assert a == a and a != b
    assert len({a, b}) == 2


def test_fields_cannot_be_reassigned():
    lists = step()
    with pytest.raises(AttributeError):
        lists.routing_data = np.zeros((3, 2, 4), np.float64)


# -- construction with bad arrays -----------------------------------------------------


@pytest.mark.parametrize(
    "data, slots, match",
    [
        ([[[1]]], np.zeros(1, np.int64), "routing_data must be a numpy array, got list"),
        (np.zeros((1, 1, 1), np.uint8), [0], "slot_mapping must be a numpy array, got list"),
        (np.zeros((1, 1, 1), np.float32), np.zeros(1, np.int64), "routing_data dtype must be one of"),
        (np.zeros((1, 1, 1), np.int8), np.zeros(1, np.int64), "routing_data dtype must be one of"),
        (np.zeros((1, 1, 1), np.uint32), np.zeros(1, np.int64), "routing_data dtype must be one of"),
        (np.zeros((1, 1, 1), ">i4"), np.zeros(1, np.int64), r"native byte order\), got >i4"),
        (np.zeros((1, 1, 1), np.uint8), np.zeros(1, np.uint8), "slot_mapping dtype must be int32 or int64"),
        (np.zeros((1, 1, 1), np.uint8), np.zeros(1, np.float64), "slot_mapping dtype must be int32 or int64"),
        (np.zeros((1, 4), np.uint8), np.zeros(1, np.int64), r"routing_data must have shape \(N, num_layers, top_k\)"),
        (np.zeros((1, 0, 4), np.uint8), np.zeros(1, np.int64), r"num_layers, top_k >= 1, got \(1, 0, 4\)"),
        (np.zeros((1, 4, 0), np.uint8), np.zeros(1, np.int64), r"got \(1, 4, 0\)"),
        (np.zeros((2, 1, 1), np.uint8), np.zeros(3, np.int64), r"slot_mapping must have shape \(2,\) .* got \(3,\)"),
        (np.zeros((2, 1, 1), np.uint8), np.zeros((2, 1), np.int64), r"got \(2, 1\)"),
    ],
)
def test_constructor_rejects_bad_arrays(data, slots, match):
    with pytest.raises(ValueError, match=match):
        RoutedExpertsLists(data, slots)


# -- corrupt and hostile payloads -----------------------------------------------------


def test_every_truncation_raises_value_error():
    payload = step(3, dtype=np.uint16).encode()
    for length in range(len(payload)):
        with pytest.raises(ValueError, match="corrupt RoutedExpertsLists payload"):
            RoutedExpertsLists.decode(payload[:length])


def test_trailing_bytes_raise_value_error():
    with pytest.raises(ValueError, match="trailing"):
        RoutedExpertsLists.decode(step().encode() + b"\x00")


def _decodes_consistently(payload: bytes) -> None:
    """A payload either raises ValueError or decodes to arrays that honour the
    class invariant and lie inside the payload."""
    try:
        decoded = RoutedExpertsLists.decode(payload)
    except ValueError:
        return
    data, slots = decoded.routing_data, decoded.slot_mapping
    assert data.ndim == 3 and data.shape[1] >= 1 and data.shape[2] >= 1
    assert slots.shape == (data.shape[0],)
    assert data.nbytes + slots.nbytes <= len(payload)
    data.sum(), slots.sum()  # every element readable


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_bit_flips_raise_value_error_or_decode_consistently(data):
    payload = bytearray(step(4, dtype=data.draw(st.sampled_from(ROUTING_DTYPES))).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        bit = data.draw(st.integers(0, len(payload) * 8 - 1))
        payload[bit // 8] ^= 1 << (bit % 8)
    _decodes_consistently(bytes(payload))


@pytest.mark.parametrize("dtype", ROUTING_DTYPES)
def test_every_byte_overwritten_raises_the_corrupt_payload_error_or_decodes_consistently(dtype):
    """Each byte of a small step (header, arrays and trailer) set to values that are
    invalid msgpack markers or invalid UTF-8 in a string field."""
    payload = step(3, dtype=dtype).encode()
    for position in range(len(payload)):
        for value in (0x00, 0x7F, 0x80, 0xC1, 0xC3, 0xFF):
            corrupt = bytearray(payload)
            corrupt[position] = value
            try:
                _decodes_consistently(bytes(corrupt))
            except ValueError as error:
                raise AssertionError(f"byte {position} = {value:#x}") from error
            try:
                RoutedExpertsLists.decode(bytes(corrupt))
            except ValueError as error:
                assert str(error).startswith("corrupt RoutedExpertsLists payload"), (position, value, str(error))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_value_error_or_decode_consistently(payload):
    _decodes_consistently(payload)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"routing_shape": [2**62, 1, 1]}, "routing_shape"),
        ({"routing_shape": [-1, 3, 4]}, "routing_shape"),
        ({"routing_shape": [2**40, 2**20, 2**20]}, f"needs {2**80} bytes, found 24"),
        ({"routing_shape": [0, 2**20, 2**20], "slots": b""}, "needs 0 bytes, found 24"),
        ({"routing_shape": [2, 0, 4]}, "routing_shape"),
        ({"routing_shape": [2, 3]}, "routing_shape"),
        ({"routing_shape": [2, 3, 4, 1]}, "routing_shape"),
        ({"routing_shape": [2.0, 3, 4]}, "routing_shape"),
        ({"routing_shape": [3, 3, 4]}, r"needs 36 bytes, found 24"),
        ({"routing": bytes(23)}, "needs 24 bytes, found 23"),
        ({"slots": bytes(15)}, "2 slots of int64 need 16 bytes, found 15"),
        ({"slot_dtype": "<i4"}, "2 slots of int32 need 8 bytes, found 16"),
        ({"routing_dtype": "<f8"}, "routing_dtype"),
        ({"routing_dtype": "|O"}, "routing_dtype"),
        ({"routing_dtype": ">i4"}, "routing_dtype"),
        ({"slot_dtype": "<u8"}, "slot_dtype"),
        ({"format": "slotroute.step/2"}, "format"),
        ({"routing": "not bytes"}, "routing"),
        ({"slots": [0, 1]}, "slots"),
    ],
)
def test_hostile_headers_raise_value_error(fields, match):
    payload = msgspec.msgpack.encode(header(**fields))
    with pytest.raises(ValueError, match=match):
        RoutedExpertsLists.decode(payload)


def test_wrong_field_count_raises_value_error():
    for fields in (header()[:-1], header() + [b""]):
        with pytest.raises(ValueError, match="corrupt"):
            RoutedExpertsLists.decode(msgspec.msgpack.encode(fields))


def test_other_msgpack_documents_raise_value_error():
    for doc in ({"routing_data": b""}, None, 5, "text", []):
        with pytest.raises(ValueError, match="corrupt"):
            RoutedExpertsLists.decode(msgspec.msgpack.encode(doc))


def test_decode_of_a_non_buffer_raises_type_error():
    with pytest.raises(TypeError):
        RoutedExpertsLists.decode("not bytes")

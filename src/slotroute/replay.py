"""Routing into trainers: from a server's ``routed_experts`` to per-layer replay indices.

A trainer that replays the rollout's routing (rollout routing replay) needs, for one
sequence, one ``[T, K]`` index array per MoE layer, in the order the model runs its
MoE layers, with a row for every token it forwards. The functions here get there from
a server's response in four checked steps::

    routed = decode_routed_experts(field)                  # (T, L, K), any server format
    check_routed_experts(routed, prompt_len=..., num_output_tokens=...)
    moe = select_layers(routed, moe_layer_indices(config))  # drop dense layers' rows
    indices = router_replay_indices(moe)                    # [(T, K)] * num_moe_layers

Each step fails loudly where trainers' own readers fail silently: a missing row is a
:class:`~slotroute.spec.MissingRoutingError`, never a row of zeros (expert 0); a payload
that would need unpickling is refused, never executed; a raw buffer whose length does
not divide into rows names both sizes.

numpy and the standard library only: no torch, no vLLM.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from slotroute.spec import EXPERT_KEYS, LAYER_KEYS, TEXT_CONFIG_KEYS, MissingRoutingError, _lookup

__all__ = [
    "check_routed_experts",
    "decode_routed_experts",
    "moe_layer_indices",
    "router_replay_indices",
    "select_layers",
]

_NPY_MAGIC = b"\x93NUMPY"
# Every pickle protocol from 2 on starts with the PROTO opcode.
_PICKLE_PROTO = b"\x80"


# --- decoding ------------------------------------------------------------------------


def decode_routed_experts(
    value: np.ndarray | str | bytes, *, num_layers: int | None = None, top_k: int | None = None
) -> np.ndarray:
    """Decode one request's ``routed_experts`` into an integer array ``(T, L, K)``.

    Accepts the three forms servers return:

    - a numpy array (vLLM offline, ``RequestOutput.outputs[i].routed_experts``):
      returned as is, the same object, once it is checked to be a 3-D integer array;
    - ``str`` or ``bytes``, base64 of an ``.npy`` file (vLLM's OpenAI server,
      ``choices[i].routed_experts``): its dtype and shape travel with it;
    - ``str`` or ``bytes``, base64 of raw little-endian int32 (SGLang,
      ``meta_info["routed_experts"]``), when ``num_layers`` and ``top_k`` are both
      given: reshaped to ``(n, num_layers, top_k)``.

    A base64 payload that starts with the ``.npy`` magic is read as ``.npy``; any other
    payload is raw int32 when ``num_layers`` and ``top_k`` are given, and an error when
    they are not. Whatever the form, ``num_layers`` and ``top_k``, where given, must
    match the decoded shape.

    Nothing is ever unpickled: an ``.npy`` header naming an object dtype (whose data is
    a pickle) and a pickle payload are refused before their data is read. The ``.npy``
    header is checked against the payload's length before anything is allocated, so a
    short payload cannot claim a large array.

    Parameters
    ----------
    value
        The ``routed_experts`` value as the server returned it.
    num_layers, top_k
        The per-token shape ``(L, K)``: needed for raw int32, checked otherwise.
        Positive ints.

    Returns
    -------
    np.ndarray
        ``value`` itself for an array input. For ``.npy``, a new C-contiguous array in
        native byte order, of the dtype the file names (uint8 or uint16 from vLLM). For
        raw int32, a new ``int32`` array ``(n, num_layers, top_k)``.

    Raises
    ------
    ValueError
        If ``value`` is none of these forms, is not valid base64, is a corrupt or
        non-integer ``.npy`` payload, is a pickle, has a length that does not divide into
        rows of ``num_layers * top_k`` int32, or does not match ``num_layers`` or
        ``top_k``; or if ``num_layers`` or ``top_k`` is not a positive int. The message
        names what was expected and what was found.
    """
    num_layers = _optional_positive_int(num_layers, "num_layers")
    top_k = _optional_positive_int(top_k, "top_k")
    if isinstance(value, np.ndarray):
        array = value
        _check_routed_array(array, "routed_experts")
    elif isinstance(value, (str, bytes)):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            # str with non-ASCII characters raises ValueError, bad padding binascii.Error.
            raise ValueError(f"routed_experts must be valid base64, got {_describe(value)}: {exc}") from exc
        if raw.startswith(_NPY_MAGIC):
            array = _load_npy(raw)
        elif num_layers is not None and top_k is not None:
            array = _load_raw_int32(raw, num_layers, top_k)
        elif raw.startswith(_PICKLE_PROTO):
            raise ValueError(
                "routed_experts must be base64 of an .npy file, got base64 of what looks like a pickle "
                "(starts with the PROTO opcode); pickles are refused, never loaded"
            )
        else:
            raise ValueError(
                f"routed_experts must be base64 of an .npy file (bytes starting {_NPY_MAGIC!r}), got "
                f"{len(raw)} bytes starting {raw[:8]!r}; for raw int32 (SGLang) pass num_layers and top_k"
            )
    else:
        raise ValueError(
            "routed_experts must be a numpy array or base64 (str or bytes) of an .npy file or of raw "
            f"int32, got {type(value).__name__}"
        )
    for axis, name, want in ((1, "num_layers", num_layers), (2, "top_k", top_k)):
        if want is not None and array.shape[axis] != want:
            raise ValueError(
                f"routed_experts has shape {array.shape}, expected {name} = {want} on axis {axis}, "
                f"found {array.shape[axis]}"
            )
    return array


def _load_npy(raw: bytes) -> np.ndarray:
    # NOTE: not np.load. On a buffer it allocates the array its header claims before
    # reading the data (a few bytes can ask for terabytes), and it would also open a
    # zip (.npz) payload. The header is parsed with numpy's own reader, checked against
    # the payload, and only then are the bytes viewed.
    stream = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            # np.save writes 3.0 only for structured dtypes with non-latin-1 field names.
            raise ValueError(f"format version {version[0]}.{version[1]} is not that of an integer array (1.0 or 2.0)")
    except Exception as exc:
        # numpy's header reader lets its parsers' errors through on malformed input
        # (ValueError, SyntaxError, tokenize.TokenError, RecursionError, ...): any of
        # them means the payload is corrupt.
        raise ValueError(f"routed_experts is not a valid .npy payload: {type(exc).__name__}: {exc}") from exc
    if dtype.hasobject:
        raise ValueError(
            f"routed_experts must be an integer .npy array, got dtype {dtype} (its data is a pickle); "
            "pickles are refused, never loaded"
        )
    if dtype.kind not in "iu":
        raise ValueError(f"routed_experts must be an integer .npy array, got dtype {dtype}")
    if len(shape) != 3:
        raise ValueError(f"routed_experts must be 3-D (tokens, layers, top_k), got an .npy array of shape {shape}")
    if any(n < 0 for n in shape):
        raise ValueError(f"routed_experts .npy header has a negative dimension: shape {shape}")
    offset = stream.tell()
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) - offset != expected:
        raise ValueError(
            f"routed_experts .npy header says shape {shape} of {dtype} ({expected} bytes of data), "
            f"found {len(raw) - offset} bytes after the header"
        )
    flat = np.frombuffer(raw, dtype=dtype, count=expected // dtype.itemsize, offset=offset)
    array = flat.reshape(shape, order="F" if fortran_order else "C")
    # A new, writable array in native byte order: the payload's bytes are not kept.
    return array.astype(dtype.newbyteorder("="), order="C", copy=True)


def _load_raw_int32(raw: bytes, num_layers: int, top_k: int) -> np.ndarray:
    if len(raw) % 4:
        raise ValueError(f"routed_experts as raw int32 must be a whole number of 4-byte ids, got {len(raw)} bytes")
    ids = len(raw) // 4
    per_token = num_layers * top_k
    if ids % per_token:
        raise ValueError(
            f"routed_experts as raw int32 holds {ids} ids, which is not a whole number of tokens of "
            f"num_layers * top_k = {num_layers} * {top_k} = {per_token} ids"
        )
    # "<i4" read, native int32 returned: a new, writable array on any host.
    return np.frombuffer(raw, dtype="<i4").astype(np.int32).reshape(ids // per_token, num_layers, top_k)


# --- checking ------------------------------------------------------------------------


def check_routed_experts(
    routed: np.ndarray,
    *,
    prompt_len: int,
    num_output_tokens: int,
    prompt_start: int = 0,
    num_experts: int | None = None,
) -> None:
    """Check that ``routed`` holds one row per token the model forwarded, each a valid id.

    A request of ``prompt_len`` prompt tokens that generated ``num_output_tokens``
    forwarded every token but the last one generated (no forward pass ever saw it), so
    its routing has ``prompt_len + num_output_tokens - 1 - prompt_start`` rows, where
    ``prompt_start`` is the ``routed_experts_prompt_start`` the request asked for (the
    prompt rows it skipped).

    Parameters
    ----------
    routed
        ``(T, L, K)`` integer array, as :func:`decode_routed_experts` returns.
    prompt_len
        Tokens in the prompt, ``>= 1``.
    num_output_tokens
        Tokens generated, ``>= 1`` (the request finished; an aborted one returns none).
    prompt_start
        Prompt rows skipped at the start, in ``[0, prompt_len]`` (vLLM 0.30 accepts
        ``prompt_len``: only generated rows come back).
    num_experts
        If given, every id must be ``< num_experts``.

    Raises
    ------
    MissingRoutingError
        If ``T`` is not the number of rows the forward passes produced; the message
        gives both counts.
    ValueError
        If an id is negative or ``>= num_experts`` (the message names the first one by
        row, layer and slot), ``routed`` is not a 3-D integer array, or an argument is
        out of its range.
    """
    _check_routed_array(routed, "routed")
    prompt_len = _int_at_least(prompt_len, 1, "prompt_len")
    num_output_tokens = _int_at_least(num_output_tokens, 1, "num_output_tokens")
    prompt_start = _int_at_least(prompt_start, 0, "prompt_start")
    if prompt_start > prompt_len:
        raise ValueError(f"prompt_start must be in [0, {prompt_len}] (prompt_len), got {prompt_start}")
    num_experts = _optional_positive_int(num_experts, "num_experts")
    expected = prompt_len + num_output_tokens - 1 - prompt_start
    found = routed.shape[0]
    if found != expected:
        what = f"{expected - found} missing" if found < expected else f"{found - expected} more than forwarded"
        raise MissingRoutingError(
            f"routed_experts has {found} rows, expected prompt_len + num_output_tokens - 1 - prompt_start = "
            f"{prompt_len} + {num_output_tokens} - 1 - {prompt_start} = {expected} ({what})"
        )
    if routed.size == 0:
        return
    bad = routed < 0
    if num_experts is not None:
        bad |= routed >= num_experts
    if bad.any():
        row, layer, slot = (int(i) for i in np.argwhere(bad)[0])
        allowed = f"[0, {num_experts})" if num_experts is not None else ">= 0"
        raise ValueError(
            f"expert ids must be {allowed}, found {int(routed[row, layer, slot])} at row {row}, layer {layer}, "
            f"slot {slot} ({int(bad.sum())} bad ids in all)"
        )


# --- which layers are MoE --------------------------------------------------------------------


def moe_layer_indices(hf_config: Mapping[str, Any] | Any) -> list[int]:
    """Which decoder layers of a Hugging Face model are MoE layers, ascending.

    Follows the conventions real checkpoints use, looked up first at the top level and
    then in a nested text config (``text_config`` and its siblings), as
    :meth:`RoutingSpec.from_hf_config <slotroute.spec.RoutingSpec.from_hf_config>` does:

    - Qwen-MoE (``mlp_only_layers`` or ``decoder_sparse_step``): layer ``i`` is MoE iff
      ``i`` is not in ``mlp_only_layers``, ``num_experts > 0`` and
      ``(i + 1) % decoder_sparse_step == 0``;
    - DeepSeek (``first_k_dense_replace``, ``moe_layer_freq`` or ``n_routed_experts``):
      iff ``n_routed_experts`` is set and positive, ``i >= first_k_dense_replace`` and
      ``i % moe_layer_freq == 0``;
    - any other config (Mixtral, OLMoE, ...): every layer.

    Missing keys take the defaults of the models that define them (no
    ``mlp_only_layers``, ``decoder_sparse_step = 1``, ``first_k_dense_replace = 0``,
    ``moe_layer_freq = 1``).

    Parameters
    ----------
    hf_config
        The ``config.json`` contents as a dict, or a transformers config object.

    Returns
    -------
    list[int]
        A new list; empty when the config has no routed experts.

    Raises
    ------
    ValueError
        If ``num_hidden_layers`` is missing or not a positive int, a convention's key
        has the wrong type, a Qwen-MoE config names no expert count, or the config
        mixes the Qwen-MoE and DeepSeek conventions.
    """
    scopes = [hf_config] + [
        nested for key in TEXT_CONFIG_KEYS if (nested := _lookup(hf_config, key)) is not None
    ]

    def find(key: str, default: Any = None) -> Any:
        for scope in scopes:
            value = _lookup(scope, key)
            if value is not None:
                return value
        return default

    num_layers = find(LAYER_KEYS[0])
    if num_layers is None:
        raise ValueError(f"cannot find the number of layers in the config: tried keys {', '.join(LAYER_KEYS)}")
    layers = range(_int_at_least(num_layers, 1, LAYER_KEYS[0]))
    qwen = [key for key in ("mlp_only_layers", "decoder_sparse_step") if find(key) is not None]
    deepseek = [key for key in ("first_k_dense_replace", "moe_layer_freq", "n_routed_experts") if find(key) is not None]
    if qwen and deepseek:
        raise ValueError(
            "the config must follow one convention for dense layers, Qwen-MoE (mlp_only_layers, "
            "decoder_sparse_step) or DeepSeek (first_k_dense_replace, moe_layer_freq), "
            f"found keys {sorted(qwen + deepseek)}"
        )
    if qwen:
        dense = find("mlp_only_layers", [])
        if isinstance(dense, (str, bytes)) or not isinstance(dense, Sequence):
            raise ValueError(f"mlp_only_layers must be a list of layer indices, got {type(dense).__name__}")
        dense = {_int_at_least(i, 0, "an mlp_only_layers entry") for i in dense}
        step = _int_at_least(find("decoder_sparse_step", 1), 1, "decoder_sparse_step")
        num_experts = next((value for key in EXPERT_KEYS if (value := find(key)) is not None), None)
        if num_experts is None:
            raise ValueError(
                "cannot find the number of routed experts in the Qwen-MoE config: "
                f"tried keys {', '.join(EXPERT_KEYS)}"
            )
        if _int_at_least(num_experts, 0, "num_experts") == 0:
            return []
        return [i for i in layers if i not in dense and (i + 1) % step == 0]
    if deepseek:
        first = _int_at_least(find("first_k_dense_replace", 0), 0, "first_k_dense_replace")
        freq = _int_at_least(find("moe_layer_freq", 1), 1, "moe_layer_freq")
        if _int_at_least(find("n_routed_experts", 0), 0, "n_routed_experts") == 0:
            return []
        return [i for i in layers if i >= first and i % freq == 0]
    return list(layers)


# --- selecting layers, splitting them per router ---------------------------------------------------------------


def select_layers(routed: np.ndarray, layers: Sequence[int]) -> np.ndarray:
    """The rows of the given layers, in the given order: ``routed[:, layers, :]``.

    Typical use drops the rows vLLM (<= 0.30) returns for dense layers:
    ``select_layers(routed, moe_layer_indices(config))``.

    Parameters
    ----------
    routed
        ``(T, L, K)`` integer array.
    layers
        Distinct layer indices in ``[0, L)``, in the order wanted.

    Returns
    -------
    np.ndarray
        ``(T, len(layers), K)``. A view of ``routed`` when ``layers`` is evenly spaced
        (one layer, all of them, every other one, ...): numpy can view only a slice. An
        irregular selection, such as ``[0, 2, 3]``, is a new array.

    Raises
    ------
    IndexError
        If a layer is outside ``[0, L)`` (negative indices included: they are not
        counted from the end).
    ValueError
        If ``routed`` is not a 3-D integer array, ``layers`` is not a sequence of ints,
        or names a layer twice.
    """
    _check_routed_array(routed, "routed")
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (Sequence, np.ndarray)):
        raise ValueError(f"layers must be a sequence of ints, got {type(layers).__name__}")
    chosen = []
    for layer in layers:
        if isinstance(layer, (bool, np.bool_)):
            raise ValueError(f"layers must be ints, got {layer!r}")
        try:
            chosen.append(operator.index(layer))
        except TypeError:
            raise ValueError(f"layers must be ints, got {layer!r} ({type(layer).__name__})") from None
    num_layers = routed.shape[1]
    outside = [i for i in chosen if not 0 <= i < num_layers]
    if outside:
        raise IndexError(f"layers must be in [0, {num_layers}) (routed has {num_layers} layers), got {outside}")
    if len(set(chosen)) != len(chosen):
        repeated = sorted({i for i in chosen if chosen.count(i) > 1})
        raise ValueError(f"layers must be distinct, got {repeated} more than once in {chosen}")
    if len(chosen) <= 1 or len(set(np.diff(chosen).tolist())) == 1:
        start = chosen[0] if chosen else 0
        step = chosen[1] - chosen[0] if len(chosen) > 1 else 1
        stop = start + step * len(chosen)
        # Descending past layer 0 the stop is negative, which a slice reads from the end.
        return routed[:, start : (stop if stop >= 0 else None) : step, :]
    return routed[:, chosen, :]


def router_replay_indices(routed: np.ndarray, *, dtype: np.dtype | type = np.int64) -> list[np.ndarray]:
    """One C-contiguous ``[T, K]`` index array per layer, as Megatron's
    ``RouterReplay.set_target_indices`` takes (``RouterReplay.set_replay_data`` takes
    the list).

    Pass the MoE layers only, in the model's order (see :func:`select_layers`); index
    ``j`` of the result is then the ``j``-th MoE layer's router.

    Parameters
    ----------
    routed
        ``(T, L, K)`` integer array.
    dtype
        Integer dtype of the result; int64 by default (``torch.gather`` takes int64
        indices).

    Returns
    -------
    list[np.ndarray]
        ``L`` arrays of shape ``(T, K)``, each C-contiguous: views of one new
        ``(L, T, K)`` array that shares no memory with ``routed``.

    Raises
    ------
    ValueError
        If ``routed`` is not a 3-D integer array, ``dtype`` is not an integer dtype,
        or an id does not fit in ``dtype``.
    """
    _check_routed_array(routed, "routed")
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"dtype must be an integer dtype, got {dtype!r}") from exc
    if dtype.kind not in "iu":
        raise ValueError(f"dtype must be an integer dtype, got {dtype}")
    if routed.size and not np.can_cast(routed.dtype, dtype):
        low, high = int(routed.min()), int(routed.max())
        info = np.iinfo(dtype)
        if low < info.min or high > info.max:
            raise ValueError(f"expert ids must fit in {dtype} [{info.min}, {info.max}], found ids in [{low}, {high}]")
    per_layer = np.empty((routed.shape[1], routed.shape[0], routed.shape[2]), dtype=dtype)
    per_layer[...] = routed.transpose(1, 0, 2)
    return list(per_layer)


# --- validation helpers ---------------------------------------------------------------------


def _check_routed_array(array: Any, name: str) -> None:
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{name} must be a numpy array (T, L, K), got {type(array).__name__}")
    if array.ndim != 3:
        raise ValueError(f"{name} must be 3-D (tokens, layers, top_k), got shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer expert ids, got dtype {array.dtype}")


def _int_at_least(value: Any, low: int, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int >= {low}, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def _optional_positive_int(value: Any, name: str) -> int | None:
    return None if value is None else _int_at_least(value, 1, name)


def _describe(value: str | bytes) -> str:
    kind = "str" if isinstance(value, str) else "bytes"
    head = value[:16]
    return f"{kind} of length {len(value)} starting {head!r}"

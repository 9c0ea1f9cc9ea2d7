"""How one engine step's routing travels from the worker to the scheduler.

A step is ``routing_data (N, L, K)`` plus ``slot_mapping (N,)``. On the wire it is a
msgpack array whose numeric payloads are raw little-endian buffers (dtype, shape,
bytes): encoding is one copy of the bytes, decoding is none.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
import numpy as np

from slotroute.spec import ID_DTYPES

__all__ = ["ROUTING_DTYPES", "SLOT_DTYPES", "RoutedExpertsLists", "StepFailure", "StepMeta"]

# Little-endian dtype strings; numpy's ``dtype.str`` spells native dtypes this way
# on every platform slotroute runs on (checked below at import).
ROUTING_DTYPES = tuple(dtype.str for dtype in ID_DTYPES)  # "|u1", "<u2", "<i4", "<i8"
SLOT_DTYPES = ("<i4", "<i8")
FORMAT = "slotroute.step/1"

if sys.byteorder != "little":  # pragma: no cover - no big-endian platform is supported
    raise ImportError("slotroute.wire assumes a little-endian platform")

# Bounds on a header's dimensions, checked before any array is built; the byte
# length check in decode then ties the shape to the bytes actually present.
_Dim = Annotated[int, msgspec.Meta(ge=0, le=2**40)]
_PositiveDim = Annotated[int, msgspec.Meta(ge=1, le=2**20)]


class _Payload(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """The msgpack layout of one step. ``memoryview`` fields decode zero-copy."""

    format: Literal[FORMAT]
    routing_dtype: Literal[ROUTING_DTYPES]
    routing_shape: tuple[_Dim, _PositiveDim, _PositiveDim]
    routing: memoryview
    slot_dtype: Literal[SLOT_DTYPES]
    slots: memoryview


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Payload)


class RoutedExpertsLists(msgspec.Struct, frozen=True, eq=False, gc=False):
    """One engine step's routing: row ``i`` of ``routing_data`` is the routing of the
    token in KV-cache slot ``slot_mapping[i]``.

    Invariant (checked on construction): ``routing_data`` is a numpy array of shape
    ``(N, L, K)`` with ``L, K >= 1`` and dtype uint8, uint16, int32 or int64;
    ``slot_mapping`` is a numpy array of shape ``(N,)`` and dtype int32 or int64.
    Both are native byte order. Expert ids and slot values are not checked here:
    the store checks them against its spec and capacity.

    The struct holds the arrays it was given (no copy) and is frozen, so its fields
    cannot be swapped for unchecked ones; the arrays themselves stay mutable unless
    they came from :meth:`decode` of an immutable buffer. Equality and hashing are
    by identity (comparing arrays element-wise has no single truth value).

    Raises
    ------
    ValueError
        If either field is not a numpy array of the shape and dtype above.
    """

    routing_data: np.ndarray
    slot_mapping: np.ndarray

    def __post_init__(self) -> None:
        data, slots = self.routing_data, self.slot_mapping
        if not isinstance(data, np.ndarray):
            raise ValueError(f"routing_data must be a numpy array, got {type(data).__name__}")
        if not isinstance(slots, np.ndarray):
            raise ValueError(f"slot_mapping must be a numpy array, got {type(slots).__name__}")
        if data.dtype.str not in ROUTING_DTYPES:
            raise ValueError(
                f"routing_data dtype must be one of uint8, uint16, int32, int64 "
                f"(native byte order), got {data.dtype}"
            )
        if slots.dtype.str not in SLOT_DTYPES:
            raise ValueError(
                f"slot_mapping dtype must be int32 or int64 (native byte order), got {slots.dtype}"
            )
        if data.ndim != 3 or data.shape[1] == 0 or data.shape[2] == 0:
            raise ValueError(
                f"routing_data must have shape (N, num_layers, top_k) with num_layers, "
                f"top_k >= 1, got {data.shape}"
            )
        if slots.shape != (data.shape[0],):
            raise ValueError(
                f"slot_mapping must have shape ({data.shape[0]},) to match routing_data "
                f"{data.shape}, got {slots.shape}"
            )

    @property
    def num_tokens(self) -> int:
        """``N``, the number of rows in this step (padding rows included)."""
        return self.slot_mapping.shape[0]

    def encode(self) -> bytes:
        """Serialize to msgpack bytes.

        The arrays travel as raw buffers: one copy of their bytes into the result
        (two if an array is not C-contiguous), bounded by memory bandwidth.

        Returns
        -------
        bytes
            A new bytes object; later changes to the arrays do not affect it.
        """
        data = np.ascontiguousarray(self.routing_data)
        slots = np.ascontiguousarray(self.slot_mapping)
        return _ENCODER.encode(
            _Payload(
                FORMAT,
                data.dtype.str,
                data.shape,
                memoryview(data.reshape(-1).view(np.uint8)),
                slots.dtype.str,
                memoryview(slots.view(np.uint8)),
            )
        )

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview) -> RoutedExpertsLists:
        """Deserialize what :meth:`encode` produced, without copying the arrays.

        Cost is independent of the payload size (header parsing and checks only).

        Parameters
        ----------
        buf
            The encoded bytes. Any object supporting the buffer protocol works.

        Returns
        -------
        RoutedExpertsLists
            Its arrays are **views of ``buf``**: they keep ``buf`` alive, are read-only
            when ``buf`` is immutable (``bytes``), and see later writes to ``buf``
            when it is mutable (``bytearray``). Multi-byte arrays may be unaligned;
            numpy handles that transparently. Copy them to own the data.

        Raises
        ------
        ValueError
            If ``buf`` is truncated, corrupt or inconsistent: not this format, a
            dtype outside the allowed ones, a byte length that does not match the
            shape, or a slot count that does not match the routing rows. There is no
            checksum: a changed byte inside the arrays decodes to other values, which
            the store then range-checks.
        TypeError
            If ``buf`` does not support the buffer protocol.
        """
        try:
            payload = _DECODER.decode(buf)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # a str field with bytes that are not UTF-8
            raise ValueError(f"corrupt RoutedExpertsLists payload: {_name_field(str(exc))}") from None
        num_tokens, num_layers, top_k = payload.routing_shape
        routing_dtype = np.dtype(payload.routing_dtype)
        slot_dtype = np.dtype(payload.slot_dtype)
        # Python ints: no overflow, and the bounds on _Dim keep these small.
        expected = num_tokens * num_layers * top_k * routing_dtype.itemsize
        if payload.routing.nbytes != expected:
            raise ValueError(
                f"corrupt RoutedExpertsLists payload: routing shape {payload.routing_shape} "
                f"of {routing_dtype} needs {expected} bytes, found {payload.routing.nbytes}"
            )
        if payload.slots.nbytes != num_tokens * slot_dtype.itemsize:
            raise ValueError(
                f"corrupt RoutedExpertsLists payload: {num_tokens} slots of {slot_dtype} need "
                f"{num_tokens * slot_dtype.itemsize} bytes, found {payload.slots.nbytes}"
            )
        data = np.frombuffer(payload.routing, dtype=routing_dtype)
        slots = np.frombuffer(payload.slots, dtype=slot_dtype)
        return cls(data.reshape(num_tokens, num_layers, top_k), slots)


def _name_field(message: str) -> str:
    """msgspec locates errors in array-like structs by index (``$[2][0]``); add the
    field's name."""
    found = re.search(r"\$\[(\d+)\]", message)
    if found is None or int(found.group(1)) >= len(_Payload.__struct_fields__):
        return message
    return f"{message} (field {_Payload.__struct_fields__[int(found.group(1))]})"


@dataclass(frozen=True, slots=True)
class StepMeta:
    """What the scheduler tells the workers about one step, in the place of vLLM's
    ``AuxOutputConnectorMetadata``: the number of tokens it forwards."""

    num_tokens: int


@dataclass(frozen=True, slots=True)
class StepFailure:
    """A step whose routing failed the worker's checks, shipped in the place of its rows:
    the worker's error and the KV slots the step wrote."""

    error: str
    slot_mapping: np.ndarray

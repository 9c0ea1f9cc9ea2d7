"""The front end's rows of a request (``slotroute/vllm/outputs.py``): what
:class:`RequestRows` hands out equals vLLM's ``np.concatenate`` of the arrays received,
whatever their sizes, the room it was given and the replacements of the last array;
and it hands them out without that join where it can."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotroute.vllm.outputs import RequestRows

LAYERS, TOP_K = 3, 2


def rows(count: int, start: int = 0, dtype=np.uint8) -> np.ndarray:
    """``count`` distinct rows, numbered from ``start``."""
    values = np.arange(start * LAYERS * TOP_K, (start + count) * LAYERS * TOP_K) % 251
    return values.astype(dtype).reshape(count, LAYERS, TOP_K).copy()  # owning its memory, as a read makes it


def received(sizes: list[int], room: int, keep_first: bool = False) -> tuple[RequestRows, list[np.ndarray]]:
    got, chunks, at = RequestRows(room, keep_first), [], 0
    for size in sizes:
        chunk = rows(size, at)
        at += size
        got.append(chunk)
        chunks.append(chunk)
    return got, chunks


@settings(max_examples=300, deadline=None)
@given(prompt=st.integers(0, 40), steps=st.lists(st.integers(1, 3), max_size=30), room=st.integers(0, 60),
       trims=st.lists(st.tuples(st.integers(0, 29), st.integers(0, 2)), max_size=3), keep_first=st.booleans())
def test_rows_handed_out_equal_vllms_join_of_the_arrays_received(prompt, steps, room, trims, keep_first):
    got, chunks = received([prompt, *steps], room, keep_first)
    for at, drop in trims:  # vLLM 0.32+ trims the last array when a stop string drops tokens
        if at <= len(steps) and drop < len(chunks[-1]):
            trimmed = chunks[-1][:len(chunks[-1]) - drop]
            got[-1] = trimmed
            chunks[-1] = trimmed
    want = np.concatenate(chunks, axis=0)
    joined = got.joined()
    assert joined.dtype == want.dtype and np.array_equal(joined, want)
    assert np.array_equal(np.concatenate(list(got), axis=0), want)  # vLLM's own join, where it runs
    assert np.array_equal(got.joined(), want)  # asked again: the same rows


def test_rows_handed_out_share_no_memory_with_the_arrays_received():
    """The engine core's arrays (views of a received message, or of a step's rows) are
    not what the caller gets: vLLM's join made a new array, and so does this."""
    frame = rows(9)
    for room in (None, 1, 4, 100):
        got = RequestRows(room)
        got.append(frame[2:7])
        got.append(frame[7:8])
        joined = got.joined()
        assert np.array_equal(joined, frame[2:8]) and not np.shares_memory(joined, frame)


def test_rows_that_fill_their_room_are_one_array_with_no_join_at_finish():
    got, chunks = received([6, *[1] * 4], room=4)
    joined = got.joined()
    assert np.array_equal(joined, np.concatenate(chunks))
    assert joined.base is not None and joined.base.shape[0] == 10  # the filled array itself
    assert got.joined().base is joined.base


def test_a_request_that_stopped_early_gets_its_rows_alone_not_the_room_behind_them():
    got, chunks = received([6, 1, 1], room=100)
    joined = got.joined()
    assert np.array_equal(joined, np.concatenate(chunks))
    assert joined.flags.owndata and joined.shape[0] == 8


def test_more_rows_than_the_room_grow_the_array():
    got, chunks = received([4, *[2] * 9], room=1)
    assert np.array_equal(got.joined(), np.concatenate(chunks))


def test_an_array_of_another_dtype_or_row_shape_falls_back_to_vllms_join():
    got = RequestRows(8)
    first, second = rows(4), rows(1, 4, dtype=np.int32)
    got.append(first)
    got.append(rows(1, 4))
    got.append(second)
    assert np.array_equal(got.joined(), np.concatenate([first, rows(1, 4), second]))
    assert got.joined().dtype == np.int32
    got = RequestRows(8)
    got.append(rows(4))
    got.append(np.zeros((1, LAYERS + 1, TOP_K), dtype=np.uint8))
    with pytest.raises(ValueError):  # as vLLM's own join of these arrays raises
        got.joined()


def test_nothing_received_is_false_and_joins_to_none():
    got = RequestRows(4)
    assert not got and got.joined() is None and list(got) == []


@pytest.mark.parametrize("index", [0, 1, -2])
def test_replacing_any_array_but_the_last_is_refused_and_changes_nothing(index):
    got, chunks = received([3, 1, 1], room=4)
    with pytest.raises(IndexError, match="index -1"):
        got[index] = rows(1)
    assert np.array_equal(got.joined(), np.concatenate(chunks))
    with pytest.raises(IndexError, match="no array received"):
        RequestRows(2)[-1] = rows(1)


# -- vLLM 0.31+: the connector's arrays kept as they come (NOTE 2) --------------------


def test_the_only_array_received_is_handed_out_as_it_came_when_kept_first():
    """On 0.31+ slotroute's connector sends a request its rows once, at finish: the
    front end hands out that array, no copy in the finishing step."""
    for room in (None, 1, 256):
        got = RequestRows(room, keep_first=True)
        sent = rows(9)
        got.append(sent)
        assert got.joined() is sent and got.joined() is sent
        assert [np.shares_memory(part, sent) and np.array_equal(part, sent) for part in got] == [True]


def test_an_only_array_that_came_read_only_is_handed_out_as_a_writable_copy():
    """vLLM's decoder makes an array small enough to travel inside the message a
    read-only view of its bytes; vLLM's join handed out a writable array, and so does
    this."""
    sent = np.frombuffer(rows(2).tobytes(), dtype=np.uint8).reshape(2, LAYERS, TOP_K)
    got = RequestRows(4, keep_first=True)
    got.append(sent)
    joined = got.joined()
    assert not sent.flags.writeable and joined.flags.writeable and np.array_equal(joined, rows(2))


def test_a_second_array_copies_both_into_one_that_shares_memory_with_neither():
    """A request preempted with a step in flight gets its rows in two arrays: the first
    stops being the request's rows once the second comes."""
    first, second = rows(5), rows(3, 5)
    got = RequestRows(4, keep_first=True)
    got.append(first)
    got.append(second)
    joined = got.joined()
    assert np.array_equal(joined, np.concatenate([first, second]))
    assert not np.shares_memory(joined, first) and not np.shares_memory(joined, second)
    first[:] = 0  # the arrays received may now go: the rows handed out do not change
    assert np.array_equal(got.joined(), np.concatenate([rows(5), second]))


def test_a_trimmed_only_array_is_handed_out_as_the_trim_left_it():
    sent = rows(9)
    got = RequestRows(4, keep_first=True)
    got.append(sent)
    got[-1] = sent[:7]  # vLLM 0.32+'s _trim_surplus_tokens
    assert np.array_equal(got.joined(), sent[:7]) and np.shares_memory(got.joined(), sent)
    got.append(rows(2, 7))
    assert np.array_equal(got.joined(), rows(9))


def test_a_kept_first_array_then_one_of_another_dtype_falls_back_to_vllms_join():
    first, other = rows(4), rows(1, 4, dtype=np.int32)
    got = RequestRows(8, keep_first=True)
    got.append(first)
    got.append(other)
    assert np.array_equal(got.joined(), np.concatenate([first, other])) and got.joined().dtype == np.int32

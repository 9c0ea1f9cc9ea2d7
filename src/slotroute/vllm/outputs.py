"""The front end's rows of a request: one array that fills as they come, not a list
joined when the request finishes.

vLLM's front end (``vllm/v1/engine/output_processor.py``) keeps a request's
``routed_experts`` as the arrays its engine core outputs carried (on vLLM 0.28-0.30 the
prompt's rows when its prefill completes, then each step's rows of its new tokens) and
joins them with ``np.concatenate`` when the request finishes. That join copies every
row of the request in the step in which it finishes: the last step of a batch, where
no forward is left to hide it (on an H200, 44-49 ms of a multi-turn pass's 11.5 s and
81-126 ms of a rollout's 10.7 s, docs/benchmarks.md). :class:`RequestRows` copies
each arriving array into one array sized for the request's rows instead, in the step
that brings it, while the engine's next forward runs, and hands that array's rows out
at finish without a join.

NOTE 1 (what is handed out): the rows received, in order, as ``np.concatenate`` would
join them. The first array is copied into an array sized for it and the request's
``max_tokens`` rows, in the step that brings it (on vLLM 0.28-0.30 a prompt step, whose
forward is the longest); each later one is copied in behind it. At finish the rows are
handed out as a view of that array where they fill at least half of it, else as a copy
of them (a request that stopped early would otherwise keep up to its ``max_tokens``
rows of memory). An array of another dtype or row shape than the first (none comes
from slotroute's scheduler) turns the request back to vLLM's list and join.

NOTE 2 (the array kept as received, vLLM 0.31+): slotroute's connector hands a request
its rows when it finishes (and, if it is preempted with a step in flight, those read
then), each array a fresh read or a view of a buffer read for that request alone; in
another process than the engine core's each arrives as the view of a message frame of
its own. None is memory that anything writes again, so on 0.31+ (``keep_first``) the
first array is kept as it came, and one that is all the request gets is handed out as
it is: no copy at all in the finishing step, where vLLM's join made one (but for an
array that came read-only, as vLLM's decoder makes one small enough to travel inside the
message's bytes: it is handed out as a copy, writable as the join's). A second array
copies both into one array, as NOTE 1. On vLLM 0.28-0.30 the prompt's rows come first
and a decode step's row follows at every step, so keeping the first would spare
nothing; each is copied in as it comes, which also lets go of the decode rows' views of
the worker's pinned memory (in one process), reused only once no view of it is alive.
"""

from __future__ import annotations

import numpy as np

from slotroute.vllm.patches import Patch

__all__ = ["RequestRows", "connector_output_patches", "output_patches"]

OUTPUT_PROCESSOR = "vllm.v1.engine.output_processor"


class RequestRows:
    """One request's routed-experts rows as the front end receives them (NOTE 1).

    Stands in for vLLM's ``RequestState.routed_experts_chunks`` list: ``append`` takes
    each array the engine core sends, ``[-1] =`` replaces the last, truth says whether
    any came, iteration yields the rows received so far (so that vLLM's own join, where
    it runs, joins the same rows), and :meth:`joined` gives them at finish.

    Invariant: at most one of ``_rows`` (the filled array, its first ``_count`` rows
    received, the last array's from ``_last``; with ``_owned`` false, the first array
    received itself, NOTE 2) and ``_chunks`` (vLLM's list, after an array that does not
    fit) holds rows.

    Parameters
    ----------
    room
        Rows expected after the first array (the request's ``max_tokens``); the filled
        array is sized for the first array's rows plus these, and doubles if more come.
    keep_first
        Keep the first array as received, copying it only when a second comes (NOTE 2):
        only for arrays that nothing writes again.
    """

    __slots__ = ("_chunks", "_count", "_keep_first", "_last", "_owned", "_room", "_rows")

    def __init__(self, room: int | None = 0, keep_first: bool = False) -> None:
        self._room = max(int(room or 0), 1)
        self._keep_first = keep_first
        self._rows: np.ndarray | None = None
        self._owned = True
        self._count = 0
        self._last = 0
        self._chunks: list | None = None

    def append(self, chunk) -> None:
        """Take the next array of rows (``[tokens, layers, top_k]``)."""
        if self._chunks is not None:
            self._chunks.append(chunk)
            return
        held = self._rows
        if held is None:
            if not isinstance(chunk, np.ndarray) or chunk.ndim == 0:
                self._chunks = [chunk]
                return
            if self._keep_first:  # NOTE 2
                self._rows, self._owned, self._last, self._count = chunk, False, 0, len(chunk)
                return
            held = self._rows = np.empty((len(chunk) + self._room, *chunk.shape[1:]), dtype=chunk.dtype)
        elif not (isinstance(chunk, np.ndarray) and chunk.dtype == held.dtype and chunk.shape[1:] == held.shape[1:]):
            self._chunks = [*self, chunk]
            self._rows, self._owned = None, True
            return
        end = self._count + len(chunk)
        if not self._owned or end > len(held):  # the first array as received (NOTE 2), or full
            size = max(end, 2 * len(held)) if self._owned else end + self._room
            held = np.empty((size, *held.shape[1:]), dtype=held.dtype)
            held[:self._count] = self._rows[:self._count]
            self._rows, self._owned = held, True
        held[self._count:end] = chunk
        self._last, self._count = self._count, end

    def __setitem__(self, index: int, chunk) -> None:
        """Replace the last array received (``index`` -1): vLLM 0.32+'s front end trims
        the rows of tokens a stop string drops from the step's array
        (``OutputProcessor._trim_surplus_tokens``).

        Raises
        ------
        IndexError
            Any other index, or no array received yet.
        """
        if index != -1 or not self:
            raise IndexError(f"only the last array received (index -1) can be replaced, got index {index}"
                             + ("" if self else " with no array received"))
        if self._chunks is not None:
            self._chunks[-1] = chunk
        elif not self._owned:  # the only array, as received: its replacement likewise
            self._rows, self._owned, self._count = None, True, 0
            self.append(chunk)
        else:
            self._count = self._last
            self.append(chunk)

    def __bool__(self) -> bool:
        return self._rows is not None or bool(self._chunks)

    def __iter__(self):
        if self._chunks is not None:
            return iter(self._chunks)
        return iter(() if self._rows is None else (self._rows[:self._count],))

    def joined(self) -> np.ndarray | None:
        """Every row received, in order (NOTE 1); ``None`` where none came. The only
        array received itself where it was kept as it came (NOTE 2)."""
        if self._chunks is not None:
            return np.concatenate(self._chunks, axis=0) if self._chunks else None
        if self._rows is None:
            return None
        if not self._owned:  # writable, as vLLM's join made it (a small array may come as read-only bytes)
            return self._rows if self._rows.flags.writeable else self._rows.copy()
        rows = self._rows[:self._count]
        return rows if 2 * self._count >= len(self._rows) else rows.copy()


# -- patches ------------------------------------------------------------------------


def _request_state_init(keep_first: bool):
    """The wrapper of ``vllm/v1/engine/output_processor.py`` ``RequestState.__init__``:
    the request's rows in a :class:`RequestRows` sized for its ``max_tokens``, keeping
    its first array as received where ``keep_first`` (NOTE 2)."""

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.routed_experts_chunks = RequestRows(self.max_tokens_param, keep_first)

        return __init__

    return make


def _make_new_completion_output(original):
    """Wraps ``RequestState._new_completion_output``: at finish, the rows of the
    request's :class:`RequestRows` (NOTE 1) in the place of vLLM's join, which then finds
    nothing to join."""

    def _new_completion_output(self, token_ids, finish_reason, stop_reason):
        rows = self.routed_experts_chunks
        if finish_reason is None or not isinstance(rows, RequestRows) or not rows:
            return original(self, token_ids, finish_reason, stop_reason)
        self.routed_experts_chunks = []
        try:
            output = original(self, token_ids, finish_reason, stop_reason)
        finally:
            self.routed_experts_chunks = rows
        output.routed_experts = rows.joined()
        return output

    return _new_completion_output


def output_patches(keep_first: bool = False) -> list[Patch]:
    """The front end's rows of each request in one array, each array copied in as it
    comes (NOTE 1; vLLM 0.28-0.30), or with ``keep_first`` the first kept as it came
    (NOTE 2; :func:`connector_output_patches`)."""
    import vllm.v1.engine.output_processor as output_processor

    patches = [
        Patch(OUTPUT_PROCESSOR, "RequestState.__init__", None,
              ("self.max_tokens_param = max_tokens_param", "self.routed_experts_chunks: list[np.ndarray] = []"),
              _request_state_init(keep_first)),
        Patch(OUTPUT_PROCESSOR, "RequestState._new_completion_output",
              ("self", "token_ids", "finish_reason", "stop_reason"),
              (("if finished and self.routed_experts_chunks:",
                "routed_experts = np.concatenate(self.routed_experts_chunks, axis=0)",
                "routed_experts=routed_experts,"),),
              _make_new_completion_output),
        # Relied on: the one place each received array is taken.
        Patch(OUTPUT_PROCESSOR, "OutputProcessor.process_outputs", None,
              (("req_state.routed_experts_chunks.append(", "engine_core_output.routed_experts"),),
              None),
    ]
    if hasattr(output_processor.OutputProcessor, "_trim_surplus_tokens"):  # vLLM 0.32+
        patches.append(Patch(OUTPUT_PROCESSOR, "OutputProcessor._trim_surplus_tokens", None,
                             ("req_state.routed_experts_chunks[-1] = output.routed_experts[:-num_dropped]",), None))
    return patches


def connector_output_patches() -> list[Patch]:
    """The front end's rows of each request on vLLM 0.31-0.33, where slotroute's
    connector sends them: the first array kept as it comes (NOTE 2)."""
    return output_patches(keep_first=True)

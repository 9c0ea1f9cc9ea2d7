"""Requests: reject a ``routed_experts_prompt_start`` the scheduler cannot serve, at
input, before it reaches the engine core.

vLLM 0.28-0.29's ``Scheduler.update_from_output`` asserts
``prompt_start < request.num_prompt_tokens`` when a request's prefill completes
(``vllm/v1/core/sched/scheduler.py``), and no code path checks the value before: a
request with ``routed_experts_prompt_start >= len(prompt)`` stops the engine core and
every request in it. vLLM 0.30 validates the value in ``InputProcessor.process_inputs``
itself (``0 <= prompt_start <= prompt_len``, answered with HTTP 400) and its
scheduler accepts equality; there nothing is patched.
"""

from __future__ import annotations

from slotroute.vllm.patches import Patch

__all__ = ["check_prompt_start", "request_patches"]

INPUT_PROCESSOR = "vllm.v1.engine.input_processor"


def check_prompt_start(request) -> None:
    """Raise vLLM's ``VLLMValidationError`` (HTTP 400 in the OpenAI server) if the
    ``EngineCoreRequest``'s ``routed_experts_prompt_start`` is outside
    ``[0, prompt_len)``; return for a request without sampling parameters."""
    params = request.sampling_params
    start = getattr(params, "routed_experts_prompt_start", None)
    if not start:  # None or 0: always valid
        return
    if request.prompt_token_ids is not None:
        prompt_len = len(request.prompt_token_ids)
    else:
        prompt_len = len(request.prompt_embeds)
    if not 0 <= start < prompt_len:
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(
            f"routed_experts_prompt_start must be in [0, {prompt_len}) (the prompt length), got {start}",
            parameter="routed_experts_prompt_start",
            value=start,
        )


def _make_process_inputs(original):
    """Wraps ``vllm/v1/engine/input_processor.py`` ``InputProcessor.process_inputs``:
    checks the request it built (:func:`check_prompt_start`)."""

    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        check_prompt_start(request)
        return request

    return process_inputs


def request_patches() -> list[Patch]:
    """The patch that checks ``routed_experts_prompt_start`` (vLLM 0.28-0.29)."""
    return [
        Patch(INPUT_PROCESSOR, "InputProcessor.process_inputs", ("self", "request_id", "prompt", "params", "..."),
              ("return EngineCoreRequest(",), _make_process_inputs),
        # Relied on: the assert this check keeps requests away from.
        Patch("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output", None,
              ("assert prompt_start < request.num_prompt_tokens",), None),
    ]

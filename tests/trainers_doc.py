"""The recipes of ``docs/trainers.md``: one ``python`` block per section, run by
the tests with the inputs each recipe names (a live server's ``base_url``, an
``llm``, a ``response``...)."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "trainers.md"

# Section title -> the test that runs its snippet.
RECIPES = {
    "vLLM offline": "test_trainers_doc.py::test_vllm_offline_recipe_turns_a_request_output_into_replay_indices",
    "vLLM OpenAI server": "test_replay_e2e.py::test_openai_server_recipe_turns_a_live_completion_into_replay_indices",
    "SGLang server": "test_trainers_doc.py::test_sglang_recipe_decodes_raw_int32_meta_info",
    "Megatron RouterReplay": "test_trainers_doc.py::test_megatron_recipe_hands_each_moe_router_its_layer",
}


def python_blocks(text: str) -> dict[str, list[str]]:
    """The fenced ``python`` blocks of each section (any heading level) of ``text``, by
    title. Lines inside a fence are code, never headings."""
    blocks: dict[str, list[str]] = {}
    title, fence, code = None, None, []
    for line in text.splitlines(keepends=True):
        if fence is None and line.startswith("```"):
            fence, code = line[3:].strip(), []
        elif fence is not None and line.startswith("```"):
            if fence == "python":
                blocks.setdefault(title, []).append("".join(code))
            fence = None
        elif fence is not None:
            code.append(line)
        elif line.startswith("#"):
            title = line.lstrip("#").strip()
            blocks.setdefault(title, [])
    return blocks


def recipe(title: str) -> str:
    """The one ``python`` block of the section ``title``."""
    (code,) = python_blocks(DOC.read_text())[title]
    return code


def run_recipe(title: str, **inputs) -> dict:
    """Execute the recipe ``title`` with ``inputs`` defined; its namespace afterwards."""
    namespace = dict(inputs)
    exec(compile(recipe(title), f"{DOC.name}: {title}", "exec"), namespace)
    return namespace

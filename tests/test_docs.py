"""The documentation's cross-references: every relative link in README.md and docs/
names a file of the checkout and, where it names a heading, a heading of that file
(GitHub's anchors); every benchmark result the docs cite as ``benchmarks/*.json`` is
committed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RESULT = re.compile(r"benchmarks/[A-Za-z0-9_.-]+\.json")


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but ``-`` and
    ``_`` dropped, each blank a hyphen."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings, repeats numbered as GitHub numbers them."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        base = anchor(line.lstrip("#"))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_names_a_file_and_heading_that_exist(page):
    broken = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(ROOT)}")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no heading #{fragment} in {linked.relative_to(ROOT)}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_cited_benchmark_result_is_committed(page):
    missing = sorted({name for name in RESULT.findall(page.read_text()) if not (ROOT / name).is_file()})
    assert not missing, f"{page.name} cites results that are not in the checkout: {', '.join(missing)}"


def test_anchor_follows_githubs_rule():
    assert anchor(" H200, vLLM 0.29.0, V1 runner (2026-11-30, later)") == "h200-vllm-0290-v1-runner-2026-11-30-later"
    assert anchor("Front end (`outputs.py`, 0.28-0.33)") == "front-end-outputspy-028-033"

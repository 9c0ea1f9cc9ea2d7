"""The package's layout: the library and the vLLM plugin import none of the tools
(``slotroute.tools``); only the command line names them, to run them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import slotroute

PACKAGE = Path(slotroute.__file__).parent
TOOLS = "slotroute.tools"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in its code, as absolute names; and every
    string naming a slotroute module (``importlib.import_module`` takes those)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("slotroute."):
            names.add(node.value)
    return names


def imports_a_tool(path: Path) -> bool:
    return any(name == TOOLS or name.startswith(TOOLS + ".") for name in imported_names(path))


LIBRARY = sorted(
    path
    for path in PACKAGE.rglob("*.py")
    if path.relative_to(PACKAGE).parts[0] != "tools" and path.name != "cli.py"
)


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_library_and_plugin_modules_import_no_tool(path):
    assert not imports_a_tool(path), f"{path.relative_to(PACKAGE)} imports from {TOOLS}"


def test_the_plugin_is_among_the_modules_checked():
    assert {"vllm/__init__.py", "vllm/worker.py", "vllm/scheduler.py"} <= {str(p.relative_to(PACKAGE)) for p in LIBRARY}


def test_the_check_sees_imports_of_every_form(tmp_path, monkeypatch):
    """Absolute, relative, inside a function, and by name for importlib."""
    package = tmp_path / "slotroute" / "vllm"
    package.mkdir(parents=True)
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "slotroute")
    sources = {
        "absolute.py": "from slotroute.tools.engine import drive\n",
        "relative.py": "from ..tools import demo\n",
        "nested.py": "def f():\n    import slotroute.tools.bench\n",
        "by_name.py": "import importlib\nimportlib.import_module('slotroute.tools.demo')\n",
    }
    for name, source in sources.items():
        (package / name).write_text(source)
        assert imports_a_tool(package / name), name
    (package / "clean.py").write_text("from slotroute.store import RoutedExpertsManager\nfrom .. import spec\n")
    assert not imports_a_tool(package / "clean.py")


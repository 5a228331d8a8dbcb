"""The speculators' boundary: nothing in ``speculators/`` or ``ngram_index/`` imports the
daemon (what proposers need from the engine is ``speculators/target.py``), their imports
have no cycle, and their modules and functions stay small."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"speculators": "codespec.speculators", "ngram_index": "codespec.ngram_index"}


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out[name] = path
    return out


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_nothing_imports_the_daemon():
    bad = {n: sorted(i for i in imports(p) if i.startswith("codespec.daemon")) for n, p in
           modules().items()}  # fmt: skip
    assert {n: i for n, i in bad.items() if i} == {}
    code = (
        "import sys\n"
        + "".join(f"import {name}\n" for name in modules())
        + "print(sorted(m for m in sys.modules if m.startswith('codespec.daemon')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_import_cycle():
    mods = modules()
    graph = {n: {i for i in imports(p) if i in mods and i != n} for n, p in mods.items()}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name in done:
            return
        for dep in graph[name]:
            visit(dep, (*path, name))
        done.add(name)

    for name in graph:
        visit(name, ())


def test_modules_and_functions_stay_small():
    for name, path in modules().items():
        text = path.read_text()
        assert text.count("\n") <= 500, f"{name}: {text.count(chr(10))} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                assert length <= 60, f"{name}.{node.name}: {length} lines"

"""The house rule on size: no module over 500 lines, no function or method over 60.

Walks every ``.py`` file of the package folders (not ``tests``) and measures each
function with ``ast`` (``end_lineno - lineno + 1``: its decorators are not counted, its
docstring and nested functions are). The assertion names every offender.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("daemon", "lsp", "native", "ngram_index", "speculators")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def sources() -> list[Path]:
    return [p for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))]


def long_modules() -> list[str]:
    """``path: N lines`` for each module over :data:`MAX_MODULE_LINES`."""
    out = []
    for path in sources():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_MODULE_LINES:
            out.append(f"{path.relative_to(ROOT)}: {n} lines")
    return out


def long_functions() -> list[str]:
    """``path:line name: N lines`` for each function or method over
    :data:`MAX_FUNCTION_LINES`."""
    out = []
    for path in sources():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    return out


def test_the_walk_finds_the_packages() -> None:
    """The check has teeth: it reads every package folder's modules."""
    found = {p.relative_to(ROOT).parts[0] for p in sources()}
    assert found == set(PACKAGES)


def test_no_module_over_500_lines() -> None:
    offenders = long_modules()
    assert offenders == [], f"modules over {MAX_MODULE_LINES} lines: {offenders}"


def test_no_function_over_60_lines() -> None:
    offenders = long_functions()
    assert offenders == [], f"functions over {MAX_FUNCTION_LINES} lines: {offenders}"

"""One layering for the whole package: which subpackage may import which.

    lsp        -> the daemon's socket client only (client, typed, config, the version)
    service    -> prompts, text, engine, speculators, ngram_index, native; its backends/
                  (the remote engine: serve --backend vllm) are part of the same layer
    prompts    -> text, ngram_index            (nothing of the service or the engine)
    text       -> nothing of the daemon        (ids -> text, stop rules, healing)
    engine     -> text, speculators, native    (nothing of prompts or the service)
    bench, training, view, backends, cli (cli_commands: its subcommands' work)
                                               -> anything below them (they sit on top)
    speculators -> ngram_index; ngram_index, native -> nothing of the daemon

The daemon's top modules ``config`` and ``typed`` are leaves every layer may read;
``client`` speaks the wire format (``service.protocol``), which imports nothing of the
service's insides. Imports inside functions count too: a lazy import is still a
dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "daemon": "codespec.daemon",
    "lsp": "codespec.lsp",
    "native": "codespec.native",
    "speculators": "codespec.speculators",
    "ngram_index": "codespec.ngram_index",
}

D = "codespec.daemon"
LEAVES = {f"{D}.config", f"{D}.typed", f"{D}.errors", D, "codespec.native"}
# layer -> the layers (module prefixes) it may import besides itself and the leaves
ALLOWED: dict[str, set[str]] = {
    "codespec.lsp": {f"{D}.client", f"{D}.service.protocol"},
    f"{D}.client": {f"{D}.service.protocol"},
    f"{D}.service.protocol": set(),
    f"{D}.backends": {
        f"{D}.service",
        f"{D}.prompts",
        f"{D}.text",
        f"{D}.engine",
        "codespec.speculators",
    },
    f"{D}.service": {
        f"{D}.backends",
        f"{D}.prompts",
        f"{D}.text",
        f"{D}.engine",
        "codespec.speculators",
        "codespec.ngram_index",
    },
    f"{D}.prompts": {f"{D}.text", "codespec.ngram_index"},
    f"{D}.text": set(),
    f"{D}.engine": {f"{D}.text", "codespec.speculators"},
    "codespec.speculators": {"codespec.ngram_index"},
    "codespec.ngram_index": set(),
    "codespec.native": set(),
}
TOP = {
    f"{D}.bench",
    f"{D}.training",
    f"{D}.view",
    f"{D}.cli",
    f"{D}.cli_commands",
    f"{D}.__main__",
}


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def imports(path: Path) -> set[str]:
    """The codespec modules ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {m for m in found if m.startswith("codespec")}


def layer_of(name: str) -> str | None:
    """The most specific layer ``name`` belongs to (None: a top module that may import
    anything)."""
    if any(name == t or name.startswith(t + ".") for t in TOP):
        return None
    best = None
    for layer in ALLOWED:
        if (name == layer or name.startswith(layer + ".")) and (
            best is None or len(layer) > len(best)
        ):
            best = layer
    return best


def inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations() -> dict[str, list[str]]:
    bad: dict[str, list[str]] = {}
    for name, path in modules().items():
        layer = layer_of(name)
        if layer is None:
            continue
        for dep in sorted(imports(path)):
            ok = inside(dep, layer) or dep in LEAVES or any(inside(dep, a) for a in ALLOWED[layer])
            if not ok:
                bad.setdefault(name, []).append(dep)
    return bad


def test_every_module_belongs_to_a_layer_or_sits_on_top():
    """A new subpackage must be placed in the layering (here) before it lands."""
    lost = [
        n
        for n in modules()
        if n not in LEAVES
        and n not in TOP
        and layer_of(n) is None
        and not any(inside(n, t) for t in TOP)
    ]
    assert lost == []


def test_each_layer_imports_only_what_lies_below_it():
    assert violations() == {}


@pytest.mark.parametrize(
    "source,target",
    [
        (f"{D}.prompts.x", f"{D}.service.protocol"),
        (f"{D}.engine.x", f"{D}.prompts.fim"),
        ("codespec.lsp.x", f"{D}.engine.engine"),
    ],
)
def test_the_rule_catches_an_upward_import(source, target):
    """The check itself: an import against the layering is caught."""
    layer = layer_of(source)
    assert layer is not None
    assert not (
        inside(target, layer) or target in LEAVES or any(inside(target, a) for a in ALLOWED[layer])
    )

"""``codespec bench make-workloads``: benchmark workloads from real code the model never saw.

Sources: the interpreter's held-out ``Lib/test`` folder, and pairs of released
versions of Python packages fetched with ``pip download`` (sdists, cached under
``~/.cache/codespec/bench``). Workloads, one JSONL file each:

- ``completion``: the cursor at the start of a line inside a function body;
  the rest of that body is not typed yet (prefix = file up to the cursor,
  suffix = the file after the function). Up to 64 tokens. The other files of
  the same package are open documents (indexed).
- ``edit``: a function that changed between two versions, regenerated as the
  FIM middle; its old text stands right before it in the prompt (the user
  duplicated the function to rewrite it), so the old version is the obvious
  draft. ``old`` / ``new`` carry both texts for reporting. The old file is an
  open document.
- ``novel``: the first lines of a held-out file, nothing indexed, nothing to copy.
- ``function``: the cursor right after a function's ``def`` line (and docstring);
  the body is to be written (``codespec bench quality`` checks that it parses).

Completion and function items carry ``expected``, the real text after the cursor
(the first line is what ``codespec bench quality`` compares a completion with).

Each line: ``{"id", "kind", "prefix", "suffix", "max_tokens", "uri", "documents"}``;
the benchmark turns prefix / suffix into the model's own FIM prompt.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import random
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

CACHE = Path.home() / ".cache" / "codespec" / "bench"
DEFAULT_PACKAGES = "requests:2.31.0:2.32.3,click:8.1.3:8.1.7"


def functions(text: str) -> list[tuple[str, int, int]]:
    """(qualified name, first line, last line) of every function, 1-based inclusive."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out: list[tuple[str, int, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    out.append((name, first, child.end_lineno or child.lineno))
                walk(child, name + ".")

    walk(tree, "")
    return out


def fetch_sdist(name: str, version: str) -> Path:
    """Unpack ``name==version``'s sdist into the cache (downloaded once, by pip)."""
    dest = CACHE / f"{name}-{version}"
    if dest.exists():
        return dest
    CACHE.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--no-binary",
        ":all:",
        f"{name}=={version}",
        "-d",
        str(CACHE),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    archive = next(p for p in CACHE.glob(f"{name}-{version}.tar.gz"))
    tmp = CACHE / f".{name}-{version}.tmp"
    with tarfile.open(archive) as tf:
        tf.extractall(tmp, filter="data")
    next(tmp.iterdir()).rename(dest)
    tmp.rmdir()
    return dest


def package_files(root: Path, name: str) -> dict[str, str]:
    """Module path (relative to the package folder) → text, for the package's own sources."""
    pkg = next((p for p in (root / "src" / name, root / name) if p.is_dir()), None)
    if pkg is None:
        raise FileNotFoundError(f"no package folder {name} in {root}")
    out = {}
    for path in sorted(pkg.rglob("*.py")):
        out[str(path.relative_to(pkg))] = path.read_text(encoding="utf-8", errors="replace")
    return out


Spot = tuple[int, int, dict[str, Any]]  # (cursor line, last line to write, item fields)


def _items(
    files: dict[str, str],
    tag: str,
    rng: random.Random,
    count: int,
    spot: Callable[[str], Spot | None],
) -> list[dict]:
    """Up to ``count`` items, one per file at most, files in a shuffled order: ``spot(rel)``
    picks the cursor in file ``rel`` (None: none there) and the item is built around it:
    ``prefix``, ``suffix``, ``expected`` (the lines from the cursor's to the last one to
    write), the file without them open with the first 24 other files, and the spot's
    fields (``id`` and ``kind`` first, the rest after ``expected``)."""
    items = []
    names = sorted(files)
    rng.shuffle(names)
    for rel in names:
        found = spot(rel)
        if found is None:
            continue
        cursor_line, last, fields = found
        lines = files[rel].splitlines(keepends=True)
        prefix = "".join(lines[: cursor_line - 1])
        suffix = "".join(lines[last:])
        uri = f"file:///{tag}/{rel}"
        others = [{"uri": f"file:///{tag}/{o}", "text": files[o]} for o in names if o != rel]
        head = {k: fields.pop(k) for k in ("id", "kind")}
        items.append(
            {
                **head,
                "prefix": prefix,
                "suffix": suffix,
                "expected": "".join(lines[cursor_line - 1 : last]),
                **fields,
                "uri": uri,
                "documents": [{"uri": uri, "text": prefix + suffix}, *others[:24]],
            }
        )
        if len(items) >= count:
            break
    return items


def completion_items(files: dict[str, str], tag: str, rng: random.Random, count: int) -> list[dict]:
    """The cursor at the start of a body line, at least one body line typed already: the
    rest of the body is to be written."""

    def spot(rel: str) -> Spot | None:
        text = files[rel]
        funcs = [f for f in functions(text) if f[2] - f[1] >= 6]
        if not funcs:
            return None
        _, first, last = rng.choice(funcs)
        cursor_line = rng.randrange(first + 2, last)  # 1-based line the cursor stands on
        if not text.splitlines()[cursor_line - 1].strip():
            return None
        fields = {"id": f"{tag}/{rel}:{cursor_line}", "kind": "completion", "max_tokens": 64}
        return cursor_line, last, fields

    return _items(files, tag, rng, count, spot)


def _body_start(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int | None:
    """The 1-based line a function's body starts on, past its docstring (None when the
    docstring is all there is)."""
    body = node.body
    doc = isinstance(body[0], ast.Expr) and isinstance(
        getattr(body[0], "value", None), ast.Constant
    )
    if doc and len(body) < 2:
        return None
    return (body[1] if doc else body[0]).lineno


def function_items(files: dict[str, str], tag: str, rng: random.Random, count: int) -> list[dict]:
    """The cursor right after a function's ``def`` line (and docstring, if any): the
    whole body is to be written; ``expected`` is the real one."""

    def spot(rel: str) -> Spot | None:
        text = files[rel]
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return None
        defs = [
            n
            for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and 3 <= (n.end_lineno or n.lineno) - n.lineno <= 30
        ]
        if not defs:
            return None
        node = rng.choice(defs)
        cursor_line = _body_start(node)
        if cursor_line is None:
            return None
        header = "".join(text.splitlines(keepends=True)[node.lineno - 1 : cursor_line - 1])
        fields = {"id": f"{tag}/{rel}:{node.name}", "kind": "function", "header": header}
        return cursor_line, node.end_lineno or node.lineno, {**fields, "max_tokens": 128}

    return _items(files, tag, rng, count, spot)


def edit_items(old: dict[str, str], new: dict[str, str], tag: str, min_same: float) -> list[dict]:
    items = []
    for rel in sorted(set(old) & set(new)):
        old_funcs = {n: (a, b) for n, a, b in functions(old[rel])}
        old_lines = old[rel].splitlines(keepends=True)
        new_lines = new[rel].splitlines(keepends=True)
        for name, first, last in functions(new[rel]):
            if name not in old_funcs:
                continue
            oa, ob = old_funcs[name]
            old_text = "".join(old_lines[oa - 1 : ob])
            new_text = "".join(new_lines[first - 1 : last])
            if old_text == new_text:
                continue
            same = difflib.SequenceMatcher(None, old_text, new_text, autojunk=False).ratio()
            if same < min_same or not 300 <= len(new_text) <= 1600:  # about 100-400 tokens
                continue
            before = "".join(new_lines[: first - 1])
            after = "".join(new_lines[last:])
            items.append(
                {
                    "id": f"{tag}/{rel}:{name}",
                    "kind": "edit",
                    "prefix": before + old_text + "\n",
                    "suffix": after,
                    "old": old_text,
                    "new": new_text,
                    "unchanged": round(same, 3),
                    "max_tokens": 512,
                    "uri": f"file:///{tag}/{rel}",
                    "documents": [{"uri": f"file:///{tag}-old/{rel}", "text": old[rel]}],
                }
            )
    return items


def novel_items(files: dict[str, str], rng: random.Random, count: int) -> list[dict]:
    items = []
    names = sorted(files)
    rng.shuffle(names)
    for rel in names:
        lines = files[rel].splitlines(keepends=True)
        if len(lines) < 30:
            continue
        cut = rng.randrange(8, 20)
        items.append(
            {
                "id": f"novel/{rel}:{cut}",
                "kind": "novel",
                "prefix": "".join(lines[:cut]),
                "suffix": "",
                "max_tokens": 64,
            }
        )
        if len(items) >= count:
            break
    return items


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="codespec bench make-workloads", description=__doc__)
    p.add_argument("--out", default="bench-workloads")
    p.add_argument("--packages", default=DEFAULT_PACKAGES, help="name:old:new,...")
    p.add_argument("--count", type=int, default=16, help="prompts per source and workload")
    p.add_argument("--min-unchanged", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    test_dir = Path(sysconfig.get_paths()["stdlib"]) / "test"
    stdlib_tests = {
        p.name: p.read_text(encoding="utf-8", errors="replace")
        for p in sorted(test_dir.glob("test_*.py"))
        if p.stat().st_size < 150_000
    }
    completion = completion_items(stdlib_tests, "stdlib-test", rng, args.count)
    function = function_items(stdlib_tests, "stdlib-test", rng, args.count // 2)
    edit: list[dict] = []
    for spec in args.packages.split(","):
        name, v_old, v_new = spec.split(":")
        old = package_files(fetch_sdist(name, v_old), name)
        new = package_files(fetch_sdist(name, v_new), name)
        completion += completion_items(new, f"{name}-{v_new}", rng, args.count // 2)
        function += function_items(new, f"{name}-{v_new}", rng, args.count // 2)
        edits = edit_items(old, new, f"{name}-{v_new}", args.min_unchanged)
        edit += rng.sample(edits, min(len(edits), args.count))
    novel = novel_items(stdlib_tests, rng, args.count)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workloads = (
        ("completion", completion),
        ("function", function),
        ("edit", edit),
        ("novel", novel),
    )
    for name, items in workloads:
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as fh:
            for item in items:
                fh.write(json.dumps(item) + "\n")
        print(f"{out / (name + '.jsonl')}: {len(items)} prompts")
    print(
        json.dumps(
            {
                "bench": "make-workloads",
                "completion": len(completion),
                "function": len(function),
                "edit": len(edit),
                "novel": len(novel),
            }
        )
    )
    return 0

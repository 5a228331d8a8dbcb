"""Workspace indexing: the folders clients announce feed the n-gram index.

Owns: which files of a folder are indexed (``.gitignore`` patterns, no
``.git``/hidden VCS folders, no binary files, nothing over
``max_file_bytes``, at most ``max_files``), the watchdog observer, and the
debounce that turns a burst of file events into one re-index per path.
Files a client has open are left to the document store (their editor text
wins over the disk). Must not touch: the engine, sockets, documents.

.gitignore support is the common subset: blank lines and ``#`` comments are
skipped, ``!`` re-includes, a trailing ``/`` matches folders only, a pattern
with a ``/`` (other than trailing) is anchored to the .gitignore's folder, one
without matches a name at any depth, ``*``/``?``/``[...]`` and ``**`` glob.
Nested .gitignore files apply below their folder.

Debounce: every event (re)sets the path's deadline to ``now + debounce_s``;
a flusher thread handles each path once its deadline has passed. ``flushed``
(a condition) lets tests wait for a flush without sleeping.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

log = logging.getLogger("codespec.daemon")

SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", "node_modules", ".venv", ".mypy_cache"}


def path_of(folder: str) -> Path:
    """A folder given as a path or a ``file://`` URI."""
    if folder.startswith("file://"):
        return Path(unquote(urlparse(folder).path))
    return Path(os.path.expanduser(folder))


def uri_of(path: Path) -> str:
    return path.resolve().as_uri()


class _Rule:
    def __init__(self, base: Path, line: str) -> None:
        self.negate = line.startswith("!")
        if self.negate:
            line = line[1:]
        self.dir_only = line.endswith("/")
        line = line.rstrip("/")
        self.anchored = "/" in line
        line = line.lstrip("/")
        self.base = base
        self.regex = re.compile(_glob_to_regex(line))

    def matches(self, rel: str, name: str, is_dir: bool) -> bool:
        if self.dir_only and not is_dir:
            return False
        return bool(self.regex.fullmatch(rel if self.anchored else name))


def _glob_to_regex(pat: str) -> str:
    out = []
    i = 0
    while i < len(pat):
        if pat.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pat.startswith("/**", i) and i + 3 == len(pat):
            out.append("/.*")
            i += 3
        elif pat[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pat[i] == "?":
            out.append("[^/]")
            i += 1
        elif pat[i] == "[":
            j = pat.find("]", i + 1)
            if j < 0:
                out.append(re.escape(pat[i]))
                i += 1
            else:
                body = pat[i + 1 : j].replace("\\", "\\\\")
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = j + 1
        else:
            out.append(re.escape(pat[i]))
            i += 1
    return "".join(out)


class IgnoreRules:
    """The .gitignore rules that apply under one root, read lazily per folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._by_dir: dict[Path, list[_Rule]] = {}

    def _rules(self, folder: Path) -> list[_Rule]:
        rules = self._by_dir.get(folder)
        if rules is None:
            rules = []
            try:
                text = (folder / ".gitignore").read_text(encoding="utf-8", errors="replace")
            except OSError:
                text = ""
            for line in text.splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    rules.append(_Rule(folder, line))
            self._by_dir[folder] = rules
        return rules

    def forget(self, folder: Path) -> None:
        self._by_dir.pop(folder, None)

    def ignored(self, path: Path, is_dir: bool) -> bool:
        """Whether ``path`` (under the root) or one of its folders is ignored."""
        try:
            rel = path.relative_to(self.root)
        except ValueError:
            return True
        parts = rel.parts
        for depth in range(1, len(parts) + 1):
            sub = parts[:depth]
            sub_is_dir = is_dir if depth == len(parts) else True
            if sub[-1] in SKIP_DIRS and sub_is_dir:
                return True
            if self._ignored_here(self.root.joinpath(*sub), sub_is_dir):
                return True
        return False

    def _ignored_here(self, path: Path, is_dir: bool) -> bool:
        verdict = False
        rel_parts = path.relative_to(self.root).parts
        chain = [self.root] + [self.root.joinpath(*rel_parts[:k]) for k in range(1, len(rel_parts))]
        for folder in chain:
            rel = "/".join(path.relative_to(folder).parts)
            for rule in self._rules(folder):
                if rule.matches(rel, path.name, is_dir):
                    verdict = not rule.negate
        return verdict


def read_text_file(path: Path, max_bytes: int) -> str | None:
    """The file's text, or None when it is missing, too big, binary or not UTF-8."""
    try:
        if not path.is_file() or path.stat().st_size > max_bytes:
            return None
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def walk(root: Path, rules: IgnoreRules) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not rules.ignored(here / d, is_dir=True))
        for name in sorted(filenames):
            p = here / name
            if not rules.ignored(p, is_dir=False):
                yield p


class Workspace:
    """Watches folders and calls ``index_file(uri, text | None)`` (None: forget it)."""

    def __init__(
        self,
        index_file: Callable[[str, str | None], None],
        is_open: Callable[[str], bool],
        max_file_bytes: int = 1_000_000,
        max_files: int = 5000,
        debounce_s: float = 0.3,
    ) -> None:
        self.index_file = index_file
        self.is_open = is_open
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        self.debounce_s = debounce_s
        self.roots: dict[Path, IgnoreRules] = {}
        self.files: set[str] = set()
        self.flushes = 0
        self.flushed = threading.Condition()
        self._pending: dict[Path, float] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._observer = None
        self._flusher = threading.Thread(target=self._flush_loop, name="codespec-ws", daemon=True)
        self._flusher.start()

    # -- folders ------------------------------------------------------------------------
    def add(self, folder: str) -> int:
        """Index ``folder`` now and watch it; returns how many files were indexed."""
        root = path_of(folder).resolve()
        if not root.is_dir():
            raise ValueError(f"{folder} is not a folder")
        if root in self.roots:
            return 0
        rules = IgnoreRules(root)
        self.roots[root] = rules
        count = 0
        for p in walk(root, rules):
            if len(self.files) >= self.max_files:
                break
            count += self._index(p)
        self._watch(root)
        return count

    def remove(self, folder: str) -> None:
        root = path_of(folder).resolve()
        if self.roots.pop(root, None) is None:
            return
        prefix = root.as_uri() + "/"
        for uri in [u for u in self.files if u.startswith(prefix)]:
            self.files.discard(uri)
            self.index_file(uri, None)

    def _rules_for(self, path: Path) -> IgnoreRules | None:
        for root, rules in self.roots.items():
            if path == root or root in path.parents:
                return rules
        return None

    def _index(self, path: Path) -> int:
        uri = uri_of(path)
        if self.is_open(uri):
            return 0
        text = read_text_file(path, self.max_file_bytes)
        if text is None:
            if uri in self.files:
                self.files.discard(uri)
                self.index_file(uri, None)
            return 0
        if uri not in self.files and len(self.files) >= self.max_files:
            return 0
        self.files.add(uri)
        self.index_file(uri, text)
        return 1

    # -- watching -----------------------------------------------------------------------
    def _watch(self, root: Path) -> None:
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer

        ws = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event) -> None:  # type: ignore[override]
                if event.event_type in ("opened", "closed_no_write"):
                    return
                for attr in ("src_path", "dest_path"):
                    p = getattr(event, attr, "")
                    if p:
                        ws.touch(Path(os.fsdecode(p)))

        if self._observer is None:
            self._observer = Observer()
            self._observer.daemon = True
            self._observer.start()
        self._observer.schedule(Handler(), str(root), recursive=True)

    def touch(self, path: Path) -> None:
        """Note a change to ``path``; it is re-read once no event came for ``debounce_s``."""
        with self._cond:
            self._pending[path] = time.monotonic() + self.debounce_s
            self._cond.notify_all()

    def _flush_loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop:
                    now = time.monotonic()
                    due = [p for p, t in self._pending.items() if t <= now]
                    if due:
                        break
                    wait = min(self._pending.values(), default=now + 3600) - now
                    self._cond.wait(timeout=max(0.001, wait))
                if self._stop:
                    return
                for p in due:
                    del self._pending[p]
            for p in due:
                try:
                    self._refresh(p)
                except Exception:
                    log.exception("workspace: cannot index %s", p)
            with self.flushed:
                self.flushes += 1
                self.flushed.notify_all()

    def _refresh(self, path: Path) -> None:
        rules = self._rules_for(path)
        if rules is None:
            return
        if path.name == ".gitignore":
            rules.forget(path.parent)
        if path.is_dir() or rules.ignored(path, is_dir=False):
            uri = uri_of(path)
            if uri in self.files:
                self.files.discard(uri)
                self.index_file(uri, None)
            return
        self._index(path)

    def stats(self) -> dict[str, object]:
        return {"folders": [str(r) for r in self.roots], "files": len(self.files)}

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)
        self._flusher.join(timeout=2)

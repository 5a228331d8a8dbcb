"""Workspace indexing: the folders clients announce feed the n-gram index.

Owns: which files of a folder are indexed (``.gitignore`` patterns, no
``.git``/hidden VCS folders, no binary files, nothing over
``max_file_bytes``, at most ``max_files``), the watchdog observer, and the
debounce that turns a burst of file events into one re-index per path.
Files a client has open are left to the document store (their editor text
wins over the disk). Must not touch: the engine, sockets, documents.

.gitignore patterns are matched by ``pathspec`` (git's own rules); nested
.gitignore files apply below their folder.

Threads: ``add`` / ``remove`` run on a worker thread, re-indexing on the
flusher thread, ``stats`` on the event loop; ``roots`` and ``files`` are read
and changed only under ``_lock``.

Debounce: every event (re)sets the path's deadline to ``now + debounce_s``;
a flusher thread handles each path once its deadline has passed. ``flushed``
(a condition) lets tests wait for a flush without sleeping.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

import pathspec

log = logging.getLogger("codespec.daemon")

SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", "node_modules", ".venv", ".mypy_cache"}


def path_of(folder: str) -> Path:
    """A folder given as a path or a ``file://`` URI."""
    if folder.startswith("file://"):
        return Path(unquote(urlparse(folder).path))
    return Path(os.path.expanduser(folder))


def uri_of(path: Path) -> str:
    return path.resolve().as_uri()


class IgnoreRules:
    """The .gitignore files that apply under one root (``pathspec``'s git rules), read
    lazily per folder. A path is ignored when it or one of its folders is (git does not
    look inside an ignored folder); for each, the deepest .gitignore with a matching
    pattern decides, and within a file the last matching pattern."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._by_dir: dict[Path, pathspec.GitIgnoreSpec | None] = {}

    def _spec(self, folder: Path) -> pathspec.GitIgnoreSpec | None:
        if folder not in self._by_dir:
            try:
                text = (folder / ".gitignore").read_text(encoding="utf-8", errors="replace")
            except OSError:
                text = ""
            lines = text.splitlines()
            self._by_dir[folder] = pathspec.GitIgnoreSpec.from_lines(lines) if lines else None
        return self._by_dir[folder]

    def forget(self, folder: Path) -> None:
        self._by_dir.pop(folder, None)

    def ignored(self, path: Path, is_dir: bool) -> bool:
        """Whether ``path`` (under the root) or one of its folders is ignored."""
        try:
            parts = path.relative_to(self.root).parts
        except ValueError:
            return True
        for depth in range(1, len(parts) + 1):
            sub_is_dir = is_dir if depth == len(parts) else True
            if parts[depth - 1] in SKIP_DIRS and sub_is_dir:
                return True
            if self._ignored_here(parts[:depth], sub_is_dir):
                return True
        return False

    def _ignored_here(self, parts: tuple[str, ...], is_dir: bool) -> bool:
        verdict = False
        for k in range(len(parts)):  # the root's .gitignore first: deeper ones win
            spec = self._spec(self.root.joinpath(*parts[:k]))
            if spec is not None:
                rel = "/".join(parts[k:]) + ("/" if is_dir else "")
                include = spec.check_file(rel).include
                if include is not None:
                    verdict = include
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
        self._lock = threading.RLock()  # roots and files
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
        with self._lock:
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
        prefix = root.as_uri() + "/"
        with self._lock:
            if self.roots.pop(root, None) is None:
                return
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
        with self._lock:
            self._refresh_locked(path)

    def _refresh_locked(self, path: Path) -> None:
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
        with self._lock:
            return {"folders": [str(r) for r in self.roots], "files": len(self.files)}

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)
        self._flusher.join(timeout=2)

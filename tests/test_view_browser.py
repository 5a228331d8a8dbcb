"""codespec view in a real headless Chromium (Debian's ``chromium``, driven over the
DevTools protocol: tests/cdp.py): a daemon on the real SmolLM2 model, the page opened,
three completions sent over the socket; the page shows each with as many tokens as the
daemon generated, coloured by the source that drafted them, and a screenshot of it lands
in the test's tmp dir. Their export, opened from a file, shows the same. A wrong token
gets 403 in the browser too; once closed, the page says it lost the daemon and nothing
listens on the port."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
from pathlib import Path
from urllib.parse import urlparse

import pytest
from cdp import Browser, chromium_path

from codespec.daemon.cli import main as cli_main
from codespec.daemon.client import Client
from codespec.daemon.view.service import install
from codespec.speculators.book import forget
from conftest import ServerThread, daemon_config

install()  # what codespec serve does: the daemons these tests start have the view
CHROMIUM = chromium_path()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium (Debian: apt-get install -y chromium) to run the page"
)

# the page's token colours (daemon/view/static/view.css), as the browser computes them
COLORS = {
    "prefill": "rgb(209, 213, 219)",
    "bonus": "rgb(243, 244, 246)",
    "ngram:index": "rgb(253, 230, 138)",
    "ngram:context": "rgb(187, 247, 208)",
    "ngram:prediction": "rgb(191, 219, 254)",
    "ngram:recent": "rgb(221, 214, 254)",
    "lookahead": "rgb(251, 207, 232)",
    "eagle": "rgb(254, 202, 202)",
}

FUNCS = "".join(
    f"def {name}(a, b):\n    return a {op} b\n\n\n"
    for name, op in (("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/"))
)
# each document ends where its own text says what comes next (context n-grams draft it)
DOCS = {
    "file:///view/one.py": FUNCS + "def add(a, b):\n    ",
    "file:///view/two.py": FUNCS + "def mul(a, b):\n    ",
    "file:///view/three.py": FUNCS + "def sub(a, b):\n    return",
}

# per card: its tokens by source, the swatch colours, and the token colours
DOM_QUERY = """(() => {
  const out = {};
  for (const card of document.querySelectorAll('#requests .req')) {
    const toks = [...card.querySelectorAll('.tok')];
    const counts = {}, colors = {};
    for (const t of toks) {
      const s = t.dataset.source;
      counts[s] = (counts[s] || 0) + 1;
      (colors[s] = colors[s] || new Set()).add(getComputedStyle(t).backgroundColor);
    }
    out[card.dataset.uri] = {
      tokens: Number(card.dataset.tokens), forwards: Number(card.dataset.forwards),
      shown: toks.filter(t => !t.classList.contains('cut')).length, counts,
      colors: Object.fromEntries(Object.entries(colors).map(([k, v]) => [k, [...v]])),
      text: toks.filter(t => !t.classList.contains('cut')).map(t => t.textContent).join(''),
      bars: card.querySelectorAll('.bar .seg').length,
    };
  }
  const swatches = {};
  for (const s of document.querySelectorAll('#legend .swatch[data-source]'))
    swatches[s.dataset.source] = getComputedStyle(s).backgroundColor;
  const charts = [...document.querySelectorAll('#charts .chart')].map(c => ({
    id: c.id, canvas: !!c.querySelector('canvas')}));
  return JSON.stringify({cards: out, swatches, charts});
})()"""


def complete(client: Client, uri: str, text: str) -> dict:
    client.request("open", {"uri": uri, "text": text, "version": 1, "language": "python"})
    lines = text.split("\n")
    pos = {"line": len(lines) - 1, "character": len(lines[-1])}
    r = client.request("complete", {"uri": uri, "position": pos, "speculation": "ngram"})
    assert r["stats"]["tokens"] > 0
    return r


async def drive(url: str, sock: str, shot: Path, profile: Path) -> tuple[dict, dict, str]:
    browser = Browser(str(CHROMIUM), profile)
    try:
        await browser.connect()
        await browser.navigate(url)
        await browser.wait_for("document.getElementById('conn').textContent === 'live'")
        with Client(sock, timeout=120) as c:
            results = {uri: complete(c, uri, text) for uri, text in DOCS.items()}
        await browser.wait_for("document.querySelectorAll('#requests .req').length === 3")
        await browser.wait_for("document.querySelectorAll('#charts canvas').length >= 6")
        dom = json.loads(await browser.js(DOM_QUERY))
        await browser.screenshot(shot)
        export = profile.parent / "export.html"  # the same three, from a file, offline
        assert cli_main(["view", "--socket", sock, "--export", str(export)]) == 0
        await browser.navigate(export.as_uri())
        await browser.wait_for("document.body.dataset.mode === 'export'")
        exported = json.loads(
            await browser.wait_for(
                "document.querySelectorAll('#charts canvas').length >= 6 && " + DOM_QUERY
            )
        )
        assert exported["cards"] == dom["cards"]
        parts = urlparse(url)
        await browser.navigate(f"http://127.0.0.1:{parts.port}/{'A' * 32}/")
        forbidden = await browser.wait_for("document.body && document.body.innerText")
        await browser.navigate(url)
        await browser.wait_for("document.querySelectorAll('#requests .req').length === 3")
        with Client(sock) as c:
            c.request("view", {"action": "close"})
        await browser.wait_for("document.getElementById('conn').className === 'lost'")
        return results, dom, forbidden
    finally:
        await browser.close()


def test_the_page_shows_three_completions_in_a_real_browser(real_engine, tmp_path):
    forget(real_engine)  # the policy starts from nothing measured, as a fresh daemon does
    srv = ServerThread(daemon_config(tmp_path), real_engine)
    try:
        with Client(srv.socket_path) as c:
            url = c.request("view", {"action": "open"})["url"]
        shot = tmp_path / "view.png"
        results, dom, forbidden = asyncio.run(
            drive(url, srv.socket_path, shot, tmp_path / "chromium")
        )
    finally:
        srv.stop()
    if os.environ.get("CODESPEC_VIEW_SCREENSHOT"):  # where to copy it (the README's picture)
        shutil.copyfile(shot, os.environ["CODESPEC_VIEW_SCREENSHOT"])
    assert "wrong token" in forbidden
    port = urlparse(url).port
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:4] == b"\x89PNG"
    assert {c["id"] for c in dom["charts"] if c["canvas"]} >= {
        "chart-tpf", "chart-acceptance", "chart-policy", "chart-latency", "chart-kv",
        "chart-backoff",
    }  # fmt: skip
    assert dom["swatches"] == COLORS
    drafted_any = 0
    for uri, r in results.items():
        card, st = dom["cards"][uri], r["stats"]
        assert card["tokens"] == card["shown"] == st["tokens"]
        assert card["forwards"] == st["target_forwards"]
        assert card["bars"] >= 2 + st["target_forwards"] - st["turns"]  # queue, prefill, steps
        counts = dict(card["counts"])
        prefilled = st["turns"] - st["lead_steps"]  # a lead step's turn has no prefill token
        assert counts.pop("prefill", 0) == prefilled
        assert counts.pop("bonus") == st["target_forwards"] - prefilled
        assert counts == {k: v for k, v in st["accepted"].items() if v}
        drafted_any += sum(counts.values())
        for source, seen in card["colors"].items():
            assert seen == [COLORS.get(source) or COLORS[source.split(":")[0]]], source
    assert drafted_any > 0  # the documents' own text was drafted and accepted somewhere

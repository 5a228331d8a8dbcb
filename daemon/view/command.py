"""``codespec view``: ask a running daemon for its live page, close it, or export it.

Owns: the subcommand's arguments and what it prints. The daemon does the work over the
socket (the ``view`` method, :mod:`.service`); ``--export`` writes the page with the last
requests and every asset inlined (:func:`.page.render`), a file that opens offline.
Must not touch: the daemon's state beyond that method.
"""

from __future__ import annotations

import argparse
import json
import webbrowser
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_parser(sub: Any, socket_help: str, func: Callable[[argparse.Namespace], int]) -> None:
    v = sub.add_parser("view", help="the daemon's live page of speculation at work")
    v.add_argument("--socket", default=None, help=socket_help)
    what = v.add_mutually_exclusive_group()
    what.add_argument("--close", action="store_true", help="stop the page and its recording")
    what.add_argument("--export", metavar="FILE.html", default=None,
                      help="write one self-contained page of the last requests")  # fmt: skip
    v.add_argument("--last", type=int, default=50, help="--export: how many requests (50)")
    v.add_argument("--open", action="store_true", help="also open the page in a browser")
    v.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    v.set_defaults(func=func)


def run(args: argparse.Namespace, client: Callable[[str | None], Any], error: type) -> int:
    """The subcommand: ``client(socket)`` connects (or raises ``error``)."""
    from codespec.daemon.client import DaemonError

    if args.last < 1:
        raise error(f"--last must be >= 1, got {args.last}")
    action = "close" if args.close else "export" if args.export else "open"
    params: dict[str, Any] = {"action": action}
    if action == "export":
        params["last"] = args.last
    with client(args.socket) as c:
        try:
            answer = c.request("view", params)
        except DaemonError as exc:
            if exc.code == "unknown_method":
                raise error("this daemon has no view; restart it with this codespec") from None
            raise error(exc.message) from None
    if action == "export":
        return _export(answer, Path(args.export), error)
    if args.json:
        print(json.dumps(answer))
    elif answer.get("open"):
        print(answer["url"])
    else:
        print("the view is closed")
    if args.open and answer.get("url"):
        webbrowser.open(answer["url"])
    return 0


def _export(data: dict[str, Any], path: Path, error: type) -> int:
    from codespec.daemon.view.page import render

    try:
        path.write_text(render(data), encoding="utf-8")
    except OSError as exc:
        raise error(f"cannot write {path}: {exc.strerror or exc}") from None
    print(f"{path}: {len(data.get('records', []))} requests")
    return 0

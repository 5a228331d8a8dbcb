"""The completion core: one editor request → daemon ``complete`` calls → proposals.

Owns: choosing the variants a request asks the daemon for (Automatic: one
greedy item, debounced per document; Invoked: several — the other line mode and
sampled alternatives), cancelling a document's older in-flight request when a
newer one arrives, and running each raw text through :mod:`.postprocess`.
Must not touch: LSP types (the server converts), sockets (the link owns them).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from codespec.lsp.debounce import Debouncer
from codespec.lsp.link import DaemonLink
from codespec.lsp.options import Options
from codespec.lsp.postprocess import CursorContext, Proposal, dedupe, process, wants_multiline

SAMPLED_TEMPERATURE = 0.7  # Invoked alternatives beyond the greedy ones
SINGLE_LINE_MAX_TOKENS = 48


@dataclass(frozen=True)
class CompletionQuery:
    """A cursor in a synced document; ``position`` is in UTF-16 units, as on the wire."""

    uri: str
    version: int | None
    position: dict[str, int]  # {"line", "character"}
    context: CursorContext
    invoked: bool  # the user asked (Invoked) rather than typed (Automatic)


@dataclass(frozen=True)
class Variant:
    multiline: bool
    temperature: float
    seed: int | None = None


@dataclass(frozen=True)
class Completion:
    proposal: Proposal
    stats: dict[str, Any]


def variants(query: CompletionQuery, options: Options) -> list[Variant]:
    """What to ask the daemon for; the first is the one an automatic request gets."""
    multiline = wants_multiline(query.context, options.multiline)
    out = [Variant(multiline, options.temperature)]
    if not query.invoked:
        return out
    if options.multiline == "auto" and not query.context.after.strip():
        out.append(Variant(not multiline, options.temperature))
    seed = 1
    while len(out) < options.invoked_items:
        out.append(Variant(multiline, max(options.temperature, SAMPLED_TEMPERATURE), seed))
        seed += 1
    return out[: options.invoked_items]


class Completer:
    def __init__(self, link: DaemonLink, options: Options, debouncer: Debouncer) -> None:
        self.link = link
        self.options = options
        self.debouncer = debouncer
        self._inflight: dict[str, asyncio.Task[Any]] = {}

    async def complete(self, query: CompletionQuery) -> list[Completion]:
        """Proposals for ``query`` ([] when superseded by a newer request for its document)."""
        if query.invoked:
            self.debouncer.supersede(query.uri)
        elif not await self.debouncer.wait(query.uri):
            return []
        older = self._inflight.get(query.uri)
        me = asyncio.current_task()
        if older is not None and older is not me and not older.done():
            older.cancel()  # its daemon request is cancelled by the link
        if me is not None:
            self._inflight[query.uri] = me
        try:
            return await self._run(query)
        finally:
            if self._inflight.get(query.uri) is me:
                del self._inflight[query.uri]

    async def _run(self, query: CompletionQuery) -> list[Completion]:
        wanted = variants(query, self.options)
        results = await asyncio.gather(
            *(self._one(query, v) for v in wanted), return_exceptions=True
        )
        completions: list[Completion] = []
        errors: list[BaseException] = []
        for variant, result in zip(wanted, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                errors.append(result)
                continue
            text = result.get("text", "")
            proposal = process(text, query.context, variant.multiline, self.options.max_lines)
            if proposal is not None:
                completions.append(Completion(proposal, dict(result.get("stats") or {})))
        if errors and len(errors) == len(wanted):
            raise errors[0]
        unique = dedupe([c.proposal for c in completions])
        by_proposal = {c.proposal: c for c in reversed(completions)}
        return [by_proposal[p] for p in unique]

    async def _one(self, query: CompletionQuery, variant: Variant) -> dict[str, Any]:
        params: dict[str, Any] = {
            "uri": query.uri,
            "position": query.position,
            "max_tokens": (
                self.options.max_tokens
                if variant.multiline
                else min(self.options.max_tokens, SINGLE_LINE_MAX_TOKENS)
            ),
            "temperature": variant.temperature,
            "multiline": variant.multiline,
            "speculation": self.options.speculation,
        }
        if query.version is not None:
            params["version"] = query.version
        if variant.seed is not None:
            params["seed"] = variant.seed
        return await self.link.request("complete", params, uri=query.uri)

    def forget(self, uri: str) -> None:
        self.debouncer.forget(uri)
        task = self._inflight.pop(uri, None)
        if task is not None and not task.done():
            task.cancel()

"""Initialization options, per-document debounce and acceptance counters of the language server."""

from __future__ import annotations

import asyncio

from codespec.lsp.acceptance import AcceptanceStats
from codespec.lsp.debounce import Debouncer
from codespec.lsp.options import Options, parse_options, to_wire

# -- options -------------------------------------------------------------------------


def test_missing_options_are_the_defaults_without_messages() -> None:
    assert parse_options(None) == (Options(), [])
    assert parse_options({}) == (Options(), [])
    assert parse_options([]) == (Options(), [])  # Neovim's setup({}): an empty Lua table


def test_camel_case_options_are_typed() -> None:
    opts, problems = parse_options(
        {"maxTokens": 32, "multiline": "never", "debounceMs": 10, "serveArgs": ["--device", "cpu"]}
    )
    assert problems == []
    assert opts.max_tokens == 32 and opts.multiline == "never" and opts.debounce_ms == 10
    assert opts.serve_args == ("--device", "cpu")


def test_bad_values_keep_their_defaults_and_say_why() -> None:
    opts, problems = parse_options(
        {"maxTokens": -3, "multiline": "sometimes", "temperature": "hot", "autostartDaemon": 1}
    )
    assert opts == Options()
    assert len(problems) == 4
    assert any("maxTokens" in p and "default 64" in p for p in problems)
    assert any("multiline" in p and "auto, always, never" in p for p in problems)


def test_one_bad_value_does_not_discard_the_good_ones() -> None:
    opts, problems = parse_options({"maxTokens": 16, "invokedItems": 0})
    assert opts.max_tokens == 16 and opts.invoked_items == Options().invoked_items
    assert len(problems) == 1 and "invokedItems" in problems[0]


def test_unknown_keys_and_non_objects_are_reported() -> None:
    _, problems = parse_options({"maxTokenz": 3})
    assert problems == ["codespec: unknown option 'maxTokenz' ignored"]
    opts, problems = parse_options(["maxTokens", 3])
    assert opts == Options() and "must be an object" in problems[0]


def test_whole_number_floats_are_accepted_for_integers() -> None:
    opts, problems = parse_options({"maxTokens": 40.0, "debounceMs": 2.5})
    assert opts.max_tokens == 40 and opts.debounce_ms == Options().debounce_ms
    assert len(problems) == 1


def test_wire_form_round_trips() -> None:
    opts, _ = parse_options({"maxTokens": 12, "serveArgs": ["--device", "cpu"]})
    assert parse_options(to_wire(opts)) == (opts, [])


# -- debounce (driven by an event, never by real time) --------------------------------


class GatedSleep:
    """A sleep that returns only when the test opens the gate; counts who is sleeping."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.sleeping = 0
        self.arrived = asyncio.Condition()

    async def __call__(self, delay: float) -> None:
        async with self.arrived:
            self.sleeping += 1
            self.arrived.notify_all()
        await self.gate.wait()

    async def wait_for_sleepers(self, n: int) -> None:
        async with self.arrived:
            await self.arrived.wait_for(lambda: self.sleeping >= n)


def test_only_the_newest_wait_per_document_goes_on() -> None:
    async def scenario() -> list[bool]:
        sleep = GatedSleep()
        debouncer = Debouncer(0.2, sleep=sleep)
        a1 = asyncio.ensure_future(debouncer.wait("file:///a.py"))
        await sleep.wait_for_sleepers(1)
        a2 = asyncio.ensure_future(debouncer.wait("file:///a.py"))
        b1 = asyncio.ensure_future(debouncer.wait("file:///b.py"))
        await sleep.wait_for_sleepers(3)
        sleep.gate.set()
        return list(await asyncio.gather(a1, a2, b1))

    assert asyncio.run(scenario()) == [False, True, True]


def test_an_invoked_request_supersedes_a_waiting_automatic_one() -> None:
    async def scenario() -> bool:
        sleep = GatedSleep()
        debouncer = Debouncer(0.2, sleep=sleep)
        auto = asyncio.ensure_future(debouncer.wait("file:///a.py"))
        await sleep.wait_for_sleepers(1)
        debouncer.supersede("file:///a.py")  # what an Invoked request does, without waiting
        sleep.gate.set()
        return await auto

    assert asyncio.run(scenario()) is False


def test_closing_a_document_releases_its_waits_as_superseded() -> None:
    async def scenario() -> bool:
        sleep = GatedSleep()
        debouncer = Debouncer(0.2, sleep=sleep)
        w = asyncio.ensure_future(debouncer.wait("file:///a.py"))
        await sleep.wait_for_sleepers(1)
        debouncer.forget("file:///a.py")
        sleep.gate.set()
        return await w

    assert asyncio.run(scenario()) is False


def test_zero_delay_never_sleeps() -> None:
    async def never(delay: float) -> None:
        raise AssertionError("slept")

    assert asyncio.run(Debouncer(0.0, sleep=never).wait("file:///a.py")) is True


# -- acceptance counters ---------------------------------------------------------------


def test_acceptance_counts_per_proposer() -> None:
    stats = AcceptanceStats()
    a = stats.record("return x", {"accepted": {"ngram": 3, "eagle": 0}, "tokens_per_s": 100.0})
    b = stats.record("pass", {"accepted": {"eagle": 2}, "tokens_per_s": 50.0})
    assert stats.did_show(a) and stats.did_show(b)
    assert not stats.did_show(a)  # shown once
    assert stats.did_accept(a, 6)
    assert not stats.did_accept(a, 6)  # accepted once
    snap = stats.snapshot()
    assert snap["shown"] == 2 and snap["accepted"] == 1 and snap["acceptance_rate"] == 0.5
    assert snap["accepted_chars"] == 6 and snap["shown_chars"] == len("return x") + len("pass")
    assert snap["per_proposer"] == {
        "eagle": {"shown": 1, "accepted": 0, "draft_tokens": 0},
        "ngram": {"shown": 1, "accepted": 1, "draft_tokens": 3},
    }
    assert snap["tokens_per_s"] == 75.0


def test_accepting_an_unreported_item_counts_it_as_shown_and_unknown_ids_are_ignored() -> None:
    stats = AcceptanceStats(capacity=1)
    old = stats.record("a", None)
    new = stats.record("bb", None)
    assert not stats.did_accept(old)  # evicted
    assert stats.did_accept(new)
    assert stats.snapshot()["shown"] == 1 and stats.snapshot()["accepted_chars"] == 2


# -- what a request asks the daemon for --------------------------------------------------


def _query(before: str, after: str, invoked: bool):
    from codespec.lsp.completion import CompletionQuery
    from codespec.lsp.postprocess import CursorContext

    return CompletionQuery(
        "file:///a.py", 1, {"line": 0, "character": 0}, CursorContext(before, after), invoked
    )


def test_automatic_requests_ask_for_one_greedy_item() -> None:
    from codespec.lsp.completion import Variant, variants

    assert variants(_query("def f():", "", False), Options()) == [Variant(True, 0.0)]
    assert variants(_query("x = f(", ")", False), Options()) == [Variant(False, 0.0)]


def test_invoked_requests_add_the_other_line_mode_and_sampled_alternatives() -> None:
    from codespec.lsp.completion import Variant, variants

    got = variants(_query("def f():", "", True), Options(invoked_items=4))
    assert got == [
        Variant(True, 0.0),
        Variant(False, 0.0),
        Variant(True, 0.7, seed=1),
        Variant(True, 0.7, seed=2),
    ]
    # Text right of the cursor: single-line only, alternatives are sampled.
    got = variants(_query("x = f(", ")", True), Options(invoked_items=2))
    assert got == [Variant(False, 0.0), Variant(False, 0.7, seed=1)]


class GatedLink:
    """A daemon link whose requests wait for the test's gate; counts cancellations."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.calls: list[str] = []
        self.cancelled: list[int] = []
        self.arrived = asyncio.Condition()

    async def request(self, method: str, params: dict, on_delta=None, uri=None) -> dict:
        n = len(self.calls)
        async with self.arrived:
            self.calls.append(params["uri"])
            self.arrived.notify_all()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.append(n)
            raise
        return {"text": f"value_{n}", "stats": {}}

    async def wait_for_calls(self, n: int) -> None:
        async with self.arrived:
            await self.arrived.wait_for(lambda: len(self.calls) >= n)


def _query_at(uri: str):
    from codespec.lsp.completion import CompletionQuery
    from codespec.lsp.postprocess import CursorContext

    return CompletionQuery(uri, 1, {"line": 0, "character": 4}, CursorContext("x = ", ""), False)


def test_a_newer_request_cancels_the_older_one_in_flight_for_its_document() -> None:
    """Request 0 (a.py) is waiting for the daemon when request 1 (a.py) arrives: 0 is
    cancelled (its daemon request with it), 1 is answered; request 2 (b.py) is untouched."""
    from codespec.lsp.completion import Completer

    async def scenario() -> tuple:
        link = GatedLink()
        completer = Completer(link, Options(debounce_ms=0), Debouncer(0.0))  # type: ignore[arg-type]
        older = asyncio.ensure_future(completer.complete(_query_at("file:///a.py")))
        await link.wait_for_calls(1)
        newer = asyncio.ensure_future(completer.complete(_query_at("file:///a.py")))
        other = asyncio.ensure_future(completer.complete(_query_at("file:///b.py")))
        await link.wait_for_calls(3)
        link.gate.set()
        results = await asyncio.gather(older, newer, other, return_exceptions=True)
        return link, results

    link, (older, newer, other) = asyncio.run(scenario())
    assert isinstance(older, asyncio.CancelledError)
    assert link.cancelled == [0]
    assert [c.proposal.text for c in newer] == ["value_1"]
    assert [c.proposal.text for c in other] == ["value_2"]

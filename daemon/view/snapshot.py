"""The view's records as the page reads them: JSON-ready dicts with the tokens' text.

Owns: turning a finished :class:`~.recorder.Record` into the page's form (each token's
text and source, rejected drafts as text, the time bar's segments in ms from the
request's arrival) once per record, and the daemon-wide status the charts read
(index size, KV slots, the policy, the load back-off's thresholds). Runs on the event
loop, never on the worker thread. Must not touch: the scheduler, the engine's state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from codespec.daemon.view.recorder import Record, Turn

if TYPE_CHECKING:
    from codespec.daemon.service.daemon import Server

WINDOW = 8  # tokens decoded before each one, so a character split over tokens comes out whole

Decode = Callable[[Sequence[int]], str]


def pieces(decode: Decode, ids: Sequence[int]) -> list[str]:
    """Each token's text in ``ids``: what it adds to the text of the ones before it (a
    character split over several tokens belongs to the token that completes it)."""
    out = []
    for i in range(len(ids)):
        lo = max(0, i - WINDOW)
        before = decode(ids[lo:i]).rstrip("\ufffd") if i > lo else ""
        both = decode(ids[lo : i + 1]).rstrip("\ufffd")
        out.append(both[len(before) :] if both.startswith(before) else both)
    return out


def _rows(rec: Record, stop_ids: set[int]) -> list[tuple[int | None, str, int, bool]]:
    """(id, source, step number or -1, cut) per token the engine produced, in order: each
    turn's prefill token (none where its first step was rooted at the prompt's last
    token: ``Turn.lead``), then each step's accepted tokens and bonus. A token that is not
    in the output (a stop token, past ``max_tokens``) is ``cut``; output no step noted is
    the ``target``'s."""
    rows: list[tuple[int | None, str, int, bool]] = []
    out, i, n = rec.out_ids, 0, 0
    for turn in rec.turns:
        if turn.lead:
            pass  # its first token came from its first step
        elif i < len(out):
            rows.append((out[i], "prefill", -1, False))
            i += 1
        elif not turn.steps and rec.finish == "stop":
            rows.append((None, "prefill", -1, True))  # the prefill's token was a stop token
        for st in turn.steps:
            for tok, src in zip(st.tokens, st.sources, strict=True):
                shown = i < len(out) and out[i] == tok and tok not in stop_ids
                rows.append((tok, src, n, not shown))
                i += shown
            n += 1
    # tokens no step noted: an engine that takes no proposer (a remote backend) decoded them
    rows += [(t, "target", -1, False) for t in out[i:]]
    return rows


def _bars(rec: Record) -> list[list[Any]]:
    """The time bar: ``[kind, start ms, end ms]`` from the request's arrival."""

    def ms(t: float) -> float:
        return round((t - rec.submitted) * 1000, 3)

    bars: list[list[Any]] = [["queue", 0.0, ms(rec.started or rec.finished)]]
    for k, turn in enumerate(rec.turns):
        end = rec.turns[k + 1].t_begin if k + 1 < len(rec.turns) else rec.finished
        first = turn.steps[0].t_propose if turn.steps and turn.steps[0].t_propose else end
        bars.append(["prefill", ms(turn.t_begin), ms(first)])
        for j, st in enumerate(turn.steps):
            nxt = turn.steps[j + 1].t_propose if j + 1 < len(turn.steps) else end
            if st.t_drafted > st.t_propose:
                bars.append(["draft", ms(st.t_propose), ms(st.t_drafted)])
            bars.append(["verify", ms(st.t_observed - st.forward_ms / 1000), ms(st.t_observed)])
            bars.append(["detokenize", ms(st.t_observed), ms(max(nxt, st.t_observed))])
    return bars


def _steps(rec: Record, decode: Decode) -> list[dict[str, Any]]:
    out = []
    for k, turn in enumerate(rec.turns):
        for st in turn.steps:
            out.append({
                "turn": k,
                "source": st.source,
                "choice": st.choice,
                "nodes": st.nodes,
                "accepted": len(st.tokens) - 1,
                "forward_ms": round(st.forward_ms, 3),
                "rejected": decode(st.rejected) if st.rejected else "",
            })  # fmt: skip
    return out


def _turn(t: Turn) -> dict[str, Any]:
    return {"speculation": t.speculation, "max_draft": t.max_draft, "active": t.active}


def record_json(rec: Record, decode: Decode, stop_ids: set[int]) -> dict[str, Any]:
    """``rec`` as the page reads it (made once: a finished record does not change)."""
    if rec.cache is not None:
        return rec.cache
    rows = _rows(rec, stop_ids)
    shown = [r[0] for r in rows if not r[3] and r[0] is not None]
    texts = iter(pieces(decode, shown))
    tokens = []
    for tok, src, step, cut in rows:
        if cut:
            text = decode([tok]) if tok is not None else ""
        else:
            text = next(texts)
        tokens.append([text, src, step, int(cut)])
    s = rec.stats
    first = rec.first_delta or rec.finished
    rec.cache = {
        "seq": rec.seq,
        "kind": rec.kind,
        "uri": rec.uri or "",
        "requested": rec.requested,
        "finish": rec.finish,
        "prompt_tokens": s.get("prompt_tokens", 0),
        "cached_tokens": s.get("cached_tokens", 0),
        "prompt_tail": decode(rec.prompt_ids),
        "tokens": tokens,
        "steps": _steps(rec, decode),
        "turns": [_turn(t) for t in rec.turns],
        "forwards": s.get("target_forwards", 0),
        "drafted": s.get("drafted", {}),
        "accepted": s.get("accepted", {}),
        "times": {
            "queue_ms": round(((rec.started or rec.finished) - rec.submitted) * 1000, 3),
            "prefill_ms": round(s.get("prefill_ms", 0.0), 3),
            "first_ms": round((first - rec.submitted) * 1000, 3),
            "final_ms": round((rec.finished - rec.submitted) * 1000, 3),
        },
        "bars": _bars(rec),
    }
    return rec.cache


def status_json(srv: Server) -> dict[str, Any]:
    """The daemon-wide figures the charts read: requests in flight, the index's size, KV
    slots, the policy's measurements, and the back-off's thresholds."""
    from codespec.speculators.policy import summary as policy_summary

    sched, cfg = srv.scheduler, srv.config.speculation
    index = srv.index_stats() if srv.index is not None else {}
    engine = srv.engine
    return {
        "time": time.time(),
        "in_flight": sched.active if sched is not None else 0,
        "served": sched.served if sched is not None else 0,
        "index": {k: index.get(k, 0) for k in ("documents", "tokens", "bytes")},
        "kv_slots": getattr(engine, "max_slots", 0),
        "policy": policy_summary(engine),
        "speculation": {
            "default": cfg.default,
            "max_draft": cfg.max_draft,
            "shorten_at": cfg.shorten_at,
            "off_at": cfg.off_at,
        },
        "model": getattr(engine, "model_name", ""),
    }

"""Running on after a completion: the model's next tokens decoded while the engine is idle.

Owns :func:`run_on`. A one-line completion stops at the line's end, so the model's
choices for the next line were never computed: Enter, or accepting the ghost text and
going on, then asks for them with a forward of its own. Decoding a few greedy tokens
after the finished completion, while no request waits, leaves those choices beside the
cache, where the next request recalls them (:mod:`codespec.daemon.engine.choices`) —
llama.vim's speculative FIM, inside the engine. The tokens go to no one; a request that
comes in waits for the step in flight (one plain forward), then the run stops.

Must not touch: requests, their text or their stats, sockets, documents. The scheduler
calls it on its worker thread, under the engine's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from codespec.daemon.engine.engine import GenParams
from codespec.daemon.engine.protocols import DecodingEngine

log = logging.getLogger("codespec.daemon")


def after_completion(
    engine: DecodingEngine, tokens: int, ids: Sequence[int], waiting: Callable[[], bool]
) -> None:
    """:func:`run_on` after a finished one-line completion (``ids``: its prompt and output)
    under the engine's lock, where ``tokens`` (``[speculation] run_on_tokens``) asks for it
    and the engine is the daemon's own. A guess, like a warm-up: a failure is logged and
    the cache reset, nothing else."""
    if not tokens or getattr(engine, "remote", False):
        return
    try:
        with engine.lock:
            run_on(engine, ids, tokens, waiting)
    except Exception:
        log.exception("running on after a completion failed")
        engine.reset_cache()


def run_on(
    engine: DecodingEngine, prompt_ids: Sequence[int], tokens: int, waiting: Callable[[], bool]
) -> int:
    """Decode up to ``tokens`` greedy tokens after ``prompt_ids`` (a finished request's
    prompt and output) with plain steps, stopping before a step when ``waiting()`` says a
    request waits, and at a stop token or the context's end. The tokens decoded."""
    if tokens <= 0 or waiting():
        return 0
    params = GenParams(max_tokens=tokens, recall=True)  # no proposer: plain steps
    n = 0
    gen = engine.stream(list(prompt_ids), params)
    try:
        for step in gen:
            n += len(step.token_ids)
            if step.done or waiting():
                break
    except ValueError:  # no room left in the context
        pass
    finally:
        gen.close()
    return n

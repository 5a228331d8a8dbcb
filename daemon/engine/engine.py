"""The decoding engine: a resident model, its KV caches, and the speculative decode loop.

The engine speaks token ids: prompt ids in, generated ids out, step by step. It
knows nothing about text — stop strings, detokenization and token healing's text
live in :mod:`codespec.daemon.text`; the healing *constraint* reaches it as a mask
over ids. It holds the tokenizer only so callers find it beside the model.

One function per part of a request:

- :meth:`Engine.prefill`: feed the prompt after its longest cached prefix (cache slot
  chosen by :class:`~codespec.daemon.engine.slots.CacheSlots`); the first token's logits.
- :meth:`Engine.verify_step`: one target forward over ``[root] + draft`` (a plain step
  when the draft is empty), :func:`~codespec.speculators.verify.verify` → the accepted
  draft nodes and the BONUS token, ``runner.keep()`` drops the rejected branches.
- :meth:`Engine.stream`: the loop — propose, verify, yield a :class:`Step`, observe —
  with the id-level stop rules (a stop token, ``max_tokens``, cancellation). A prompt
  cached but its last token starts with a *lead step* (a verify step rooted at that
  token, its draft proposed from the prompt) instead of a prefill; a greedy prompt cached
  whole, with the model's own choices after it from an earlier request (typing along the
  ghost text), starts with those choices, read back from the cache slot with no forward
  (``GenParams.recall``).

State other layers keep per loaded model is held here (the engine never reads it):
:attr:`Engine.speculator_state` (the policy's memory, lookahead's pools, EAGLE heads:
:class:`~codespec.speculators.target.SpeculatorState`), :attr:`Engine.token_texts` (token
healing's table), :attr:`Engine.prefix_encoder` (the per-keystroke prefix tokenization).

Must not touch: sockets, documents, editors, text. Not thread-safe: the daemon
serialises access to it (``Engine.lock``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Generator
from functools import cached_property

import torch

from codespec.daemon.engine import models
from codespec.daemon.engine.choices import Choices
from codespec.daemon.engine.loading import (
    ModelLoadError,
    build_cpu_kernels_meanwhile,
    load_runner,
    one_line,
    pick_device,
    resolve_model_path,
)
from codespec.daemon.engine.request import (
    Constraint,
    GenParams,
    Stats,
    Step,
    Verified,
    cut,
    possible,
    row_masks,
)
from codespec.daemon.engine.slots import CacheSlots
from codespec.daemon.engine.target import ModelTarget
from codespec.daemon.engine.tokenizer import load as load_tokenizer
from codespec.daemon.text.healing import TokenTexts
from codespec.daemon.text.prefix_tokens import PrefixEncoder
from codespec.daemon.text.specials import FimTokens, find_fim, stop_token_ids
from codespec.speculators.draft import Draft, Proposer, RequestInfo, StepResult
from codespec.speculators.target import SpeculatorState
from codespec.speculators.verify import verify

__all__ = ["Constraint", "Engine", "GenParams", "ModelLoadError", "Stats", "Step", "load_runner"]

# The lean stack's LM head under Runner.forward's ``greedy``: its first chunk of logit rows
# (stack.cpp's STOP_ROWS: the root and three nodes), then the rest in a second pass over
# the head's weights (a walk ending inside the first chunk saves the rest of the head's
# rows). The stop is asked for only while the chance of going past the first chunk is
# under STOP_BELOW, where the saving and the second pass break even (BENCHMARKS.md).
HEAD_FIRST_ROWS = 4
STOP_BELOW = 0.65
# A warm-up's tokens a forward where the runner's forward stops between layers (a request
# behind it waits for a layer): the lean stack's best prefill rate on the CPU (0.5B, 2
# threads, 200-1,400 cached: 16 / 32 / 64 / 128 / 256 tokens 283 / 362 / 398 / 419 / 398
# tokens/s), and a layer of it ~12 ms.
STOPPABLE_CHUNK = 128


class Engine(ModelTarget):
    """A resident model with its KV caches; serves one request at a time. Proposers see
    it as a :class:`~codespec.speculators.target.TargetModel` (:class:`ModelTarget`)."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        device: str = "auto",
        runner: str = "auto",
        max_length: int | None = None,
        max_slots: int = 4,
        max_run_tokens: int = 0,
    ) -> None:
        self.device = pick_device(device)
        if self.device.type == "cpu" and runner != "hf":
            build_cpu_kernels_meanwhile()
        self.model_path = resolve_model_path(model)
        try:
            self.tokenizer = load_tokenizer(self.model_path)  # without transformers where it can
        except Exception as exc:
            raise ModelLoadError(f"cannot load the tokenizer: {one_line(exc)}") from exc
        self.runner, self.config = load_runner(self.model_path, self.device, runner, max_length)
        self.max_length = self.runner.max_length
        vocab = self.tokenizer.get_vocab()
        self.fim: FimTokens | None = find_fim(vocab)
        self.stop_ids = stop_token_ids(vocab, self.tokenizer.eos_token_id, self.fim)
        self.slots = CacheSlots(self.runner, max_slots, max_run_tokens)
        # the taps the last request's prefill kept (its proposers read them): a warm-up
        # keeps them too, else that request's successor re-feeds every warmed token
        self.warm_taps: tuple[int, ...] = ()
        self.lock = threading.Lock()
        # what speculation keeps on this model across requests (codespec.speculators)
        self.speculator_state = SpeculatorState()

    # -- the tokenizer, beside the model (the decode loop never uses it) -------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added; callers cut prompts to fit)."""
        return self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @cached_property
    def token_texts(self) -> TokenTexts:
        """Every token's text, for token healing (:mod:`codespec.daemon.text.healing`):
        built on first use (~0.2 s; the daemon builds it at start), kept with the engine."""
        return TokenTexts(self.tokenizer, self.runner.vocab_size)

    @cached_property
    def prefix_encoder(self) -> PrefixEncoder:
        """The text before a cursor, encoded (:mod:`codespec.daemon.text.prefix_tokens`)."""
        return PrefixEncoder(self.tokenizer)

    @property
    def model_name(self) -> str:
        return models.display_name(self.model_path)

    @property
    def max_slots(self) -> int:
        return self.slots.max_slots

    @property
    def max_run_tokens(self) -> int:
        """Tokens of file runs the engine keeps (0: it keeps none)."""
        return self.slots.max_run_tokens

    def runs_stats(self) -> dict[str, int]:
        """The file runs' tokens now, their most, and the requests that started from one."""
        s = self.slots
        return {"tokens": s.run_tokens, "max_tokens": s.max_run_tokens, "forks": s.forks}

    @property
    def cached_ids(self) -> list[int]:
        return self.slots.cached_ids

    def prompt_hidden(self, n: int) -> torch.Tensor:
        """Tapped hidden states of the first ``n`` cached positions, ``(n, len(taps), H)``."""
        return self.slots.prompt_hidden(n)

    def reset_cache(self) -> None:
        """Forget every cached prefix, in every slot (benchmarks start each run cold)."""
        self.slots.reset()

    # -- one function per part of a request ----------------------------------------------
    def prefill(self, prompt: list[int], taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, int]:
        """Feed ``prompt`` after its longest cached prefix: ``(last row's logits (1, V),
        prompt tokens reused)``. With ``taps``, every prompt position's tapped hidden
        states end up in :meth:`prompt_hidden` (reused positions included)."""
        self.slots.pick(prompt)
        common = self._reuse(prompt, taps)
        return self._feed(prompt, common, taps), common

    def _reuse(self, prompt: list[int], taps: tuple[int, ...]) -> int:
        """Cut the active cache slot (the caller picked it: ``slots.pick``) to the prompt's
        reusable prefix (never the whole prompt): how many tokens it keeps. ``taps``
        become :attr:`warm_taps`."""
        self.warm_taps = taps
        common = self.slots.reusable(prompt, taps)
        self.runner.truncate(common)
        return common

    def _feed(self, prompt: list[int], common: int, taps: tuple[int, ...]) -> torch.Tensor:
        """Feed ``prompt[common:]`` after the ``common`` cached tokens: the last row's logits."""
        out = self.runner.forward(prompt[common:], taps=taps, last_only=True)
        self.slots.record_prompt(prompt, common, out.hidden if taps else None)
        return out.logits[-1:]

    def cached_tokens(self, prompt: list[int]) -> int:
        """Leading ``prompt`` tokens some cache slot holds (what a request with it would
        not prefill)."""
        return self.slots.cached(prompt)

    def warm(
        self, prompt: list[int], yield_to: Callable[[], bool], chunk: int = 128, run: bool = False
    ) -> int:
        """Prefill ``prompt`` but its last token into its cache slot ahead of a request,
        ``chunk`` tokens at a time, stopping early when ``yield_to()`` says a request
        waits (what was fed stays cached). A runner whose forward stops part-way
        (``interrupt``) feeds :data:`STOPPABLE_CHUNK` where larger (a faster rate) and stops
        mid-chunk when :meth:`interrupt` is called (the chunk in flight is dropped).
        Returns the prompt tokens now cached. The positions fed keep :attr:`warm_taps`,
        the taps the last request kept, so a request like it reuses them (one with taps
        reuses only positions that have them). With ``run``, ``prompt`` is a file run,
        kept in a slot requests copy from instead of writing into
        (:mod:`~codespec.daemon.engine.slots`)."""
        taps = self.warm_taps
        self.slots.pick(prompt, run=run)
        common = self.slots.reusable(prompt, taps)
        if common >= len(prompt) - 1:  # nothing to feed: keep what follows (a recall's)
            return common
        self.runner.truncate(common)
        self.slots.record_prompt(prompt[:common], common, None)  # even if nothing is fed
        pos, end = common, len(prompt) - 1
        flag = getattr(self.runner, "interrupt", None)
        if flag is not None:  # a request waits for a layer, not the chunk
            chunk = max(chunk, STOPPABLE_CHUNK)
        while pos < end:
            if flag is not None:
                flag.clear()  # before yield_to: a request queued after it sets it again
            if yield_to():
                break
            n = min(chunk, end - pos)
            ids = prompt[pos : pos + n]
            if flag is None:
                out = self.runner.forward(ids, taps=taps, last_only=True)
            else:
                out = self.runner.forward_unless_interrupted(ids, taps)  # type: ignore[attr-defined]
                if out is None:
                    break  # a request came in: it waited for a layer, not the whole chunk
            self.slots.record_prompt(prompt[: pos + n], pos, out.hidden if taps else None)
            pos += n
        return pos

    def interrupt(self) -> None:
        """Stop a warm-up's forward in flight after its current layer (a request is
        queued: :meth:`warm` returns at once); nothing when no forward can stop part-way."""
        flag = getattr(self.runner, "interrupt", None)
        if flag is not None:
            flag.set()

    def verify_step(
        self,
        root: int,
        draft: Draft | None,
        params: GenParams,
        gen: torch.Generator | None,
        taps: tuple[int, ...] = (),
        done: list[int] | None = None,
    ) -> Verified:
        """One target forward over ``[root] + draft``, verified; the cache keeps the root
        and the accepted nodes. ``done``: the ids generated before ``root``'s row, for
        ``params.constraint`` (each row's logits are masked as the ids on its path allow,
        so the target's choice at every row is what constrained plain decoding takes)."""
        ids, parents = [root], None
        if draft is not None and len(draft):
            ids += draft.tokens
            assert draft.parents is not None
            if not draft.is_chain:
                parents = [-1] + [p + 1 for p in draft.parents]
        masks = row_masks(params.constraint, done or [], draft)
        # a greedy draft nobody reads the other rows of: the runner may stop its LM head at
        # the row where verification's walk ends (the rows after it are never read), when
        # the walk is likely to end inside the head's first chunk of rows (STOP_BELOW); its
        # walk follows the unmasked rows, so not under a constraint
        greedy = (
            params.temperature == 0 and not masks and draft is not None and not draft.reads_rows
        )
        if greedy:
            assert draft is not None
            deep = draft.past(HEAD_FIRST_ROWS - 1)
            greedy = deep is None or deep < STOP_BELOW
        t0 = time.perf_counter()
        fwd = self.runner.forward(ids, parents, taps=taps, greedy=greedy)  # (<= T, V)
        logits, best = fwd.logits, fwd.best if params.temperature <= 0 else None
        free: dict[int, int] = {}  # a masked row's unconstrained choice, for recall
        if masks:
            logits = logits.clone()
            for row, mask in masks.items():
                if params.temperature <= 0:
                    free[row] = self._choice(logits[row : row + 1], params)
                logits[row].masked_fill_(~mask, float("-inf"))
            best = None
        if best is None:
            best = self._argmax(logits, params)
        accepted, bonus = verify(draft, logits, params.temperature, params.top_p, gen, best)
        ms = (time.perf_counter() - t0) * 1000
        kept = [0] + [a + 1 for a in accepted]
        base = self.runner.length - len(ids)
        self.runner.keep(kept)
        tokens = [root] + [draft.tokens[a] for a in accepted] if draft is not None else [root]
        choices = None
        if params.temperature <= 0:  # each kept row's choice: the next kept token, the bonus
            chosen = list(zip(kept, [*tokens[1:], bonus], strict=True))
            choices = Choices([free.get(row, tok) for row, tok in chosen],
                              {k: (masks[row], tok) for k, (row, tok) in enumerate(chosen)
                               if row in masks})  # fmt: skip
        self.slots.record_step(base, tokens, fwd.hidden, kept, choices)
        return Verified(accepted, bonus, logits, fwd.hidden, ms, len(ids))

    def _argmax(self, logits: torch.Tensor, params: GenParams) -> list[int] | None:
        """Greedy verification's row argmaxes from the runner's own kernel, where it has
        one (the lean runner's stack: one pass a row, faster than torch.argmax over a large
        vocabulary); None: verification takes torch's."""
        fn = getattr(self.runner, "argmax_rows", None)
        return fn(logits) if fn is not None and params.temperature <= 0 else None

    def _check(self, prompt_ids: list[int], params: GenParams) -> int:
        """The request's ``max_tokens`` as the context allows; ValueError when it cannot run."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_length:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the model takes at most "
                f"{self.max_length - 1}"
            )
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        return min(params.max_tokens, self.max_length - len(prompt_ids))

    def _draft(self, proposer: Proposer | None, context: list[int], budget: int,
               params: GenParams, done: list[int]) -> Draft | None:  # fmt: skip
        """The proposer's draft, at most ``budget`` nodes, less what none could accept."""
        if proposer is None or budget <= 0:
            return None
        draft = proposer.propose(context, budget)
        draft = draft.truncated(budget) if draft is not None and len(draft) > budget else draft
        return possible(draft, params.constraint, done)

    def stream(
        self,
        prompt_ids: list[int],
        params: GenParams,
        proposer: Proposer | None = None,
        info: RequestInfo | None = None,
        cancel: threading.Event | None = None,
    ) -> Generator[Step, None, None]:
        """Generate from ``prompt_ids``, yielding one :class:`Step` per target forward.

        Ends at a stop token (``stop``), ``max_tokens`` (``length``) or ``cancel``
        (``cancelled``); a caller that stops reading (a stop string, preemption) closes
        the generator.
        """
        max_tokens = self._check(prompt_ids, params)
        gen = params.generator()
        prompt = list(prompt_ids)
        t0 = time.perf_counter()
        if proposer is not None:
            proposer.begin(info or RequestInfo(prompt, temperature=params.temperature,
                                               max_tokens=max_tokens))  # fmt: skip
        taps: tuple[int, ...] = tuple(getattr(proposer, "taps", ()) or ())
        self.slots.pick(prompt)
        recalled = self._recall(prompt, params, taps, max_tokens)
        common = len(prompt) - 1 if recalled else self._reuse(prompt, taps)
        stats = Stats(prompt_tokens=len(prompt), cached_tokens=common)
        out: list[int] = []
        if recalled:  # the model's own choices after this prompt, from the cache slot
            stats.recalled = len(recalled)
            new, accepted_n, drafted_n = recalled, 0, 0
        elif params.lead_step and proposer is not None and not taps and common == len(prompt) - 1:
            # all but the prompt's last token cached (a keystroke): that token is the first
            # step's root and the draft starts from the prompt, so the forward that would
            # only have fed it verifies a draft too (a proposer reading taps gets its
            # hidden states from a prefill instead)
            self.slots.record_prompt(prompt[:-1], common, None)
            stats.prefill_ms = (time.perf_counter() - t0) * 1000
            stats.lead_steps = 1
            new, accepted_n, drafted_n = self._step(
                prompt[-1], prompt, out, params, proposer, gen, taps, max_tokens, stats, lead=True
            )
        else:
            first = self._first(prompt, common, params, proposer, taps, gen)
            stats.target_forwards = 1
            stats.prefill_ms = (time.perf_counter() - t0) * 1000
            new, accepted_n, drafted_n = [first], 0, 0
        while True:
            new, finish = cut(new, out, max_tokens, self.stop_ids)
            stats.tokens = len(out) + (1 if finish == "stop" else 0)
            if not finish and cancel is not None and cancel.is_set():
                finish = "cancelled"
            stats.total_ms = (time.perf_counter() - t0) * 1000
            stats.ttft_ms = stats.ttft_ms or stats.total_ms
            stats.finish_reason = finish
            yield Step(new, accepted_n, drafted_n, stats, done=bool(finish))
            if finish:
                return
            new, accepted_n, drafted_n = self._step(new[-1], prompt + out, out, params, proposer,
                                                    gen, taps, max_tokens, stats)  # fmt: skip

    def _recall(
        self, prompt: list[int], params: GenParams, taps: tuple[int, ...], max_tokens: int
    ) -> list[int]:
        """The model's choices after ``prompt`` in the active slot (:mod:`.choices`) that holds
        it whole (greedy, ``params.recall``, no taps), each under ``params.constraint``'s mask:
        through a stop token, at most ``max_tokens``; all but the last stay cached."""
        if not params.recall or params.temperature > 0 or taps:
            return []
        held = self.slots.holds(prompt)
        ids, choices, out, i = self.slots.cached_ids, self.slots.choices, [], len(prompt) - 1
        while held and len(out) < max_tokens:
            mask = params.constraint(out) if params.constraint is not None else None
            tok = choices.at(i, mask)
            if tok < 0:
                break
            out.append(tok)
            if tok in self.stop_ids or i + 1 >= held or ids[i + 1] != tok:
                break
            i += 1
        if out:
            self.slots.keep(len(prompt) + len(out) - 1)
        return out

    def _step(
        self,
        root: int,
        context: list[int],
        out: list[int],
        params: GenParams,
        proposer: Proposer | None,
        gen: torch.Generator | None,
        taps: tuple[int, ...],
        max_tokens: int,
        stats: Stats,
        lead: bool = False,
    ) -> tuple[list[int], int, int]:
        """Propose from ``context`` (ending at ``root``), verify, let the proposer observe:
        ``(the step's new tokens, accepted, drafted)``; ``out``: the ids generated so far;
        ``lead``: ``root`` is the prompt's last token (no prefill gave a first token)."""
        budget = min(params.max_draft, max_tokens - len(out) - 1,
                     self.max_length - self.runner.length - 2)  # fmt: skip
        draft = self._draft(proposer, context, budget, params, out)
        v = self.verify_step(root, draft, params, gen, taps, out)
        stats.target_forwards += 1
        stats.decode_steps += 1
        if draft is not None:
            stats.count_draft(draft, v.accepted)
        new = [draft.tokens[a] for a in v.accepted] if draft is not None else []
        new.append(v.bonus)
        if proposer is not None:
            proposer.observe(StepResult(draft, v.accepted, v.bonus, list(new), logits=v.logits,
                                        hidden=v.hidden, forward_ms=v.forward_ms,
                                        forward_tokens=v.forward_tokens,
                                        lead=lead))  # fmt: skip
        return new, len(v.accepted), len(draft) if draft is not None else 0

    def _first(
        self,
        prompt: list[int],
        common: int,
        params: GenParams,
        proposer: Proposer | None,
        taps: tuple[int, ...],
        gen: torch.Generator | None,
    ) -> int:
        """Feed ``prompt`` after its ``common`` cached tokens (its hidden states to a
        proposer that reads them) and sample the first token from the last row's logits."""
        logits = self._feed(prompt, common, taps)
        if proposer is not None and taps and hasattr(proposer, "prefilled"):
            proposer.prefilled(self.prompt_hidden(len(prompt)))
        mask = params.constraint([]) if params.constraint is not None else None
        free = -1  # the model's unconstrained greedy choice there, for recall
        if mask is not None:  # healing: the first token regrows the backed-off text
            free = self._choice(logits, params) if params.temperature <= 0 else -1
            logits = logits.masked_fill(~mask, float("-inf"))
        best = self._argmax(logits, params)
        _, first = verify(None, logits, params.temperature, params.top_p, gen, best)
        if params.temperature <= 0:
            self.slots.choices.note(len(prompt) - 1, free if mask is not None else first,
                                    mask, first)  # fmt: skip
        return first

    def _choice(self, row: torch.Tensor, params: GenParams) -> int:
        """The greedy choice of one row of logits ``(1, V)``."""
        best = self._argmax(row, params)
        return best[0] if best is not None else int(row[0].argmax())

    def generate(
        self,
        prompt_ids: list[int],
        params: GenParams,
        proposer: Proposer | None = None,
        info: RequestInfo | None = None,
    ) -> tuple[list[int], Stats]:
        """The generated ids (stop token left out) and the stats, in one call."""
        ids: list[int] = []
        stats = Stats()
        for step in self.stream(prompt_ids, params, proposer, info):
            ids.extend(step.token_ids)
            stats = step.stats
        return [t for t in ids if t not in self.stop_ids], stats

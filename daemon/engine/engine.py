"""The decoding engine: model + tokenizer + KV cache + the speculative decode loop.

Owns: loading a local checkpoint (the folder ``models.resolve`` gives: the default
model, a ``.gguf`` import, any local Hugging Face causal LM or a name already in the
local HF cache, offline),
choosing the device and the runner, prefix reuse across requests, sampling,
stop rules, incremental detokenization and per-request statistics.

One decode step (``Engine.stream``): ``proposer.propose()`` → draft (chain or
tree) → one target forward over ``[root] + draft`` → ``verify()`` → accepted
tokens + the BONUS token → ``runner.keep()`` drops the rejected branches →
a delta is yielded → ``proposer.observe()``.

Must not touch: sockets, documents, editors. The engine is not thread-safe:
the daemon serialises access to it.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from codespec.daemon.engine import lean, models
from codespec.daemon.engine.runner import HFRunner, Runner
from codespec.daemon.prompts.fim import FimTokens, find_fim, stop_token_ids
from codespec.speculators.costs import ForwardCosts
from codespec.speculators.draft import Draft, Proposer, RequestInfo, StepResult
from codespec.speculators.verify import verify


class ModelLoadError(RuntimeError):
    """The model could not be found or read; the message is one line for the user."""


@dataclass
class GenParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    max_draft: int = 16  # the most draft tokens verified in one forward
    # Allowed next tokens given the ids generated so far (a bool mask over the
    # vocabulary), or None when free: token healing (:mod:`.healing`). No draft is
    # made while it constrains a step, so plain and speculative decoding agree.
    constraint: Callable[[list[int]], torch.Tensor | None] | None = None
    heal: str = ""  # the text the constraint regrows: stop strings are searched after it


@dataclass
class Stats:
    """Statistics of one request.

    - ``tokens``: tokens generated (stop text excluded, the token that ended it counted).
    - ``target_forwards``: every target forward, the prefill included; plain
      decoding of N tokens takes N forwards, so ``tokens_per_forward`` is 1.0 there.
    - ``accepted``/``drafted`` per source: draft tokens accepted / proposed; the
      bonus token is never counted as accepted.
    - ``mean_accepted``: accepted draft tokens per decode step, bonus not counted.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    tokens: int = 0
    target_forwards: int = 0
    decode_steps: int = 0
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    finish_reason: str = ""

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens / self.total_ms if self.total_ms > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted.values()) / self.decode_steps if self.decode_steps else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "tokens": self.tokens,
            "target_forwards": self.target_forwards,
            "tokens_per_forward": round(self.tokens_per_forward, 3),
            "mean_accepted_no_bonus": round(self.mean_accepted, 3),
            "drafted": dict(self.drafted),
            "accepted": dict(self.accepted),
            "prefill_ms": round(self.prefill_ms, 2),
            "ttft_ms": round(self.ttft_ms, 2),
            "total_ms": round(self.total_ms, 2),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "finish_reason": self.finish_reason,
        }


@dataclass
class Delta:
    """One streamed step: new text, the new token ids (ending at the stop token, if one
    ended the request), what the step accepted."""

    text: str
    token_ids: list[int]
    accepted: int
    drafted: int
    stats: Stats
    done: bool = False


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for, but CUDA is not available")
    if device not in ("cpu", "cuda"):
        raise ModelLoadError(f"unknown device {device!r} (cpu, cuda or auto)")
    return torch.device(device)


def resolve_model_path(model: str | os.PathLike | None) -> str:
    """The folder to load for ``model`` (see :func:`codespec.daemon.engine.models.resolve`)."""
    try:
        return str(models.resolve(model))
    except models.ModelError as exc:
        raise ModelLoadError(str(exc)) from None


def load_runner(
    path: str, device: torch.device, runner: str = "auto", max_length: int | None = None
) -> tuple[Runner, object]:
    """Return (runner, HF config). ``runner`` is auto | lean | hf."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot read the model config in {path}: {_one_line(exc)}") from exc
    if runner not in ("auto", "lean", "hf"):
        raise ModelLoadError(f"unknown runner {runner!r} (auto, lean or hf)")
    if runner in ("auto", "lean"):
        if lean.supports(config):
            try:
                r = lean.LeanRunner.from_pretrained(
                    path, device=str(device), dtype=dtype, max_length=max_length
                )
                # An fp16 / bf16 checkpoint's weights as 16-bit panels: the same outputs
                # bit for bit, half the bytes each forward streams (a no-op without the
                # kernel).
                r.half_panels()
            except Exception as exc:
                raise ModelLoadError(f"cannot load {path}: {_one_line(exc)}") from exc
            return r, config
        if runner == "lean":
            raise ModelLoadError(f"the lean runner does not support {config.model_type!r}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except Exception as exc:
        raise ModelLoadError(f"cannot load {path}: {_one_line(exc)}") from exc
    return HFRunner(model.to(device), max_length=max_length), config


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


class Engine:
    """A resident model with one KV cache; serves one request at a time."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        device: str = "auto",
        runner: str = "auto",
        max_length: int | None = None,
        max_slots: int = 4,
    ) -> None:
        from transformers import AutoTokenizer

        self.model_path = resolve_model_path(model)
        self.device = pick_device(device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        except Exception as exc:
            raise ModelLoadError(f"cannot load the tokenizer: {_one_line(exc)}") from exc
        self.runner, self.config = load_runner(self.model_path, self.device, runner, max_length)
        self.max_length = self.runner.max_length
        vocab = self.tokenizer.get_vocab()
        self.fim: FimTokens | None = find_fim(vocab)
        self.stop_ids = stop_token_ids(vocab, self.tokenizer.eos_token_id, self.fim)
        self.cached_ids: list[int] = []  # mirrors the runner's cache, token for token
        # Hidden-state taps per cached position, kept while a proposer asks for them
        # (EAGLE reads the prompt's states), so prefix reuse works for it too.
        self._taps: tuple[int, ...] = ()
        self._tap_buf: torch.Tensor | None = None  # (max_length, len(taps), H)
        self._tap_valid = 0  # positions [0, _tap_valid) of the buffer are filled
        # Idle cache slots (the active one lives in the runner and the fields above).
        self.max_slots = max(1, int(max_slots))
        self._idle: list[_Slot] = []
        self._clock = 0
        self.lock = threading.Lock()
        # Measured forward + verification time by forward size (the policy's cost model).
        self.costs = ForwardCosts()

    # -- text <-> ids ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added; callers cut prompts to fit)."""
        return self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @property
    def model_name(self) -> str:
        return models.display_name(self.model_path)

    # -- decoding ----------------------------------------------------------------------
    def reset_cache(self) -> None:
        """Forget every cached prefix, in every slot (benchmarks start each run cold)."""
        self.runner.reset()
        self.cached_ids = []
        self._tap_valid = 0
        self._idle.clear()

    def _pick_slot(self, prompt: list[int]) -> None:
        """Make the cache slot sharing the longest prefix with ``prompt`` the active one.

        A slot fits when reusing it would drop at most half of what it holds (or it
        shares 256 tokens or more). When no slot fits, the prompt gets a fresh slot
        while there is room, else the least recently used idle one, so the active
        document's cache survives a request on another document.
        """
        self._clock += 1

        def shared(ids: list[int]) -> int:
            n = 0
            for a, b in zip(ids, prompt, strict=False):
                if a != b:
                    break
                n += 1
            return n

        def fits(ids: list[int], n: int) -> bool:  # reusing it loses at most half of it
            return n >= min(256, len(ids) // 2)

        active = shared(self.cached_ids)
        best, best_n = None, -1
        for slot in self._idle:
            n = shared(slot.cached_ids)
            if fits(slot.cached_ids, n) and n > best_n:
                best, best_n = slot, n
        if best is not None and best_n > active:
            self._swap(best)
        elif not fits(self.cached_ids, active):
            if 1 + len(self._idle) < self.max_slots:
                self._swap(_Slot(self.runner.new_cache_state(), [], (), None, 0, 0))
            elif self._idle:
                lru = min(self._idle, key=lambda sl: sl.used)
                self._swap(lru)
                self.runner.reset()
                self.cached_ids = []
                self._tap_valid = 0

    def _swap(self, slot: _Slot) -> None:
        """Park the active cache in an idle slot and activate ``slot``."""
        if slot in self._idle:
            self._idle.remove(slot)
        parked = _Slot(
            self.runner.cache_state(),
            self.cached_ids,
            self._taps,
            self._tap_buf,
            self._tap_valid,
            self._clock,
        )
        self._idle.append(parked)
        self.runner.set_cache_state(slot.state)
        self.cached_ids = slot.cached_ids
        self._taps, self._tap_buf, self._tap_valid = slot.taps, slot.tap_buf, slot.tap_valid

    def _prefill(self, prompt: list[int], taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, int]:
        """Feed the prompt after its longest cached prefix.

        Returns the last row's logits and how many prompt tokens were reused. With
        ``taps``, the tapped hidden states of every prompt position end up in
        :meth:`prompt_hidden` (reused positions included).
        """
        if self.max_slots > 1:
            self._pick_slot(prompt)
        common = 0
        limit = min(len(self.cached_ids), len(prompt) - 1)
        if taps:
            if taps != self._taps or self._tap_buf is None:
                self._taps = taps
                self._tap_buf = None
                self._tap_valid = 0
            limit = min(limit, self._tap_valid)
        while common < limit and self.cached_ids[common] == prompt[common]:
            common += 1
        self.runner.truncate(common)
        out = self.runner.forward(prompt[common:], taps=taps, last_only=True)
        self.cached_ids = list(prompt)
        if taps:
            assert out.hidden is not None
            if self._tap_buf is None:
                shape = (self.max_length, len(taps), out.hidden.shape[-1])
                self._tap_buf = torch.empty(shape, dtype=out.hidden.dtype)
            self._tap_buf[common : len(prompt)] = out.hidden
            self._tap_valid = len(prompt)
        else:
            self._tap_valid = min(self._tap_valid, common)
        return out.logits[-1:], common

    def prompt_hidden(self, n: int) -> torch.Tensor:
        """Tapped hidden states of the first ``n`` cached positions, ``(n, len(taps), H)``."""
        if self._tap_buf is None or n > self._tap_valid:
            raise RuntimeError("no tapped hidden states for those positions")
        return self._tap_buf[:n]

    def _keep_taps(self, base: int, hidden: torch.Tensor | None, rows: list[int]) -> None:
        """Record the kept rows' taps at positions ``base..`` after a verify step."""
        if hidden is None or self._tap_buf is None or self._tap_valid != base:
            self._tap_valid = min(self._tap_valid, base)
            return
        self._tap_buf[base : base + len(rows)] = hidden[rows]
        self._tap_valid = base + len(rows)

    def stream(
        self,
        prompt_ids: list[int],
        params: GenParams,
        proposer: Proposer | None = None,
        info: RequestInfo | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[Delta]:
        """Generate from ``prompt_ids``, yielding one :class:`Delta` per target forward."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_length:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the model takes at most "
                f"{self.max_length - 1}"
            )
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        max_tokens = min(params.max_tokens, self.max_length - len(prompt_ids))
        gen = None
        if params.temperature > 0:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        stats = Stats(prompt_tokens=len(prompt_ids))
        t0 = time.perf_counter()
        if proposer is not None:
            proposer.begin(
                info
                or RequestInfo(
                    prompt_ids=list(prompt_ids),
                    temperature=params.temperature,
                    max_tokens=max_tokens,
                )
            )
        taps: tuple[int, ...] = tuple(getattr(proposer, "taps", ()) or ())
        logits, stats.cached_tokens = self._prefill(list(prompt_ids), taps)
        if proposer is not None and taps and hasattr(proposer, "prefilled"):
            proposer.prefilled(self.prompt_hidden(len(prompt_ids)))
        stats.target_forwards = 1
        mask = params.constraint([]) if params.constraint is not None else None
        if mask is not None:  # healing: the first token regrows the backed-off text
            logits = logits.masked_fill(~mask, float("-inf"))
        _, first = verify(None, logits, params.temperature, params.top_p, gen)
        stats.prefill_ms = (time.perf_counter() - t0) * 1000
        out_ids: list[int] = []
        detok = TextTracker(self.decode, params.stop, skip=params.heal)
        pending = first
        new_tokens = [first]
        accepted_n, drafted_n = 0, 0
        while True:
            # Stop rules, in token order: end of text, max tokens, stop strings.
            finish = ""
            used = 0  # this step's tokens that count (through the one that ends the request)
            for tok in new_tokens:
                used += 1
                if tok in self.stop_ids:
                    finish = "stop"
                    break
                out_ids.append(tok)
                if len(out_ids) >= max_tokens:
                    finish = "length"
                    break
            if finish:  # a step's tokens past the stop that ended the request are not output
                new_tokens = new_tokens[:used]
            stats.tokens = len(out_ids) + (1 if finish == "stop" else 0)
            text, hit = detok.update(out_ids, final=bool(finish))
            if hit:
                finish = "stop"
                stats.tokens = detok.tokens_used
            if cancel is not None and cancel.is_set() and not finish:
                finish = "cancelled"
            now = time.perf_counter()
            if not stats.ttft_ms:
                stats.ttft_ms = (now - t0) * 1000
            stats.total_ms = (now - t0) * 1000
            if finish:
                text += detok.flush()
                stats.finish_reason = finish
                yield Delta(text, new_tokens, accepted_n, drafted_n, stats, done=True)
                return
            yield Delta(text, new_tokens, accepted_n, drafted_n, stats)
            # One decode step.
            remaining = max_tokens - len(out_ids)
            budget = min(params.max_draft, remaining - 1, self.max_length - self.runner.length - 2)
            draft: Draft | None = None
            mask = params.constraint(out_ids) if params.constraint is not None else None
            if proposer is not None and budget > 0 and mask is None:
                context = list(prompt_ids) + out_ids
                draft = proposer.propose(context, budget)
                if draft is not None and len(draft) > budget:
                    draft = draft.truncated(budget)
            ids = [pending]
            parents = None
            if draft is not None and len(draft):
                ids += draft.tokens
                assert draft.parents is not None
                if not draft.is_chain:
                    parents = [-1] + [p + 1 for p in draft.parents]
            t_fwd = time.perf_counter()
            fwd = self.runner.forward(ids, parents, taps=taps)
            if mask is not None:  # a constrained step is a plain step: one row
                fwd.logits = fwd.logits.masked_fill(~mask, float("-inf"))
            stats.target_forwards += 1
            stats.decode_steps += 1
            accepted, bonus = verify(draft, fwd.logits, params.temperature, params.top_p, gen)
            fwd_ms = (time.perf_counter() - t_fwd) * 1000
            self.costs.add(len(ids), fwd_ms)
            kept = [0] + [a + 1 for a in accepted]
            base = self.runner.length - len(ids)
            self.runner.keep(kept)
            self._keep_taps(base, fwd.hidden, kept)
            self.cached_ids.append(pending)
            drafted_n = len(draft) if draft is not None else 0
            accepted_n = len(accepted)
            if draft is not None:
                for i in range(len(draft)):
                    src = draft.source(i)
                    stats.drafted[src] = stats.drafted.get(src, 0) + 1
                for a in accepted:
                    src = draft.source(a)
                    stats.accepted[src] = stats.accepted.get(src, 0) + 1
                    self.cached_ids.append(draft.tokens[a])
            new_tokens = [draft.tokens[a] for a in accepted] if draft is not None else []
            new_tokens.append(bonus)
            pending = bonus
            if proposer is not None:
                proposer.observe(
                    StepResult(
                        draft,
                        accepted,
                        bonus,
                        list(new_tokens),
                        logits=fwd.logits,
                        hidden=fwd.hidden,
                        forward_ms=fwd_ms,
                        forward_tokens=len(ids),
                    )
                )

    def generate(
        self,
        prompt_ids: list[int],
        params: GenParams,
        proposer: Proposer | None = None,
        info: RequestInfo | None = None,
    ) -> tuple[str, Stats]:
        text = []
        stats = Stats()
        for delta in self.stream(prompt_ids, params, proposer, info):
            text.append(delta.text)
            stats = delta.stats
        return "".join(text), stats


@dataclass(eq=False)
class _Slot:
    """An idle KV cache and the token ids (and taps) it holds."""

    state: object
    cached_ids: list[int]
    taps: tuple[int, ...]
    tap_buf: torch.Tensor | None
    tap_valid: int
    used: int


_REPEAT = re.compile(r"(.{4,}?)\1{3,}")


def repeats_a_piece(line: str) -> bool:
    """Whether ``line`` repeats a piece of 4+ characters 4+ times in a row, the piece
    holding two different non-space characters (so indentation, ``----`` rules and
    ``====`` underlines are not loops; ``strict_strict_strict_strict`` is)."""
    return any(len(set(m.group(1)) - {" ", "\t"}) >= 2 for m in _REPEAT.finditer(line))


def indent_width(line: str) -> int:
    """Columns of leading whitespace (a tab counts 4)."""
    expanded = line.expandtabs(4)
    return len(expanded) - len(expanded.lstrip(" "))


def region_shape(text: str) -> tuple[int, int]:
    """``(indent, k)`` of a region for :class:`TextTracker`: its first line's indentation
    and how many non-blank lines are indented that much or less."""
    lines = text.split("\n")
    indent = indent_width(lines[0])
    return indent, sum(1 for s in lines if s.strip() and indent_width(s) <= indent)


class TextTracker:
    """Text of a growing id list, emitted incrementally; stop strings end it.

    Held back until known: a trailing incomplete UTF-8 sequence (decoded as
    U+FFFD) and a trailing piece that could be the start of a stop string. On a
    stop string, ``tokens_used`` is the fewest leading tokens that produced it.

    ``skip``: text the output starts with that is not the caller's (token
    healing regrows the end of the prompt); it is never emitted, and stop
    strings are searched after it. ``stop_lines``: a completed line equal to
    one of them (whitespace aside) ends the text before that line: the
    completion has reached the code after the cursor and would write it again.
    The first line counts only when ``first_line_counts``. ``cut_loops``: a
    completed line written for the third time, or one that repeats a piece of 4+
    characters 4+ times in a row, ends the text before that line (``looped``).

    ``lead``: text the caller put at the end of the prompt that belongs to the
    output (an edit's first line); it is emitted first and the rules see it.
    ``region = (indent, k)``: an edit's region had ``k`` non-blank lines indented
    at most ``indent`` columns; the text ends before the ``k+1``-th such line (the
    rewrite has moved past the region). ``trailing``: the finished text ends with
    exactly these line breaks (an edit ends as the old region did).

    Whatever a stop may still take away is held back, so the concatenated pieces
    always equal the finished ``text``.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop: list[str],
        skip: str = "",
        stop_lines: Sequence[str] = (),
        first_line_counts: bool = False,
        cut_loops: bool = False,
        lead: str = "",
        region: tuple[int, int] | None = None,
        trailing: str | None = None,
    ) -> None:
        self.decode = decode
        self.trailing = trailing
        self.lead = lead
        self.region = region
        self.stop = [s for s in stop if s]
        self.skip = skip
        self.stop_lines = {s.strip() for s in stop_lines if s.strip()}
        self.first_line_counts = first_line_counts
        self.cut_loops = cut_loops
        self.looped = False  # a loop ended the text
        self.emitted = 0
        self.text = ""
        self.tokens_used = 0
        self._healed = not skip

    def _visible(self, ids: list[int]) -> str | None:
        """The decoded text after ``skip``; None while ``skip`` is not yet covered."""
        full = self.decode(ids)
        if not self._healed:
            if len(full) < len(self.skip) or not full.startswith(self.skip):
                return None
            self._healed = True
        return full[len(self.skip) :]

    def update(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """New text since the last call, and whether a stop string or line ended it."""
        visible = self._visible(ids)
        if visible is None:
            return "", False
        self.text = self.lead + visible
        stop = self._stop_at(self.text)
        if stop is not None:
            cut, through = stop
            self.text = self._ending(self.text[:cut])
            self.tokens_used = self._tokens_for(ids, len(self.skip) + through - len(self.lead))
            return self._take(len(self.text)), True
        if final:
            self.text = self._ending(self.text)
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):
                end -= 1
            for s in self.stop:
                for k in range(min(len(s) - 1, end), 0, -1):
                    if self.text[:end].endswith(s[:k]):
                        end -= k
                        break
            if self.stop_lines or self.cut_loops or self.region or self.trailing is not None:
                # the last line may still be cut, and with it the line breaks before it
                end = min(end, max(self.text.rfind("\n"), 0))
                end = len(self.text[:end].rstrip("\r\n"))
        return self._take(max(end, self.emitted)), False

    def _ending(self, text: str) -> str:
        """The finished text: with ``trailing``, its line breaks replaced by those."""
        return text if self.trailing is None else text.rstrip("\r\n") + self.trailing

    def _stop_at(self, text: str) -> tuple[int, int] | None:
        """``(end of the text, end of what stopped it)`` when a stop string or a stop line
        ends ``text``, the earliest of them."""
        best: tuple[int, int] | None = None
        for s in self.stop:
            at = text.find(s, max(0, self.emitted - len(s) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, at + len(s))
        start = 0
        seen: dict[str, int] = {}
        top = 0  # lines at the region's indentation or less
        for n, line in enumerate(text.split("\n")[:-1]):  # completed lines only
            key = line.strip()
            stop_line = (n > 0 or self.first_line_counts) and key in self.stop_lines
            seen[key] = seen.get(key, 0) + 1
            if self.region is not None and key and indent_width(line) <= self.region[0]:
                top += 1
                stop_line = stop_line or top > self.region[1]
            # a loop: a line written the third time, or a piece repeated in a row
            looping = self.cut_loops and key and (seen[key] >= 3 or repeats_a_piece(line))
            if stop_line or looping:
                at = max(0, start - 1)  # the line break before it goes too
                if best is None or at < best[0]:
                    best = (at, start + len(line) + 1)
                    self.looped = not stop_line
                break
            start += len(line) + 1
        return best

    @property
    def clean_cut(self) -> bool:
        """Whether the text so far ends on a whole character (safe to preempt)."""
        return not self.text.endswith("\ufffd")

    def _take(self, end: int) -> str:
        piece = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return piece

    def flush(self) -> str:
        return self._take(len(self.text))

    def _tokens_for(self, ids: list[int], chars: int) -> int:
        """The fewest leading tokens whose text covers ``chars`` characters."""
        for n in range(1, len(ids) + 1):
            if len(self.decode(ids[:n])) >= chars:
                return n
        return len(ids)

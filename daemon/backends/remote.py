"""The engine's face over an inference server: the scheduler's ``Engine``, decoded remotely.

Owns :class:`RemoteEngine`: the local model folder's tokenizer (prompts are built and
output is read back here, so a prompt is the same ids the local engine would get; the
weights are never loaded), the connection check (the server is up, serves the model
named, and tokenizes text as the local tokenizer does: otherwise the daemon does not
start), and :meth:`RemoteEngine.stream`: one streamed ``/v1/completions`` request per
turn, its tokens as :class:`~codespec.daemon.engine.engine.Step` s, the stream closed
when the scheduler stops reading (a stop string, a cancellation).

Token healing's constrained first tokens go one request each (``max_tokens: 1`` and
``allowed_token_ids``, the mask's ids) before the free-running stream: the server
applies no per-step mask otherwise. Speculation is the server's (its
``--speculative-config``); the local proposers do not run. Retries: a request is sent
again only while nothing of it has been streamed (the next try continues from the same
ids, so no text is ever inserted twice).

Must not touch: sockets to editors, documents, prompts, the scheduler's queue.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codespec.daemon.backends.openai_http import BackendError, OpenAIClient, read_api_key
from codespec.daemon.config import Backend
from codespec.daemon.engine.engine import Engine, GenParams, Stats, Step
from codespec.daemon.engine.loading import ModelLoadError, one_line, resolve_model_path
from codespec.daemon.engine.tokenizer import load as load_tokenizer
from codespec.daemon.text.specials import FimTokens, find_fim, stop_token_ids
from codespec.speculators.draft import Proposer, RequestInfo
from codespec.speculators.target import SpeculatorState

log = logging.getLogger("codespec.daemon")

# Text both tokenizers must split into the same ids (code, spaces, a non-ASCII letter)
PROBE_TEXT = "def add(a, b):\n    return a + b  # sum\n\tif x != 'é':\n"
RETRY_DELAY_S = 0.25  # before the first retry; doubles per retry
# An edit's prediction reaches the server only inside the prompt: vLLM's completions API
# (0.32) has no ``prediction``; its n-gram speculation drafts from the prompt instead
PREDICTED_OUTPUTS = (
    "not supported by vLLM's completions API: edits decode with the server's own "
    "speculation (its n-gram lookup drafts from the prompt, which holds the prediction)"
)
HEALTH_TIMEOUT_S = 2.0  # the status check's limit: it runs on the daemon's event loop


@dataclass
class Where:
    """``engine.device``: where decoding happens (``type`` is what ``hello`` shows)."""

    type: str


@dataclass
class RemoteRunner:
    """``engine.runner`` for the parts of the daemon that read it: a name, the vocabulary."""

    name: str
    vocab_size: int
    max_length: int


class _NoLock:
    """``engine.lock``: the server batches requests itself, so none waits for another."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class RemoteEngine:
    """Decoding on an OpenAI-compatible server (vLLM), prompts and text in the daemon."""

    remote = True

    def __init__(self, model: str | None, backend: Backend) -> None:
        self.model_path = resolve_model_path(model)
        try:
            self.tokenizer = load_tokenizer(self.model_path)
        except Exception as exc:
            raise ModelLoadError(f"cannot load the tokenizer: {one_line(exc)}") from exc
        self.config = _model_config(Path(self.model_path))
        vocab = self.tokenizer.get_vocab()
        vocab_size = int(self.config.get("vocab_size") or len(self.tokenizer))
        self.fim: FimTokens | None = find_fim(vocab)
        self.stop_ids = stop_token_ids(vocab, self.tokenizer.eos_token_id, self.fim)
        self.kind = backend.kind
        self.retries = int(backend.retries)
        key = read_api_key(backend.api_key_env, backend.api_key_file)
        self.client = OpenAIClient(backend.url, key, float(backend.timeout_s))
        self.served, self.max_length = self._check_server(backend.model)
        self.device = Where(self.kind)
        self.runner = RemoteRunner(self.kind, vocab_size, self.max_length)
        self.lock = _NoLock()
        self.requests = 0  # requests sent to the server (retries and healing steps included)
        self.retried = 0
        self._count_lock = threading.Lock()
        # nothing drafts here; ``stats``' policy section reads it as for a local engine
        self.speculator_state = SpeculatorState()

    # -- what the rest of the daemon reads off an engine ----------------------------------
    # the tokenizer side is the local engine's, read off the same attributes (its tables
    # built on first use and kept with this engine)
    encode = Engine.encode
    decode = Engine.decode
    model_name = Engine.model_name
    token_texts = Engine.token_texts
    prefix_encoder = Engine.prefix_encoder

    @property
    def max_slots(self) -> int:
        return 0  # the server's KV cache, not the daemon's

    def reset_cache(self) -> None:
        """Nothing is cached in the daemon (the server keeps its own prefix cache)."""

    def cached_tokens(self, prompt: list[int]) -> int:
        return 0

    def warm(
        self, prompt: list[int], yield_to: Callable[[], bool], chunk: int = 128, run: bool = False
    ) -> int:
        """No warm-up: the server's prefix cache fills with the requests themselves."""
        return 0

    def interrupt(self) -> None:
        """Nothing to stop: no warm-up runs here."""

    # -- the server -----------------------------------------------------------------------
    def _served(self, timeout: float | None = None) -> list[dict[str, Any]]:
        data = self.client.get_json("/v1/models", timeout)
        models_ = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models_, list) or not models_:
            raise BackendError(f"the backend at {self.client.url} serves no model")
        return [m for m in models_ if isinstance(m, dict) and "id" in m]

    def _check_server(self, wanted: str) -> tuple[str, int]:
        """(the served model's name, its context length); BackendError when the server is
        down, does not serve ``wanted``, or its tokenizer is not the local model's."""
        served = self._served()
        names = [str(m["id"]) for m in served]
        if wanted and wanted not in names:
            raise BackendError(f"the backend at {self.client.url} serves {', '.join(names)}, "
                               f"not {wanted} ([backend] model)")  # fmt: skip
        entry = next(m for m in served if not wanted or m["id"] == wanted)
        name = str(entry["id"])
        theirs = self._tokenize(name, PROBE_TEXT)
        if theirs is not None and theirs != self.encode(PROBE_TEXT):
            raise BackendError(
                f"the backend at {self.client.url} serves {name}, whose tokenizer is not the "
                f"local model's ({self.model_name}): prompts would mean other tokens; "
                "start the daemon with --model set to the model the server serves"
            )
        max_len = int(entry.get("max_model_len") or self.config.get("max_position_embeddings")
                      or 2048)  # fmt: skip
        log.info("backend: %s at %s (context %d tokens)", name, self.client.url, max_len)
        return name, max_len

    def _tokenize(self, name: str, text: str) -> list[int] | None:
        """The server's ids for ``text`` (vLLM's /tokenize); None where it has no such API."""
        body = {"model": name, "prompt": text, "add_special_tokens": False}
        try:
            data = self.client.post_json("/tokenize", body)
        except BackendError as exc:
            if "HTTP 404" in exc.message or "HTTP 405" in exc.message:
                log.warning("backend: no /tokenize; the tokenizer is not checked")
                return None
            raise
        return [int(t) for t in data.get("tokens", [])]

    def status(self) -> dict[str, Any]:
        """``stats``' backend section: where, which model, and a fresh health check."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "url": self.client.url,
            "model": self.served,
            "authenticated": self.client.authenticated,
            "requests": self.requests,
            "retried": self.retried,
            "predicted_outputs": PREDICTED_OUTPUTS,
        }
        try:
            names = [str(m["id"]) for m in self._served(HEALTH_TIMEOUT_S)]
        except BackendError as exc:
            return {**out, "health": exc.message}
        if self.served not in names:
            return {**out, "health": f"serves another model now: {', '.join(names)}"}
        return {**out, "health": "ok", "speculation": self._spec_metrics()}

    def _spec_metrics(self) -> dict[str, float]:
        """The server's own speculation counters (Prometheus ``/metrics``): drafts, draft
        tokens, accepted tokens since it started; {} when it speculates not or says not."""
        try:
            text = self.client.get_text("/metrics", HEALTH_TIMEOUT_S)
        except BackendError:
            return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:spec_decode_num_") and "_total" in line:
                name = line.split("{")[0].split()[0].removeprefix("vllm:spec_decode_num_")
                out[name.removesuffix("_total")] = float(line.rsplit(" ", 1)[1])
        return out

    # -- decoding -------------------------------------------------------------------------
    def _check(self, prompt_ids: list[int], params: GenParams) -> int:
        """The request's ``max_tokens`` as the context allows; ValueError when it cannot run
        (the local engine's rule, so both backends refuse the same requests)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_length:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model takes at "
                             f"most {self.max_length - 1}")  # fmt: skip
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        return min(params.max_tokens, self.max_length - len(prompt_ids))

    def _body(self, ids: list[int], max_tokens: int, params: GenParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.served,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stop_token_ids": sorted(self.stop_ids),
            "return_token_ids": True,
            "skip_special_tokens": False,
            "add_special_tokens": False,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        return body

    def _counted(self, retry: bool) -> None:
        with self._count_lock:
            self.requests += 1
            self.retried += int(retry)

    def _retrying(self, attempt: int, exc: BackendError, cancel: threading.Event | None) -> bool:
        """Whether to send a failed request again (nothing of it streamed yet)."""
        if not exc.retryable or attempt >= self.retries or (cancel is not None and cancel.is_set()):
            return False
        log.warning("backend: %s; retrying (%d of %d)", exc.message, attempt + 1, self.retries)
        time.sleep(RETRY_DELAY_S * 2**attempt)
        return True

    def _open(self, body: dict[str, Any], cancel: threading.Event | None) -> Iterator[dict]:
        """The request's events, its first one already read (retried until then)."""
        for attempt in itertools.count():
            self._counted(attempt > 0)
            events = self.client.stream("/v1/completions", {**body, "stream": True})
            try:
                first = next(events)
            except StopIteration:
                return iter(())
            except BackendError as exc:
                events.close()
                if not self._retrying(attempt, exc, cancel):
                    raise
                continue
            return itertools.chain([first], events)
        raise AssertionError("unreachable")

    def _healed_token(self, ids: list[int], allowed: list[int], params: GenParams) -> int:
        """One token drawn from ``allowed`` after ``ids`` (a healing step), retried."""
        body = {**self._body(ids, 1, params), "allowed_token_ids": allowed}
        for attempt in itertools.count():
            self._counted(attempt > 0)
            try:
                data = self.client.post_json("/v1/completions", body)
                return int(data["choices"][0]["token_ids"][0])
            except BackendError as exc:
                if not self._retrying(attempt, exc, None):
                    raise
            except (KeyError, IndexError, TypeError, ValueError):
                raise BackendError(
                    f"the backend at {self.client.url} returned no token ids "
                    "(return_token_ids: is it vLLM 0.10 or newer?)"
                ) from None
        raise AssertionError("unreachable")

    def stream(
        self,
        prompt_ids: list[int],
        params: GenParams,
        proposer: Proposer | None = None,
        info: RequestInfo | None = None,
        cancel: threading.Event | None = None,
    ) -> Generator[Step, None, None]:
        """Generate from ``prompt_ids`` as :meth:`Engine.stream` does: one :class:`Step` per
        server step (several tokens when the server's speculation accepted some), ending
        at a stop token, ``max_tokens`` or ``cancel``. ``proposer`` is not used."""
        max_tokens = self._check(prompt_ids, params)
        t0 = time.perf_counter()
        stats = Stats(prompt_tokens=len(prompt_ids))
        out: list[int] = []
        while params.constraint is not None and len(out) < max_tokens:
            mask = params.constraint(out)
            if mask is None:
                break
            allowed = mask.nonzero().flatten().tolist()
            tok = self._healed_token(list(prompt_ids) + out, allowed, params)
            step = self._step([tok], out, max_tokens, stats, t0, cancel)
            yield step
            if step.done:
                return
        if len(out) >= max_tokens:
            return
        body = self._body(list(prompt_ids) + out, max_tokens - len(out), params)
        events = self._open(body, cancel)
        try:
            for event in events:
                choices = event.get("choices") or [{}]
                ids = [int(t) for t in choices[0].get("token_ids") or []]
                reason = choices[0].get("finish_reason")
                if not ids and not reason:
                    continue
                step = self._step(ids, out, max_tokens, stats, t0, cancel, reason)
                yield step
                if step.done:
                    return
        finally:
            events_close = getattr(events, "close", None)
            if events_close is not None:
                events_close()
        raise BackendError(f"the backend at {self.client.url} ended the stream with no "
                           "finish reason", retryable=False)  # fmt: skip

    def _step(
        self,
        ids: list[int],
        out: list[int],
        max_tokens: int,
        stats: Stats,
        t0: float,
        cancel: threading.Event | None,
        reason: str | None = None,
    ) -> Step:
        """A server step's tokens appended to ``out``, cut at a stop token or the limit."""
        finish = ""
        kept = ids
        for used, tok in enumerate(ids, 1):
            if tok in self.stop_ids:
                kept, finish = ids[:used], "stop"
                break
            out.append(tok)
            if len(out) >= max_tokens:
                kept, finish = ids[:used], "length"
                break
        if not finish and reason:
            finish = {"stop": "stop", "length": "length"}.get(reason, "")
            if not finish:
                raise BackendError(f"the backend at {self.client.url} ended the request: {reason}")
        if not finish and cancel is not None and cancel.is_set():
            finish = "cancelled"
        if ids:
            stats.target_forwards += 1
            stats.decode_steps += 1 if stats.target_forwards > 1 else 0
        stats.tokens = len(out) + (1 if finish == "stop" else 0)
        stats.total_ms = (time.perf_counter() - t0) * 1000
        if not stats.ttft_ms and kept:
            stats.ttft_ms = stats.prefill_ms = stats.total_ms
        stats.finish_reason = finish
        return Step(kept, 0, 0, stats, done=bool(finish))


def _model_config(folder: Path) -> dict[str, Any]:
    """The model folder's config.json (its vocabulary and context sizes)."""
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}

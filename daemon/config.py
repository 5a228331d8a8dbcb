"""The daemon's configuration: a TOML file, defaults, command-line overrides.

Owns: :class:`Config` (typed, defaulted msgspec structs), where the config
file, the socket and the state directory live by default, and reading the TOML
file: the file's table, with the command line's overrides on top, is converted
once by :func:`codespec.daemon.typed.convert` (types, ranges, choices, unknown
keys); a bad value is a :class:`ConfigError` with a one-line message naming the
key.
Must not touch: the engine, sockets, documents.

File: ``$XDG_CONFIG_HOME/codespec/config.toml`` (fallback
``~/.config/codespec/config.toml``)::

    model = "qwen2.5-coder-0.5b"     # a name (`codespec model list`), a .gguf or an HF
                                     # folder; default: $CODESPEC_MODEL, else this one
    device = "auto"                  # auto | cpu | cuda
    runner = "auto"                  # auto | lean | hf
    socket = "/run/user/1000/codespec/daemon.sock"
    state_dir = "~/.cache/codespec"  # the saved n-gram index lives here

    [limits]
    max_queue = 32            # requests waiting or running before `overloaded`
    max_tokens = 1024         # the most tokens one request may ask for
    max_documents = 512       # open documents before `overloaded`
    max_document_chars = 4000000
    context_tokens = 512      # prompt tokens a completion carries at most
    kv_slots = 8              # KV caches kept for recent prompts (23 KB a token on SmolLM2)
    run_tokens = 6144         # file runs' tokens kept (12 KB a token on the 0.5B; 0: none)

    [speculation]
    default = "auto"          # auto | off | a proposer's name
    max_draft = 16            # draft tokens verified per forward, one request active
    shorten_at = 9            # active requests at which the draft length halves
    off_at = 32               # active requests at which speculation is switched off
    quantum_steps = 8         # decode steps a request runs before the next one's turn
    lead_step = true          # a cached prompt's last token and the first draft: one forward
    recall = true             # greedy: a cached prompt's earlier choices, with no forward
    run_on_tokens = 0         # tokens decoded after a finished one-line completion while idle

    [completion]
    context = "none"          # none | header | crossfile (what precedes the prefix)
    warm_after_s = 0.4        # a typing pause after which the prompt at the cursor is pre-filled
    suffix_tokens = 128       # the most suffix tokens a FIM prompt carries
    middle = "block"          # block | line | cursor: where a FIM prompt's middle starts
    block_lines = 4           # a block middle's grid: Enter re-feeds the suffix once in this many

    [workspace]
    max_file_bytes = 1000000
    max_files = 5000
    debounce_s = 0.3

    [view]
    enabled = false           # serve the live page from the start (codespec view asks later)
    ring = 200                # requests the page keeps (a bounded ring)

    [backend]
    kind = "local"            # local | vllm (a vLLM server decodes: codespec.daemon.backends)
    url = "http://127.0.0.1:8000"
    model = ""                # the served model's name ("": the one it serves)
    api_key_env = "CODESPEC_BACKEND_API_KEY"
    api_key_file = ""
    timeout_s = 30.0
    retries = 2

Command-line flags win over the file; the file wins over the defaults.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from codespec.daemon.typed import TypedError, convert
from codespec.native import state_dir

AtLeast1 = Annotated[int, Meta(ge=1)]


class ConfigError(ValueError):
    """A bad config file or value; the message is one line for the user."""


class _Section(msgspec.Struct, forbid_unknown_fields=True):
    pass


class Limits(_Section):
    max_queue: AtLeast1 = 32
    max_tokens: AtLeast1 = 1024
    max_documents: AtLeast1 = 512
    max_document_chars: AtLeast1 = 4_000_000
    # Prompt tokens a completion carries at most (prefix + suffix). The prefix starts at
    # an anchor (prompts.parts.anchors), so it holds a third to all of its room. On the
    # 0.5B with the block middle, first lines exact over 151 held-out points at 512 and at
    # 1,536 tokens: 51 against 49 at a line's start, 70 against 73 half-way into it
    # (BENCHMARKS.md), while a cold prompt (a jump, an open) feeds a third as many tokens:
    # bench latency jump p50 830 against 2,076 ms, open 730 against 2,402.
    context_tokens: Annotated[int, Meta(ge=64)] = 512
    # KV caches the engine keeps, one per recent prompt (the active one and idle ones), so
    # that requests on other documents do not evict each other's prefixes. A cache's
    # memory is what its cached tokens fill (23 KB a token for SmolLM2-135M; the
    # rest of its 8,192 tokens stays unmapped zero pages: qstack.cache), so a cache that
    # holds a completion's prompt is small and 8 are kept by default: switching among up
    # to 8 files keeps each one's prefix, where a cold prefill of a long prompt would make
    # the first keystroke there wait. bench latency's 8-client throughput does not tell 4
    # slots from 8 apart (the machine's noise is larger than the difference; the figures
    # are in BENCHMARKS.md).
    kv_slots: AtLeast1 = 8
    # File runs: the KV of stretches of open files from the points completion prefixes
    # start at (prompts.parts.anchors), pre-filled while idle after an open or a pause,
    # so the first completion at a new spot of such a stretch re-feeds only its suffix
    # and middle. Their tokens in all (the least recently used runs are dropped past it):
    # 12 KB a token on the 0.5B (23 on SmolLM2 with its EAGLE taps); 0: no runs.
    run_tokens: Annotated[int, Meta(ge=0)] = 6144


class Speculation(_Section):
    default: str = "auto"  # auto | off | a proposer's name (checked against the registry)
    max_draft: AtLeast1 = 16
    # Requests run one at a time on the one KV cache: a verify forward serves only its own
    # request, so speculating under load takes nothing from the others and ends each turn's
    # tokens sooner. At 8 concurrent clients (bench latency's throughput, alternating
    # rounds) full drafts give more tokens/s than plain decoding, and more than switching
    # speculation off at 4 active requests does. Beyond 8 unmeasured: drafts halve from 9,
    # and speculation stops at the default queue's limit.
    shorten_at: AtLeast1 = 9
    off_at: AtLeast1 = 32
    quantum_steps: AtLeast1 = 8
    # Drafts from what the last requests on a document generated (the n-gram proposer's
    # ``ngram:recent``): typing along the ghost text asks for the same tokens again.
    recent_outputs: bool = True
    # A request whose prompt is cached but its last token (a keystroke, mostly) verifies a
    # draft proposed from the prompt in the forward that feeds that token, instead of a
    # prefill forward of that token alone and the first draft's forward after it.
    lead_step: bool = True
    # Typing along the ghost text: a greedy request whose whole prompt the cache holds,
    # with the tokens the model chose after it in an earlier request, takes those tokens
    # from the cache slot with no forward (the same tokens a forward would choose).
    recall: bool = True
    # After a one-line completion that stopped at its line's end, while no request waits,
    # decode up to this many more greedy tokens (plain steps, thrown away): their choices
    # stay beside the cache, so Enter, or going on after accepting the ghost text,
    # recalls the next line instead of computing it (codespec.daemon.service.run_on).
    run_on_tokens: Annotated[int, Meta(ge=0, le=64)] = 0

    def __post_init__(self) -> None:
        if self.default not in ("auto", "off"):
            from codespec.speculators.registry import choices, known

            if not known(self.default):
                raise ValueError(f"default must be one of {choices()}, got {self.default!r}")
        if self.off_at < self.shorten_at:
            raise ValueError("off_at must be >= shorten_at")


class Completion(_Section):
    # What a completion's prompt carries besides the prefix: "none", "header" (the file
    # under a <file_sep>path line) or "crossfile" (snippets of the other open files
    # first). "none" by default: with SmolLM2-135M neither raises the first-line exact
    # match, and with Qwen2.5-Coder-0.5B both lower it (75 held-out points at the line's
    # start: 20.0% none, 13.3% header, 16.0% crossfile; codespec bench quality,
    # BENCHMARKS.md).
    context: Literal["none", "header", "crossfile"] = "none"
    # After an open, and after this long without a change to a document, the daemon
    # pre-fills the prompt a completion at the last edit would use (0: never). Longer
    # than the gap between keystrokes of someone typing (~150-250 ms): a warm-up between
    # keystrokes makes the next completion wait for its forward in flight.
    warm_after_s: Annotated[float, Meta(ge=0.0)] = 0.4
    # The most suffix tokens (the text after the cursor) a FIM prompt carries. Typing on a
    # line never re-feeds them; a new line or a jump does. On 75 held-out points at the
    # line's start the 0.5B's first line was exact 14.7% / 20.0% / 24.0% of the time with
    # 64 / 128 / 256 (codespec bench quality --suffix-tokens; BENCHMARKS.md).
    suffix_tokens: Annotated[int, Meta(ge=0, le=4096)] = 128
    # Where a FIM model's middle starts: "block" (4 to 7 lines above the cursor's, on a
    # grid of 4: typing on a line and Enter at its end, but one time in four, only append
    # to the prompt), "line" (the start of the cursor's line: its text left of the cursor
    # follows <|fim_middle|>, so typing on a line only appends to the prompt) or "cursor"
    # (the prefix ends at the cursor, and every keystroke re-feeds the suffix after it).
    middle: Literal["block", "line", "cursor"] = "block"
    # A block middle's grid: it starts this many lines above the cursor's line or up to
    # twice as many less one, on multiples of it, so that Enter at a line's end feeds the
    # suffix again one time in this many (the middle moves down by a block). 8 made the
    # same first lines as 4 over 151 held-out points (51 each), but typing's and Enter's
    # p99 worse: the longer middle leaves the prefix less room (BENCHMARKS.md).
    block_lines: Annotated[int, Meta(ge=1, le=64)] = 4


class Workspace(_Section):
    max_file_bytes: AtLeast1 = 1_000_000
    max_files: Annotated[int, Meta(ge=0)] = 5000
    debounce_s: Annotated[float, Meta(ge=0.0)] = 0.3


class Backend(_Section):
    # "local": the daemon's own engine; "vllm": a vLLM server's OpenAI API decodes
    # (codespec.daemon.backends; prompts, stops and cancellation stay in the daemon)
    kind: Literal["local", "vllm"] = "local"
    url: str = "http://127.0.0.1:8000"
    model: str = ""  # the served model's name; "": the one the server serves
    api_key_env: str = "CODESPEC_BACKEND_API_KEY"  # the API key's variable (never logged)
    api_key_file: str = ""  # else a file holding the key
    timeout_s: Annotated[float, Meta(gt=0.0)] = 30.0  # connect, and the most between tokens
    retries: Annotated[int, Meta(ge=0)] = 2  # reconnects before the first token only


class View(_Section):
    # The live page (codespec view): 127.0.0.1, a random port and token. Off, nothing
    # records the requests and nothing listens; ``codespec view`` opens it on demand.
    enabled: bool = False
    ring: Annotated[int, Meta(ge=1, le=10_000)] = 200


class Config(_Section):
    model: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    runner: Literal["auto", "lean", "hf"] = "auto"
    socket: str | None = None  # None: default_socket_path()
    state_dir: str | None = None  # None: default_state_dir(); "" disables saving the index
    limits: Limits = msgspec.field(default_factory=Limits)
    speculation: Speculation = msgspec.field(default_factory=Speculation)
    completion: Completion = msgspec.field(default_factory=Completion)
    workspace: Workspace = msgspec.field(default_factory=Workspace)
    view: View = msgspec.field(default_factory=View)
    backend: Backend = msgspec.field(default_factory=Backend)

    @property
    def socket_path(self) -> str:
        return os.path.expanduser(self.socket) if self.socket else default_socket_path()

    @property
    def index_path(self) -> Path | None:
        if self.state_dir == "":
            return None
        base = Path(os.path.expanduser(self.state_dir)) if self.state_dir else default_state_dir()
        return base / "index.msgpack"


SOCKET_RULE = (
    "$CODESPEC_SOCKET, else $XDG_RUNTIME_DIR/codespec/daemon.sock, "
    "else $XDG_CACHE_HOME/codespec/daemon.sock (~/.cache/codespec/daemon.sock)"
)


def default_socket_path() -> str:
    """The socket when the config names none (:data:`SOCKET_RULE`): sockets belong in
    the runtime directory when there is one; else the state directory, which follows
    ``$XDG_CACHE_HOME`` like the models, kernels and index."""
    env = os.environ.get("CODESPEC_SOCKET")
    if env:
        return os.path.expanduser(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "codespec", "daemon.sock")
    return str(state_dir() / "daemon.sock")


def default_state_dir() -> Path:
    """The daemon's state directory when the config names none: codespec's
    (:func:`codespec.native.state_dir`)."""
    return state_dir()


def default_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "codespec" / "config.toml"


def load_config(
    path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None
) -> Config:
    """The config file (``path``, or the default one when it exists) with ``overrides``
    (the command line's top-level keys; None values are left out) on top, checked."""
    explicit = path is not None
    p = Path(os.path.expanduser(str(path))) if explicit else default_config_path()
    table: dict[str, Any] = {}
    if p.exists():
        try:
            table = tomllib.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read {p}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p} is not valid TOML: {exc}") from None
    elif explicit:
        raise ConfigError(f"config file {p} does not exist")
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    try:
        return convert({**table, **flags}, Config)
    except TypedError as exc:
        where = p if p.exists() else "config"
        raise ConfigError(f"{where}: {exc}".splitlines()[0]) from None

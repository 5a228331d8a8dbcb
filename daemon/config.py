"""The daemon's configuration: a TOML file, defaults, command-line overrides.

Owns: :class:`Config` (typed, defaulted), where the config file, the socket
and the state directory live by default, reading and checking the TOML file
(a bad value is a :class:`ConfigError` with a one-line message naming the key).
Must not touch: the engine, sockets, documents.

File: ``$XDG_CONFIG_HOME/codespec/config.toml`` (fallback
``~/.config/codespec/config.toml``)::

    model = "/path/to/hf/model"      # default: SmolLM2-135M-Instruct (fetched once)
    device = "auto"                  # auto | cpu | cuda
    runner = "auto"                  # auto | lean | hf
    socket = "/run/user/1000/codespec/daemon.sock"
    state_dir = "~/.cache/codespec"  # the saved n-gram index lives here

    [limits]
    max_queue = 32            # requests waiting or running before `overloaded`
    max_tokens = 1024         # the most tokens one request may ask for
    max_documents = 512       # open documents before `overloaded`
    max_document_chars = 4000000
    context_tokens = 1024     # prompt tokens a completion carries at most

    [speculation]
    default = "auto"          # auto | off | a proposer's name
    max_draft = 16            # draft tokens verified per forward, one request active
    shorten_at = 2            # active requests at which the draft length halves
    off_at = 4                # active requests at which speculation is switched off
    quantum_steps = 8         # decode steps a request runs before the next one's turn

    [completion]
    context = "none"          # none | header | crossfile (what precedes the prefix)

    [workspace]
    max_file_bytes = 1000000
    max_files = 5000
    debounce_s = 0.3

Command-line flags win over the file; the file wins over the defaults.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad config file or value; the message is one line for the user."""


@dataclass
class Limits:
    max_queue: int = 32
    max_tokens: int = 1024
    max_documents: int = 512
    max_document_chars: int = 4_000_000
    # Prompt tokens a completion carries at most (prefix + suffix): each first keystroke
    # at a new spot prefills this much (the first, retired default was trained on 1,024).
    context_tokens: int = 1024


@dataclass
class Speculation:
    default: str = "auto"
    max_draft: int = 16
    shorten_at: int = 2
    off_at: int = 4
    quantum_steps: int = 8


@dataclass
class Completion:
    # What a completion's prompt carries besides the prefix: "none", "header" (the file
    # under a <file_sep>path line) or "crossfile" (snippets of the other open files
    # first). "none" by default: with SmolLM2-135M neither raised the first-line exact
    # match (codespec bench quality; README, "Completion quality").
    context: str = "none"


@dataclass
class Workspace:
    max_file_bytes: int = 1_000_000
    max_files: int = 5000
    debounce_s: float = 0.3


@dataclass
class Config:
    model: str | None = None
    device: str = "auto"
    runner: str = "auto"
    socket: str | None = None  # None: default_socket_path()
    state_dir: str | None = None  # None: default_state_dir(); "" disables saving the index
    limits: Limits = field(default_factory=Limits)
    speculation: Speculation = field(default_factory=Speculation)
    completion: Completion = field(default_factory=Completion)
    workspace: Workspace = field(default_factory=Workspace)

    @property
    def socket_path(self) -> str:
        return os.path.expanduser(self.socket) if self.socket else default_socket_path()

    @property
    def index_path(self) -> Path | None:
        if self.state_dir == "":
            return None
        base = Path(os.path.expanduser(self.state_dir)) if self.state_dir else default_state_dir()
        return base / "index.msgpack"


def default_socket_path() -> str:
    """``$CODESPEC_SOCKET``, else ``$XDG_RUNTIME_DIR/codespec/daemon.sock``, else ~/.cache."""
    env = os.environ.get("CODESPEC_SOCKET")
    if env:
        return os.path.expanduser(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "codespec", "daemon.sock")
    return os.path.join(os.path.expanduser("~"), ".cache", "codespec", "daemon.sock")


def default_state_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "codespec"


def default_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "codespec" / "config.toml"


_CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "runner": ("auto", "lean", "hf"),
    "context": ("none", "header", "crossfile"),
}
_MIN = {
    "max_queue": 1,
    "max_tokens": 1,
    "max_documents": 1,
    "max_document_chars": 1,
    "max_draft": 1,
    "shorten_at": 1,
    "off_at": 1,
    "quantum_steps": 1,
    "max_file_bytes": 1,
    "max_files": 0,
    "debounce_s": 0.0,
}


def _check(section: str, obj: Any, table: dict[str, Any], path: str) -> None:
    known = {f.name: f for f in fields(obj)}
    for key, value in table.items():
        name = f"{section}.{key}" if section else key
        f = known.get(key)
        if f is None:
            raise ConfigError(f"{path}: unknown key {name!r}")
        current = getattr(obj, key)
        if isinstance(current, (Limits, Speculation, Completion, Workspace)):
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: [{name}] must be a table")
            _check(name, current, value, path)
            continue
        want = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if "float" in want:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif "int" in want:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, str)
        if not ok:
            raise ConfigError(f"{path}: {name} must be {want.split(' ')[0]}, got {value!r}")
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ConfigError(f"{path}: {name} must be one of {', '.join(_CHOICES[key])}")
        if key in _MIN and value < _MIN[key]:
            raise ConfigError(f"{path}: {name} must be at least {_MIN[key]}, got {value}")
        setattr(obj, key, value)


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Read the config file (``path``, or the default one when it exists)."""
    explicit = path is not None
    p = Path(os.path.expanduser(str(path))) if explicit else default_config_path()
    config = Config()
    if not p.exists():
        if explicit:
            raise ConfigError(f"config file {p} does not exist")
        return config
    try:
        table = tomllib.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {p}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p} is not valid TOML: {exc}") from None
    _check("", config, table, str(p))
    validate(config, str(p))
    return config


def validate(config: Config, where: str = "config") -> None:
    """Cross-field checks (after the file and the flags are merged)."""
    from codespec.speculators.registry import names

    if config.speculation.default not in names():
        raise ConfigError(
            f"{where}: speculation.default must be one of {', '.join(names())}, "
            f"got {config.speculation.default!r}"
        )
    if config.limits.context_tokens < 64:
        raise ConfigError(f"{where}: limits.context_tokens must be at least 64")
    if config.speculation.off_at < config.speculation.shorten_at:
        raise ConfigError(f"{where}: speculation.off_at must be >= speculation.shorten_at")

"""Reading a GGUF file and converting it into a Hugging Face checkpoint folder.

Owns: which GGUF files codespec imports (:data:`ARCHITECTURES`, :data:`TENSOR_TYPES`),
the header check (:func:`check_gguf`) and the conversion: :func:`write_config` (the
config and tokenizer transformers reads from the file's metadata, all a model folder
needs to run from the GGUF's blocks) and :func:`write_weights` (the tensors, named as
transformers names them, dequantized by the ``gguf`` library, written by safetensors),
both at once :func:`write_checkpoint`. Errors are :class:`UnsupportedGGUF`
with a one-line message for the user.

Must not touch: the model cache (where folders live, manifests, locking: that is
:mod:`codespec.daemon.engine.models`, which calls this module), the engine, runners.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from codespec.daemon.engine import gguf_weights

ARCHITECTURES = ("llama", "qwen2", "mistral")  # general.architecture values we import
# Those whose config (config_dict) and tokenizer class (write_config) codespec reads
# itself, checked against transformers' own reading by the tests; a mistral file is
# read transformers' way (slower: the gguf library parses its tokenizer's strings).
READ_FAST = ("llama", "qwen2")
TOKENIZER_TYPES = ("qwen2",)  # llama has no registered tokenizer type
# GGUF tensor types the import dequantizes (the ``gguf`` library's numpy dequantizers).
TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
)  # fmt: skip
FP16_MAX = 65504.0


class UnsupportedGGUF(ValueError):
    """The file is not a GGUF codespec can import; the message is one line for the user."""


def one_line(exc: BaseException) -> str:
    """The last non-empty line of an exception's message (at most 300 characters)."""
    lines = [s for s in str(exc).strip().splitlines() if s.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


def check_gguf(path: Path) -> dict[str, Any]:
    """Read a GGUF's header: architecture and tensor types, refused with one line when
    codespec cannot import them. Returns ``{"architecture", "name", "types"}``. Read by
    :func:`.gguf_weights.read`, which skips the tokenizer's arrays (the ``gguf`` library's
    reader parses each of Qwen2.5's ~600,000 strings: ~15 s)."""
    if importlib.util.find_spec("gguf") is None:  # pragma: no cover - a dependency
        raise UnsupportedGGUF("reading .gguf files needs the `gguf` package")
    try:
        g = gguf_weights.read(path)
    except gguf_weights.GGUFError as exc:  # truncated, not a GGUF, an unknown version
        raise UnsupportedGGUF(f"{path} is not a readable GGUF file: {one_line(exc)}") from None

    def text(key: str) -> str | None:
        value = g.meta.get(key)
        return value if isinstance(value, str) else None

    arch = text("general.architecture") or "?"
    if arch not in ARCHITECTURES:
        raise UnsupportedGGUF(
            f"{path.name}: architecture {arch!r} is not supported "
            f"(codespec imports {', '.join(ARCHITECTURES)})"
        )
    types = sorted({_type_name(t.type_id) for t in g.tensors.values()})
    bad = [t for t in types if t not in TENSOR_TYPES]
    if bad:
        raise UnsupportedGGUF(f"{path.name}: tensor type {', '.join(bad)} is not supported")
    return {"architecture": arch, "name": text("general.name") or path.stem, "types": types}


def _type_name(type_id: int) -> str:
    """A GGML tensor type's name (the ``gguf`` library's), or ``type N`` for one it lacks."""
    import gguf as gg

    try:
        return gg.GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def source_types(gguf: Path, config: Any, keys: Iterable[str]) -> dict[str, str]:
    """HF tensor name -> the GGUF tensor type it was stored as (by the ``gguf``
    library's own name map, the one transformers loads the file with). The tensor
    table read by :func:`.gguf_weights.read` (the ``gguf`` library's reader parses the
    tokenizer's strings first: 13 s of Qwen2.5-0.5B's import)."""
    import gguf as gg

    arch = next(k for k, v in gg.MODEL_ARCH_NAMES.items() if v == config.model_type)
    names = gg.get_tensor_name_map(arch, int(config.num_hidden_layers))
    types = {t.name: _type_name(t.type_id) for t in gguf_weights.read(gguf).tensors.values()}
    out = {}
    for key in keys:
        base, _, suffix = key.rpartition(".")
        g = names.get_name(base)
        if g is not None and f"{g}.{suffix}" in types:
            out[key] = types[f"{g}.{suffix}"]
    return out


def write_checkpoint(gguf: Path, out: Path) -> None:
    """The GGUF as a whole Hugging Face folder: :func:`write_config` and
    :func:`write_weights`."""
    write_config(gguf, out)
    write_weights(gguf, out)


def _config(gguf: Path) -> Any:
    """transformers' config for the GGUF, read from its metadata (:func:`config_dict`)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    d = config_dict(gguf)
    if d is None:  # not one of ours: transformers' own (slow) reading
        config = AutoConfig.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, local_files_only=True
        )
    else:
        config = CONFIG_MAPPING[d["model_type"]].from_dict(d)
    config._name_or_path = ""
    return config


def config_dict(gguf: Path) -> dict[str, Any] | None:
    """The config transformers makes of the GGUF's metadata (its ``load_gguf_checkpoint``
    ``["config"]``: each key renamed by its ``GGUF_CONFIG_MAPPING``, the embeddings tied
    where there is no ``output.weight``, the vocabulary's size from the tokens where the
    file does not say), from :func:`.gguf_weights.read`: transformers reads that config
    with the ``gguf`` library's reader, which parses every tokenizer string first (~25 s
    for Qwen2.5's ~600,000, each time). None for an architecture not in
    :data:`READ_FAST`. The tests check that it equals transformers' own."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    g = gguf_weights.read(gguf)
    arch = g.meta.get("general.architecture")
    if arch not in READ_FAST:
        return None
    name = g.meta.get("general.name")
    # (transformers tests a list of the name's values for "mistral", as written here)
    updated = "mistral" if "llama" in arch and "mistral" in ([name] if name else []) else arch
    out: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in g.tensors}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch))
    for key, value in (defaults or {}).items():
        out.setdefault(key, value)
    for key, value in g.meta.items():
        prefix, _, rest = key.replace(arch, updated).partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest, -1)
        if renamed in (-1, None) or isinstance(value, tuple):  # not a config key; an array
            continue
        out[renamed] = value.replace(arch, updated) if isinstance(value, str) else value
    tokens = g.meta.get("tokenizer.ggml.tokens")
    if "vocab_size" not in out and isinstance(tokens, tuple):  # ("array", count)
        out["vocab_size"] = tokens[1]
    return out


def write_config(gguf: Path, out: Path) -> None:
    """``config.json`` and the tokenizer files of the GGUF into ``out``: transformers reads
    the config and builds the tokenizer from the GGUF's metadata. What the lean runner (which
    reads the blocks from the GGUF itself) and the tokenizer need; no weights."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    config = _config(gguf)
    config.save_pretrained(str(out))
    # the tokenizer class registered for the config's model type (where one is), named:
    # without it, AutoTokenizer reads the file's config the slow way (see config_dict)
    # only to find that class
    named = config.model_type in TOKENIZER_TYPES and config.model_type in TOKENIZER_MAPPING_NAMES
    kind = {"tokenizer_type": config.model_type} if named else {}
    tok = AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True, **kind
    )
    try:
        tok.save_pretrained(str(out))
    except OSError:
        raise
    except Exception as exc:  # tokenizers reports a failed write as its own error type
        raise OSError(one_line(exc)) from exc


def write_weights(gguf: Path, out: Path) -> None:
    """``model.safetensors`` of the GGUF into ``out``: transformers maps its tensor names,
    the ``gguf`` library dequantizes the blocks. Tensors stored as F32 or BF16 keep their
    type; quantized and F16 matrices are saved as fp16 when it holds them (the 16-bit type
    closest to the dequantized values, half fp32's size), else fp32."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = _config(gguf)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)
    kinds = source_types(gguf, config, tensors["tensors"])
    state: dict[str, torch.Tensor] = {}
    for key, value in tensors["tensors"].items():
        t = torch.as_tensor(value).float().contiguous()
        kind = kinds.get(key, "F32")
        if kind == "BF16":
            t = t.bfloat16()
        elif kind != "F32" and t.dim() >= 2 and t.abs().max().item() <= FP16_MAX:
            t = t.half()
        state[key] = t
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    missing = sorted(expected - set(state))
    if missing:
        raise UnsupportedGGUF(
            f"{gguf.name} lacks tensors the model needs: {', '.join(missing[:3])}"
        )
    try:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    except Exception as exc:  # safetensors reports a failed write as its own error type
        raise OSError(one_line(exc)) from exc

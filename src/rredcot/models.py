"""Policies: a character tokenizer and tiny Llama built offline, and `load_policy` for any causal LM.

The CPU testbed is a Llama-style model of well under a million parameters with one token per
character, trained from scratch (see `sft.py`); both are built here from configs, with no download.
Any other `AutoModelForCausalLM` checkpoint (a local directory or a hub id) loads through
`load_policy`.
"""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
"""Ids 0..3 of the character tokenizer, in this order."""

DEFAULT_CHARSET = "\n" + "".join(chr(c) for c in range(32, 127))
"""Newline plus printable ASCII (space through `~`): 96 characters."""


def build_char_tokenizer(
    charset: str = DEFAULT_CHARSET, padding_side: str = "left"
) -> PreTrainedTokenizerFast:
    """A fast tokenizer with one token per character of `charset`, plus pad/bos/eos/unk.

    Encoding prepends `<bos>` (as Llama tokenizers do; pass `add_special_tokens=False` to skip
    it); `<eos>` is never added automatically. Decoding joins tokens with nothing in between, so
    `decode(encode(text, add_special_tokens=False)) == text` for any text over `charset` (text
    that spells a special token such as `"<eos>"` is read as that token, as in every HF
    tokenizer). Characters outside `charset` become `<unk>`. Offsets map each token to its one
    character. `padding_side="left"` suits batched generation.

    Implementation: a BPE model with no merges and no pre-tokenizer splits text into characters,
    and the `Fuse` decoder concatenates them (a WordLevel model would need a pre-tokenizer, and
    the default decoders put spaces between tokens).
    """
    chars = list(dict.fromkeys(charset))  # unique, order kept
    if not chars:
        raise ValueError("charset is empty")
    clash = [c for c in chars if c in SPECIAL_TOKENS]
    if clash:
        raise ValueError(f"charset may not contain special tokens: {clash}")
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    bos_id = vocab["<bos>"]
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B:1", special_tokens=[("<bos>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,  # would turn "a ." into "a." on decode
        padding_side=padding_side,
    )


def build_tiny_llama(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    attn_implementation: str = "eager",
) -> LlamaForCausalLM:
    """A small randomly initialised Llama for `tokenizer`, identical for identical arguments.

    `intermediate_size` defaults to `4 * hidden_size`; the defaults give about 0.27M parameters
    with the character tokenizer. Eager attention is the default because it returns attention
    weights (used by the attention-attribution baseline) and costs nothing at this size.
    Initialisation uses its own RNG (`seed`) and leaves the global torch RNG untouched.
    """
    if hidden_size % num_heads != 0:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})"
        )
    ids = {k: getattr(tokenizer, f"{k}_token_id") for k in ("pad", "bos", "eos")}
    missing = [k for k, v in ids.items() if v is None]
    if missing:
        raise ValueError(
            f"tokenizer has no {'/'.join(missing)} token; use build_char_tokenizer() or set them"
        )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=ids["pad"],
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation=attn_implementation,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=ids["pad"], bos_token_id=ids["bos"], eos_token_id=ids["eos"]
    )
    return model


def _as_dtype(dtype: str | torch.dtype | None) -> str | torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    name = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(dtype, dtype)
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(
            f"unknown dtype {dtype!r}; use float32, bfloat16, float16 (or fp32/bf16/fp16) or auto"
        )
    return value


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", "./", "../", "~", "\\"))
        or os.path.isabs(name)
        or name.count("/") > 1
        or name in (".", "..")
    )


def load_policy(
    name_or_path: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    padding_side: str = "left",
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local directory or a hub id.

    The tokenizer gets a pad token (its eos token when it has none, also written into the model
    and generation configs) and `padding_side="left"` by default, the layout batched
    generation and `RolloutBatch` expect (prompts left-padded). `dtype` accepts a torch dtype,
    its name (`"bfloat16"`, `"bf16"`, ...) or `"auto"`; `None` keeps the checkpoint's default
    loading dtype. `attn_implementation` (`"eager"`, `"sdpa"`, ...) is not stored in checkpoints:
    `None` takes transformers' default (sdpa), which returns no attention weights; the
    attention-attribution baseline needs `"eager"`. The model is returned in eval mode on `device`
    (if given). A hub id that cannot be reached fails only after huggingface_hub's retries.
    """
    torch_dtype = _as_dtype(dtype)  # bad names fail before any loading
    name = os.fspath(name_or_path)
    expanded = os.path.expanduser(name)
    if _looks_like_path(name) and not os.path.exists(expanded):
        raise FileNotFoundError(
            f"no model directory at {name!r}; pass a directory written by save_pretrained "
            "(e.g. the output of `rredcot sft`) or a hub model id"
        )
    if os.path.exists(expanded):
        name = expanded
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=torch_dtype, trust_remote_code=trust_remote_code, **kwargs
        )
    except (OSError, ValueError) as e:
        if os.path.isdir(name):
            raise OSError(
                f"could not load a causal LM and tokenizer from directory {name!r}: {e}"
            ) from e
        raise OSError(
            f"could not load {name!r}: it is not a local directory and the hub could not provide "
            "it (offline, or no such model). Pass a local directory holding the model and "
            f"tokenizer files (save_pretrained output). Cause: {type(e).__name__}: {e}"
        ) from e

    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {name!r} has neither a pad nor an eos token; set one")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    gen = model.generation_config
    if gen is not None:
        if gen.pad_token_id is None:
            gen.pad_token_id = tokenizer.pad_token_id
        if gen.eos_token_id is None and tokenizer.eos_token_id is not None:
            gen.eos_token_id = tokenizer.eos_token_id
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters; tied tensors count once (`.parameters()` de-duplicates them)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)

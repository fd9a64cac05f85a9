"""Tiny models for the decoding, forward and scoring tests: causal LMs whose output depends on
their input, the tiny Llama in eval mode with a chosen attention, and tiny Llama PRMs."""

from __future__ import annotations

import torch


def lively(model, seed: int = 0):
    """``model`` with its matrices redrawn at std 0.3, so that greedy decoding is not one
    repeated token (a default-initialised tiny model's output barely depends on its input)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    return model


def gqa_lm(model_cls, config_cls, tok, seed: int = 1):
    """A 2-layer model of ``model_cls`` (Llama, Qwen2, ...) with grouped-query attention (4
    heads, 2 key-value heads) over ``tok``'s vocabulary, :func:`lively`."""
    config = config_cls(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return lively(model_cls(config), seed=seed)


def eval_llama(tokenizer, impl: str = "eager"):
    """The tiny Llama (32 wide, 2 layers, 2 heads, seed 0) in eval mode, with attention ``impl``."""
    from rredcot.models import build_tiny_llama

    return build_tiny_llama(
        tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0, attn_implementation=impl
    ).eval()


def prm_config(tok, num_labels: int = 2):
    """The config of a tiny Llama classifier over ``tok``'s vocabulary (a process reward model)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=num_labels,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )


def save_prm(path, kind: str, tokenizer, num_labels: int = 2) -> str:
    """Save a :func:`lively` tiny Llama PRM (``kind`` ``"sequence"`` or ``"token"``
    classification) with ``tokenizer`` at ``path``; returns the path."""
    from transformers import LlamaForSequenceClassification, LlamaForTokenClassification

    cls = LlamaForSequenceClassification if kind == "sequence" else LlamaForTokenClassification
    torch.manual_seed(0)
    model = lively(cls(prm_config(tokenizer, num_labels)), seed=3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)

"""Tiny causal LMs for the decoding and forward tests: models whose output depends on their input."""

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

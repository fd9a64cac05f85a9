"""The policy forward over ``[prompt | response]`` rows with each distinct prompt computed once.

An RL batch holds ``G`` samples of every prompt, so a plain forward computes every prompt ``G``
times over. Here the distinct prompts run through the layers once (their keys and values kept
per layer), and the responses run after them, every response attending to its own prompt's keys
and values and causally to itself. Gradients flow back into the shared prompt computation from
all of its samples, so the loss and its gradients are those of the plain forward (to float
rounding; ``tests/sampling/test_shared_prompt.py``), at ``G``-fold less work on the prompt tokens.
The output head runs only where a response token is scored.

For the models the fast decoder supports (:func:`rredcot.sampling.decode.unsupported_reason`), without
gradient checkpointing; :func:`forward` returns None where nothing is shared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rredcot.sampling.decode import base_model, rotate_half
from rredcot.sampling.decode import unsupported_reason as decoder_unsupported


def unsupported_reason(policy) -> str | None:
    """Why :func:`forward` cannot run ``policy``, in a phrase; None when it can."""
    why = decoder_unsupported(policy)
    if why is not None:
        return why
    inner = base_model(policy).model
    if getattr(inner, "gradient_checkpointing", False):
        return "gradient checkpointing"
    return None


def prompt_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first (U,), inverse (B,))``: a row holding each of the ``U`` distinct prompts (ids and
    mask of the first ``prompt_len`` columns), and the distinct prompt of every row."""
    key = torch.cat([input_ids[:, :prompt_len], attention_mask[:, :prompt_len].long()], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(len(inverse), device=inverse.device)
    first = torch.full((int(inverse.max()) + 1,), len(inverse), device=inverse.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    return first, inverse


def _attend(attn, q, k, v, mask, groups: int) -> torch.Tensor:
    """``q (N, H, n, D)``, ``k``, ``v (N, H_kv, S, D)``, boolean ``mask (N, 1, n, S)`` ->
    ``(N, n, H * D)``."""
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def forward(
    policy,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    hidden_layers: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The logits that score the response tokens, with every distinct prompt computed once.

    Args:
        input_ids, attention_mask: ``(B, L)``, prompts left-padded to ``prompt_len`` columns.
        hidden_layers: indices into Hugging Face's ``hidden_states`` (0 the embeddings, ``i``
            the output of layer ``i``, the last one after the final norm) to return.

    Returns ``(logits (B, T, V), hidden (B, L, H * len(hidden_layers)) | None)`` with
    ``logits[:, t]`` the logits of response token ``t`` (those of position ``P - 1 + t``), or
    None when no two rows share a prompt (the plain forward is then as cheap).
    """
    P = prompt_len
    B, L = input_ids.shape
    if P == 0 or L == P:
        return None
    first, inverse = prompt_groups(input_ids, attention_mask, P)
    if len(first) == B:
        return None
    model = base_model(policy)
    inner = model.model
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    see_p, see_r = _visibility(attention_mask.bool(), first, inverse, P)
    xp = inner.embed_tokens(input_ids[first, :P])
    xr = inner.embed_tokens(input_ids[:, P:])
    rot_p = tuple(t.unsqueeze(1) for t in inner.rotary_emb(xp, positions[first, :P]))
    rot_r = tuple(t.unsqueeze(1) for t in inner.rotary_emb(xr, positions[:, P:]))
    states = _layers(model, xp, xr, rot_p, rot_r, see_p, see_r, inverse)
    xp, xr = states[-1]
    # the first response token is scored at the prompt's last position, the others at the
    # response positions before them
    first_logits = model.lm_head(inner.norm(xp[:, -1:]))[inverse]
    logits = torch.cat([first_logits, model.lm_head(inner.norm(xr[:, :-1]))], dim=1)
    hidden = None
    if hidden_layers is not None:
        states[-1] = (inner.norm(xp), inner.norm(xr))  # as Hugging Face's hidden_states
        hidden = torch.cat(
            [torch.cat([states[i][0][inverse], states[i][1]], dim=1) for i in hidden_layers],
            dim=-1,
        )
    return logits, hidden


def _visibility(
    mask: torch.Tensor, first: torch.Tensor, inverse: torch.Tensor, P: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Who sees whom (boolean attention masks): ``(U, 1, P, P)`` among the distinct prompts'
    tokens, ``(B, 1, T, P + T)`` of the responses over their prompt and themselves. Causal
    within a part, padding masked; a query also sees itself, so that no padding query's row is
    empty (its output is never read)."""
    B, L = mask.shape
    T = L - P
    device = mask.device
    prompt_mask, response_mask = mask[first, :P], mask[:, P:]
    causal_p = torch.ones(P, P, dtype=torch.bool, device=device).tril()
    eye_p = torch.eye(P, dtype=torch.bool, device=device)
    see_p = ((causal_p & prompt_mask[:, None, :]) | eye_p)[:, None]  # (U, 1, P, P)
    causal_r = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    eye_r = torch.eye(T, dtype=torch.bool, device=device)
    see_own = (causal_r & response_mask[:, None, :]) | eye_r  # (B, T, T)
    see_prompt = prompt_mask[inverse][:, None, :].expand(B, T, P)
    see_r = torch.cat([see_prompt, see_own], dim=-1)[:, None]  # (B, 1, T, P + T)
    return see_p, see_r


def _layers(model, xp, xr, rot_p, rot_r, see_p, see_r, inverse) -> list[tuple]:
    """Run the prompts ``xp (U, P, H)`` and the responses ``xr (B, T, H)`` through every layer,
    each response reading its prompt's keys and values; ``rot_p``, ``rot_r``: their rotary
    ``(cos, sin)``. Returns ``(xp, xr)`` before the first layer and after each."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    groups = heads // kv_heads

    def qkv(attn, h, cos, sin):
        N, n, _ = h.shape
        q = attn.q_proj(h).view(N, n, heads, head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(N, n, kv_heads, head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(N, n, kv_heads, head_dim).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    states = [(xp, xr)]
    for layer in model.model.layers:
        attn = layer.self_attn
        qp, kp, vp = qkv(attn, layer.input_layernorm(xp), *rot_p)
        qr, kr, vr = qkv(attn, layer.input_layernorm(xr), *rot_r)
        keys = torch.cat([kp[inverse], kr], dim=2)  # every response reads its prompt's keys
        values = torch.cat([vp[inverse], vr], dim=2)
        xp = xp + attn.o_proj(_attend(attn, qp, kp, vp, see_p, groups))
        xr = xr + attn.o_proj(_attend(attn, qr, keys, values, see_r, groups))
        xp = xp + layer.mlp(layer.post_attention_layernorm(xp))
        xr = xr + layer.mlp(layer.post_attention_layernorm(xr))
        states.append((xp, xr))
    return states

"""The policy's forward passes over ``[prompt | response]`` rows, which sampling, the loss, the
credit methods and the KL reference share, so that they agree on positions, masks and temperature:

- :func:`policy_forward`: one forward (with or without a graph): the response tokens' log-probs
  (:func:`chosen_token_logprobs`, chunked), optionally their entropies and the chosen layers'
  hidden states; the rows that share a prompt compute it once where
  :func:`shared_prompt_forward` supports the model, else the model's own forward;
- :func:`scoring_forward`: the no-grad pass in micro-batches (old log-probs, the KL reference,
  credit scoring); :func:`fill_forward` fills a fresh batch's old log-probs, hidden states and
  entropies with it;
- the policy's modes around them: :func:`eval_mode`, :func:`train_mode_without_dropout`.

Sampling (:mod:`rredcot.sampling.rollout`) makes the batch; this module scores it.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rredcot.sampling import decode
from rredcot.sampling.batch import RolloutBatch
from rredcot.sampling.memory import micro_batches

__all__ = [
    "LOGSOFTMAX_CHUNK_BYTES",
    "ForwardOutput",
    "chosen_token_logprobs",
    "eval_mode",
    "fill_forward",
    "policy_forward",
    "position_ids_from_mask",
    "prompt_groups",
    "scoring_forward",
    "shared_prompt_forward",
    "shared_prompt_unsupported_reason",
    "train_mode_without_dropout",
]


@contextlib.contextmanager
def eval_mode(policy):
    """Run a block with the policy in eval mode, restoring its mode afterwards."""
    was_training = policy.training
    policy.eval()
    try:
        yield policy
    finally:
        policy.train(was_training)


def train_mode_without_dropout(model) -> None:
    """Training mode with every dropout off (hidden, attention and LoRA dropout), so the loss
    pass scores the same distribution as the no-grad scoring pass and the PPO ratio is exactly 1
    on-policy. Training mode itself stays on, which gradient checkpointing needs."""
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) or hasattr(module, "attention_dropout"):
            module.eval()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` computes them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class ForwardOutput:
    logprobs: torch.Tensor  # (B, T) log pi(y_t | y_<t) of the response tokens
    entropy: torch.Tensor | None  # (B, T)
    hidden_states: torch.Tensor | None  # (B, L, H * n_layers)


def policy_forward(
    policy,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    *,
    with_entropy: bool = False,
    hidden_layers: tuple[int, ...] | None = None,
    temperature: float = 1.0,
    shared_prompt: bool = True,
) -> ForwardOutput:
    """One forward pass over ``[prompt | response]``: response log-probs (and optionally the
    entropy and the hidden states of the chosen layers, concatenated on the last dim).

    With ``shared_prompt`` (and a model :func:`shared_prompt_forward` supports) the rows that
    share a prompt compute it once; the output head only ever runs where a response token is
    scored. The entropy is a metric (and the entropy segmenters' input): computed without a
    graph."""
    logits, hidden = None, None
    if shared_prompt and shared_prompt_unsupported_reason(policy) is None:
        shared = shared_prompt_forward(policy, input_ids, attention_mask, prompt_len, hidden_layers)
        if shared is not None:
            logits, hidden = shared
    if logits is None:
        logits, hidden = _plain_forward(
            policy, input_ids, attention_mask, prompt_len, hidden_layers
        )
    targets = input_ids[:, prompt_len:]
    logprobs, entropy = chosen_token_logprobs(logits, targets, temperature, with_entropy)
    return ForwardOutput(logprobs, entropy, hidden)


LOGSOFTMAX_CHUNK_BYTES = 64 << 20
"""The float32 log-softmax of at most this many bytes of logits exists at a time
(:func:`chosen_token_logprobs`)."""


def chosen_token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_bytes: int = LOGSOFTMAX_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / temperature)`` at ``targets``, ``(..., T)``, and optionally the
    entropy of the same distribution (no graph), from ``logits (..., T, V)`` of any float dtype.

    The float32 log-softmax runs over row chunks of at most ``chunk_bytes`` and is never kept:
    the backward recomputes it chunk by chunk, so no full-vocabulary copy of the batch's logits
    exists besides the logits and their gradient. Values, entropies and gradients are bit-identical
    to ``F.log_softmax(logits.float() / temperature).gather(...)`` (the same kernels row by row;
    ``tests/sampling/test_micro_batch.py``)."""
    return _ChosenLogprobs.apply(logits, targets, float(temperature), with_entropy, chunk_bytes)


class _ChosenLogprobs(torch.autograd.Function):
    """:func:`chosen_token_logprobs`: chunked forward, log-softmax recomputed in the backward."""

    @staticmethod
    def _chunks(logits: torch.Tensor, chunk_bytes: int):
        V = logits.shape[-1]
        flat = logits.reshape(-1, V)
        step = max(1, chunk_bytes // (4 * V))
        return flat, [slice(s, s + step) for s in range(0, flat.shape[0], step)]

    @staticmethod
    def _log_softmax(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
        chunk = chunk.float()
        if temperature != 1.0:
            chunk = chunk / temperature
        return F.log_softmax(chunk, dim=-1)

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, chunk_bytes):
        flat, chunks = _ChosenLogprobs._chunks(logits, chunk_bytes)
        index = targets.reshape(-1, 1)
        chosen = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(chosen) if with_entropy else None
        for sl in chunks:
            logp = _ChosenLogprobs._log_softmax(flat[sl], temperature)
            chosen[sl] = logp.gather(-1, index[sl]).squeeze(-1)
            if entropy is not None:
                entropy[sl] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.chunk_bytes = temperature, chunk_bytes
        if entropy is None:
            return chosen.view(targets.shape), None
        entropy = entropy.view(targets.shape)
        ctx.mark_non_differentiable(entropy)
        return chosen.view(targets.shape), entropy

    @staticmethod
    def backward(ctx, grad_chosen, _grad_entropy):
        logits, targets = ctx.saved_tensors
        flat, chunks = _ChosenLogprobs._chunks(logits, ctx.chunk_bytes)
        index = targets.reshape(-1, 1)
        grad_flat = grad_chosen.reshape(-1, 1).float()
        grad_logits = torch.empty_like(flat)
        for sl in chunks:
            logp = _ChosenLogprobs._log_softmax(flat[sl], ctx.temperature)
            # what gather's and log_softmax's own backwards compute, in the same kernels
            picked = torch.zeros_like(logp).scatter_(-1, index[sl], grad_flat[sl])
            grad = torch._log_softmax_backward_data(picked, logp, -1, torch.float32)
            if ctx.temperature != 1.0:
                grad = grad / ctx.temperature
            grad_logits[sl] = grad.to(flat.dtype)
        return grad_logits.view(logits.shape), None, None, None, None


@torch.no_grad()
def scoring_forward(
    policy,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    *,
    micro_batch_tokens: int = 0,
    **options,
) -> ForwardOutput:
    """:func:`policy_forward` without a graph, ``micro_batch_tokens`` tokens (rows x padded
    length) at a time (0: all rows at once), its outputs concatenated over the rows: the
    memory of a no-grad pass (old log-probs, the KL reference, credit scoring, diagnose)
    grows with the micro-batch, not the batch. Row by row the same values as one forward."""
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    budget = micro_batch_tokens or input_ids.numel()
    parts = [
        policy_forward(policy, input_ids[m], attention_mask[m], prompt_len, **options)
        for m in micro_batches(rows, input_ids.shape[1], budget)
    ]
    if len(parts) == 1:
        return parts[0]

    def cat(name: str) -> torch.Tensor | None:
        tensors = [getattr(part, name) for part in parts]
        return None if tensors[0] is None else torch.cat(tensors)

    return ForwardOutput(cat("logprobs"), cat("entropy"), cat("hidden_states"))


def _keeps_logits(policy) -> bool:
    """Whether ``policy``'s forward takes ``logits_to_keep`` (most transformers LMs)."""
    model = decode.base_model(getattr(policy, "module", policy))
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _plain_forward(policy, input_ids, attention_mask, prompt_len, hidden_layers):
    """The model's own forward: ``(logits (B, T, V) of the response tokens, hidden | None)``,
    the output head applied only from the prompt's last position on where the model allows."""
    T = input_ids.shape[1] - prompt_len
    keep = {"logits_to_keep": T + 1} if _keeps_logits(policy) else {}
    out = policy(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        output_hidden_states=hidden_layers is not None,
        use_cache=False,
        **keep,
    )
    logits = out.logits[:, :-1] if keep else out.logits[:, prompt_len - 1 : -1]
    hidden = None
    if hidden_layers is not None:
        hidden = torch.cat([out.hidden_states[i] for i in hidden_layers], dim=-1)
    return logits, hidden


@torch.no_grad()
def fill_forward(
    policy,
    batch: RolloutBatch,
    hidden_layers: tuple[int, ...] | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    shared_prompt: bool = True,
    micro_batch_tokens: int = 0,
) -> RolloutBatch:
    """The no-grad scoring pass over a fresh batch: old log-probs (at the sampling temperature,
    so they score what was sampled), optionally the hidden states the value head reads and the
    entropies entropy segmentation reads (``batch.entropies``); ``micro_batch_tokens`` at a
    time (:func:`scoring_forward`)."""
    with eval_mode(policy):
        fwd = scoring_forward(
            policy,
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_len,
            micro_batch_tokens=micro_batch_tokens,
            hidden_layers=hidden_layers,
            temperature=temperature,
            with_entropy=with_entropy,
            shared_prompt=shared_prompt,
        )
    return batch.replace(
        entropies=fwd.entropy, old_logprobs=fwd.logprobs, hidden_states=fwd.hidden_states
    )


# ---------------------------------------------------------------------------------------------
# the shared-prompt forward (formerly rredcot.sampling.shared_prompt)
#
# The policy forward over ``[prompt | response]`` rows with each distinct prompt computed once.
#
# An RL batch holds ``G`` samples of every prompt, so a plain forward computes every prompt ``G``
# times over. Here the distinct prompts run through the layers once (their keys and values kept
# per layer), and the responses run after them, every response attending to its own prompt's keys
# and values and causally to itself. Gradients flow back into the shared prompt computation from
# all of its samples, so the loss and its gradients are those of the plain forward (to float
# rounding; ``tests/sampling/test_shared_prompt.py``), at ``G``-fold less work on the prompt tokens.
# The output head runs only where a response token is scored.
#
# For the models the fast decoder supports (:func:`rredcot.sampling.decode.unsupported_reason`),
# without gradient checkpointing; :func:`shared_prompt_forward` returns None where nothing is
# shared.


def shared_prompt_unsupported_reason(policy) -> str | None:
    """Why :func:`shared_prompt_forward` cannot run ``policy``, in a phrase; None when it can."""
    why = decode.unsupported_reason(policy)
    if why is not None:
        return why
    inner = decode.base_model(policy).model
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


def shared_prompt_forward(
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
    model = decode.base_model(policy)
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
        return q * cos + decode.rotate_half(q) * sin, k * cos + decode.rotate_half(k) * sin, v

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

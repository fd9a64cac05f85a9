"""The policy's forward passes over ``[prompt | response]`` rows, which sampling, the loss, the
credit methods and the KL reference share, so that they agree on positions, masks and temperature:

- :func:`policy_forward`: one forward (with or without a graph): the response tokens' log-probs
  (:func:`chosen_token_logprobs`, chunked), optionally their entropies and the chosen layers'
  hidden states; the rows that share a prompt compute it once where
  :mod:`rredcot.sampling.shared_prompt` supports the model, else the model's own forward;
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
from rredcot.sampling import shared_prompt as shared_prompt_forward
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
    "scoring_forward",
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

    With ``shared_prompt`` (and a model :mod:`rredcot.sampling.shared_prompt` supports) the rows that
    share a prompt compute it once; the output head only ever runs where a response token is
    scored. The entropy is a metric (and the entropy segmenters' input): computed without a
    graph."""
    logits, hidden = None, None
    if shared_prompt and shared_prompt_forward.unsupported_reason(policy) is None:
        shared = shared_prompt_forward.forward(
            policy, input_ids, attention_mask, prompt_len, hidden_layers
        )
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

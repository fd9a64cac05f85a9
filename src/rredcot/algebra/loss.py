"""The policy loss as pure functions over tensors: the clipped PPO ratio term, LUFFY's shaped
term of an off-policy (reference) row, the k3 KL penalty, and the aggregation over tokens (token
mean, sequence mean, Dr. GRPO's constant).

Shapes: ``(b, T)`` for a micro-batch of ``b`` rows and ``T`` response columns; every reduction is
masked by ``response_mask``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "LOSS_AGGREGATIONS",
    "LossSettings",
    "aggregate",
    "clipped_pg",
    "k3_kl",
    "lr_lambda",
    "off_policy_pg",
    "policy_loss",
    "shaped_ratio",
]

LOSS_AGGREGATIONS = ("token_mean", "seq_mean", "dr_grpo")


def clipped_pg(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped objective per token, as a loss: ``max(-A r, -A clip(r, 1-eps_low,
    1+eps_high))`` with ``r = exp(logprobs - old_logprobs)``.

    Returns ``(per_token (b, T), ratio (b, T), was_clipped (b, T) bool)``; ``was_clipped``
    marks tokens where the clipped branch won (their gradient is cut).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), ratio, clipped > unclipped


def shaped_ratio(logprobs: Tensor, gamma: float) -> Tensor:
    """LUFFY's policy shaping of the off-policy ratio ``pi_theta / pi_phi`` with ``pi_phi = 1``:
    ``f(pi) = pi / (pi + gamma)``, ``pi = exp(logprobs)``; ``(b, T)``."""
    pi = torch.exp(logprobs)
    return pi / (pi + gamma)


def off_policy_pg(logprobs: Tensor, advantages: Tensor, gamma: float) -> Tensor:
    """The per-token loss of an off-policy (reference) sample: ``-A * f(pi_theta)``
    (:func:`shaped_ratio`), no clipping: the PG term of a ``references.mode luffy`` row
    (``rredcot.training.references``); ``(b, T)``."""
    return -advantages * shaped_ratio(logprobs, gamma)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(policy || reference) per token: ``e^d - d - 1``,
    ``d = ref - logprobs``; ``(b, T)``, non-negative."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def aggregate(
    per_token: Tensor,
    response_mask: Tensor,
    loss_agg: str,
    *,
    num_rows: int,
    num_tokens: float,
    max_len: int,
    row_tokens: Tensor | None = None,
) -> Tensor:
    """Reduce a ``(b, T)`` per-token loss to a scalar.

    ``num_rows`` / ``num_tokens`` are the rows and valid tokens of the whole minibatch, so that
    micro-batches accumulate to the minibatch's aggregate; ``max_len`` is Dr. GRPO's constant
    ``T_max``; ``row_tokens`` ``(b,)``: each row's response tokens where the per-token loss
    covers only its first columns (rows cut after their last credited token), so that
    ``seq_mean`` divides by the whole row's length (default: counted from ``response_mask``).
    """
    masked = per_token * response_mask
    if loss_agg == "token_mean":
        return masked.sum() / max(num_tokens, 1.0)
    if loss_agg == "seq_mean":
        lengths = response_mask.sum(-1) if row_tokens is None else row_tokens
        lengths = lengths.to(masked.dtype).clamp_min(1.0)
        return (masked.sum(-1) / lengths).sum() / max(num_rows, 1)
    if loss_agg == "dr_grpo":
        return masked.sum() / (max(num_rows, 1) * max_len)
    raise ValueError(f"loss_agg={loss_agg!r}: use {', '.join(LOSS_AGGREGATIONS)}")


@dataclass(frozen=True)
class LossSettings:
    """A run's settings of :func:`policy_loss` (``TrainConfig.loss_settings()`` makes them)."""

    clip_eps_low: float  # PPO's clip below: the ratio's floor is 1 - clip_eps_low
    clip_eps_high: float  # and above (DAPO's clip-higher when larger)
    loss_agg: str  # token_mean, seq_mean or dr_grpo (:func:`aggregate`)
    max_len: int  # dr_grpo's constant: the response length cap
    kl_coef: float = 0.0  # the k3 KL term's weight, where reference log-probs are passed
    off_policy_gamma: float = 0.1  # LUFFY's shaping of an off-policy row (:func:`shaped_ratio`)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    settings: LossSettings,
    *,
    num_rows: int,
    num_tokens: float,
    row_tokens: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    off_policy: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with an optional k3 KL penalty, aggregated by
    ``settings.loss_agg``.

    Args:
        logprobs, old_logprobs, advantages, response_mask: ``(b, T)`` for a micro-batch.
        settings: the clip range, aggregation, KL weight and LUFFY's gamma.
        num_rows, num_tokens, row_tokens: see :func:`aggregate` (``max_len`` is the settings').
        ref_logprobs: ``(b, T)``, the KL reference's; the KL term is formed where they are
            given and ``settings.kl_coef > 0``.
        off_policy: ``(b,)`` bool, rows that are reference samples (``references.mode luffy``):
            their PG term is LUFFY's shaped, unclipped one (:func:`off_policy_pg`), not the
            clipped ratio to ``old_logprobs``.

    Returns:
        the loss and ``{"clip_fraction", "kl", "ratio_mean"}`` over the micro-batch's tokens
        (the clip fraction counts the PPO term alone, before the KL is added).
    """
    per_token, ratio, was_clipped = clipped_pg(
        logprobs, old_logprobs, advantages, settings.clip_eps_low, settings.clip_eps_high
    )
    if off_policy is not None and bool(off_policy.any()):
        rows = off_policy.to(per_token.device)[:, None]
        shaped = off_policy_pg(logprobs, advantages, settings.off_policy_gamma)
        per_token = torch.where(rows, shaped, per_token)
        was_clipped = was_clipped & ~rows
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None and settings.kl_coef > 0:
        kl = k3_kl(logprobs, ref_logprobs)
        per_token = per_token + settings.kl_coef * kl
    loss = aggregate(
        per_token,
        response_mask,
        settings.loss_agg,
        num_rows=num_rows,
        num_tokens=num_tokens,
        max_len=settings.max_len,
        row_tokens=row_tokens,
    )
    with torch.no_grad():
        n = response_mask.sum().clamp_min(1.0)
        stats = {
            "clip_fraction": float((was_clipped.float() * response_mask).sum() / n),
            "kl": float((kl * response_mask).sum() / n),
            "ratio_mean": float((ratio * response_mask).sum() / n),
        }
    return loss, stats


def lr_lambda(schedule: str, warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate multiplier of step ``step``: linear warm-up over ``warmup`` steps,
    then ``constant``, ``linear`` decay to 0 or ``cosine`` decay to 0 at ``total``."""

    def fn(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        progress = min(max(progress, 0.0), 1.0)
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return fn

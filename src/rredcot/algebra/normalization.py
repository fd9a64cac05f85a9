"""Reward statistics and the normalisation of advantages.

Masked statistics, the per-prompt group statistics GRPO reads, and the normaliser registry: a normaliser turns
the rows' rewards into a :class:`Scale` (each row's divisor, or whitening over the tokens), which
:func:`rredcot.algebra.credit.token_advantages` applies. The scale is computed on every row of a batch
(over all processes, where a batch is split) and may then be cut to a process's own rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rredcot.algebra.tensor_checks import as_bool, as_float, check_ndim, check_shape

__all__ = [
    "GRPO_SCALING",
    "Scale",
    "advantage_scale",
    "batch_std",
    "get_normalizer",
    "group_mean_std",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "normalize_advantages",
    "normalizer_names",
    "register_normalizer",
    "zero_variance_groups",
]


# --------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is True (0 when there are none).

    Args:
        x: any shape; mask: same shape; dim: reduce over this dim, or over everything if None.
    """
    check_shape(mask, tuple(x.shape), "mask", "(same as x)")
    mask = as_bool(mask)
    kept = torch.where(mask, x, torch.zeros_like(x))
    if dim is None:
        return kept.sum() / mask.sum().clamp_min(1)
    return kept.sum(dim=dim, keepdim=keepdim) / mask.sum(dim=dim, keepdim=keepdim).clamp_min(1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True, dim: int | None = None) -> Tensor:
    """Variance of ``x`` over positions where ``mask`` is True.

    ``unbiased`` applies Bessel's correction ``n / (n - 1)``. With fewer than two valid
    positions the variance is 0 (not NaN).
    """
    check_shape(mask, tuple(x.shape), "mask", "(same as x)")
    mask = as_bool(mask)
    keep = dim is not None
    mean = masked_mean(x, mask, dim=dim, keepdim=keep)
    centered = torch.where(mask, x - mean, torch.zeros_like(x))
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    sq = (centered**2).sum() if dim is None else (centered**2).sum(dim=dim)
    var = sq / count.clamp_min(1)
    if unbiased:
        var = torch.where(count > 1, var * count / (count - 1).clamp_min(1), torch.zeros_like(var))
    return var


def masked_whiten(
    x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8, min_std: float = 0.0
) -> Tensor:
    """Whiten ``x`` over the masked positions: ``(x - mean) / sqrt(var + eps)``; 0 on padding.

    ``shift_mean=False`` adds the mean back (rescale only). ``min_std`` floors the std so that a
    batch of near-zero values is not blown up to unit variance (default: no floor).
    """
    mask = as_bool(mask)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True).clamp_min(min_std**2)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros_like(whitened))


def group_mean_std(
    rewards: Tensor, group_ids: Tensor, leave_one_out: bool = False
) -> tuple[Tensor, Tensor]:
    """Per-prompt group statistics of the rewards, broadcast back to the rows.

    Groups are the rows that share a ``group_id`` (any integers, in any order). The std is
    GRPO's: ``torch.std`` with Bessel's correction over the group, as TRL's ``GRPOTrainer``
    (``nanstd``) computes it. A group of one row has std 0 (TRL gets NaN there and zeroes the
    advantage afterwards; the resulting advantage is 0 either way).

    With ``leave_one_out`` the mean of row ``i`` excludes the row itself (RLOO baseline:
    ``(sum_g - r_i) / (n_g - 1)``). A group of one row has no other rows: its baseline is the
    row's own reward, so its advantage is 0 as without leave-one-out (no signal from a prompt
    sampled once, instead of a baseline-free REINFORCE term). The std is the full group's.

    Args:
        rewards: ``(B,)`` float.
        group_ids: ``(B,)`` integer.

    Returns:
        mean ``(B,)`` and std ``(B,)``.
    """
    check_ndim(rewards, 1, "rewards", "(B,)")
    check_shape(group_ids, tuple(rewards.shape), "group_ids", "(B,)")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise TypeError(f"group_ids must be an integer tensor (B,), got {group_ids.dtype}")
    rewards = as_float(rewards)
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite; give unscorable completions a reward (e.g. 0)")

    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    count = count.index_add(0, inverse, torch.ones_like(rewards))[inverse]
    total = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    total = total.index_add(0, inverse, rewards)[inverse]
    mean = total / count

    sq = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    sq = sq.index_add(0, inverse, (rewards - mean) ** 2)[inverse]
    var = sq / count
    var = torch.where(count > 1, var * (count / (count - 1).clamp_min(1)), torch.zeros_like(var))
    std = torch.sqrt(var)

    if leave_one_out:
        others = (count - 1).clamp_min(1)
        mean = torch.where(count > 1, (total - rewards) / others, rewards)
    return mean, std


def zero_variance_groups(rewards: Tensor, group_ids: Tensor) -> float:
    """The fraction of prompt groups whose rewards are all equal (no GRPO signal: every row's
    advantage against its group's mean is 0). ``rewards``, ``group_ids``: ``(B,)``."""
    groups = group_ids.unique()
    zero = sum(int(rewards[group_ids == g].std(unbiased=False) == 0) for g in groups)
    return zero / max(len(groups), 1)


def batch_std(rewards: Tensor) -> Tensor:
    """Unbiased std of all rewards ``(B,)`` -> scalar, computed as TRL's ``nanstd``; 0 for B < 2."""
    count = rewards.numel()
    if count < 2:
        return torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    var = ((rewards - rewards.mean()) ** 2).mean()
    return torch.sqrt(var * (count / (count - 1)))


# --------------------------------------------------------------------------------------
# Advantage normalisation (registry)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scale:
    """How the token stage divides each row's advantages.

    Attributes:
        divisor: ``(B,)`` the divisor of each row (a std + eps), or None: no division.
        floored: ``(B,)`` bool, rows whose divisor the normaliser's std floor raised, or None
            (normalisers without a floor); there value credit's departure from GRPO keeps the
            floor and GRPO's own share is divided by ``grpo_divisor``.
        grpo_divisor: ``(B,)`` GRPO's divisor of each row (no floor), or None.
        whiten: whiten over all the tokens instead (``eps``, ``min_std``: its settings).
    """

    divisor: Tensor | None = None
    floored: Tensor | None = None
    grpo_divisor: Tensor | None = None
    whiten: bool = False
    eps: float = 1e-8
    min_std: float = 0.0

    def rows(self, index: slice | Tensor) -> Scale:
        """The scale of the rows ``index`` (a process's own rows of a global batch)."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return Scale(
            pick(self.divisor),
            pick(self.floored),
            pick(self.grpo_divisor),
            self.whiten,
            self.eps,
            self.min_std,
        )


Normalizer = Callable[..., Scale]
_NORMALIZERS: dict[str, Normalizer] = {}
# a normaliser with a std floor -> how GRPO scales its own share of value credit (TRL's
# scale_rewards "group" and "batch", no floor; see advantage_scale)
GRPO_SCALING = {"group_or_batch_std": "group_std", "batch_std": "batch_std"}


def register_normalizer(name: str) -> Callable[[Normalizer], Normalizer]:
    """Decorator: register ``fn(rewards, group_ids, *, eps, min_std) -> Scale``.

    The function gets the rows' rewards ``(B,)`` (float, in the advantages' dtype) and
    ``group_ids (B,)`` (or None). Its keyword defaults for ``eps`` and ``min_std`` are used when
    the caller passes None.
    """

    def decorator(fn: Normalizer) -> Normalizer:
        if name in _NORMALIZERS:
            raise ValueError(f"normalizer {name!r} is already registered")
        _NORMALIZERS[name] = fn
        return fn

    return decorator


def normalizer_names() -> list[str]:
    return sorted(_NORMALIZERS)


def get_normalizer(name: str) -> Normalizer:
    """Look up a registered normalizer; unknown names list the valid ones."""
    try:
        return _NORMALIZERS[name]
    except KeyError:
        valid = ", ".join(normalizer_names())
        raise ValueError(f"unknown advantage normalization {name!r}; valid: {valid}") from None


@register_normalizer("none")
def _scale_none(
    rewards: Tensor, group_ids: Tensor | None, *, eps: float = 1e-4, min_std: float = 0.0
) -> Scale:
    """Leave advantages as they are (``eps``/``min_std`` unused)."""
    return Scale()


@register_normalizer("batch_std")
def _scale_batch_std(
    rewards: Tensor, group_ids: Tensor | None, *, eps: float = 1e-4, min_std: float = 0.1
) -> Scale:
    """Divide by ``max(std of the batch's rewards, min_std) + eps``.

    The std is over rows (one reward per completion, unbiased), not tokens, so long responses
    do not weigh more. The ``min_std`` floor (default 0.1) keeps a batch whose rewards all agree
    (std 0) from multiplying value-based credit by ``1 / eps``: at most ``x 1/min_std``.
    """
    std = batch_std(rewards)
    return Scale(
        (std.clamp_min(min_std) + eps).expand_as(rewards), (std < min_std).expand_as(rewards)
    )


@register_normalizer("whiten")
def _scale_whiten(
    rewards: Tensor, group_ids: Tensor | None, *, eps: float = 1e-8, min_std: float = 0.0
) -> Scale:
    """Masked whitening over all response tokens of the batch (mean 0, std 1).

    ``min_std`` floors the token std (default none): whitening otherwise blows near-zero
    advantages up to unit variance.
    """
    return Scale(whiten=True, eps=eps, min_std=min_std)


@register_normalizer("group_std")
def _scale_group_std(
    rewards: Tensor, group_ids: Tensor | None, *, eps: float = 1e-4, min_std: float = 0.0
) -> Scale:
    """Divide each row by ``max(its group's reward std, min_std) + eps`` (GRPO's scaling).

    Only meaningful for uniform credit, where a group whose rewards agree has advantage 0
    anyway; with the default ``min_std = 0`` this reproduces GRPO exactly. Value-based credit
    is non-zero in such groups and gets multiplied by ``1 / eps = 10^4`` (docs/method.md, failure
    modes): use ``group_or_batch_std``, ``batch_std`` or ``whiten`` for it, or set ``min_std``.
    """
    if group_ids is None:
        raise ValueError("normalization 'group_std' needs group_ids (B,)")
    _, std = group_mean_std(rewards, group_ids)
    return Scale(std.clamp_min(min_std) + eps)


@register_normalizer("group_or_batch_std")
def _scale_group_or_batch_std(
    rewards: Tensor, group_ids: Tensor | None, *, eps: float = 1e-4, min_std: float = 0.1
) -> Scale:
    """GRPO's per-group scaling where it is safe: divide each row by its group's reward std, or,
    where that std is below ``min_std`` (a group whose rewards agree), by
    ``max(std of the batch's rewards, min_std)``.

    Uniform credit is then scaled exactly as GRPO scales it (its advantage is 0 in a group whose
    rewards agree), while value-based credit in such a group, which redistributes within each
    trace, is never multiplied by ``1 / eps`` (docs/method.md, failure modes).
    """
    if group_ids is None:
        raise ValueError("normalization 'group_or_batch_std' needs group_ids (B,)")
    _, std = group_mean_std(rewards, group_ids)
    fallback = batch_std(rewards).clamp_min(min_std)
    floored = std < min_std
    return Scale(torch.where(floored, fallback, std) + eps, floored)


def advantage_scale(
    rewards: Tensor,
    group_ids: Tensor | None,
    mode: str,
    eps: float | None = None,
    min_std: float | None = None,
    like: Tensor | None = None,
) -> Scale:
    """The :class:`Scale` of the normaliser ``mode`` for rows with ``rewards``.

    For the normalisers with a std floor (:data:`GRPO_SCALING`) it also holds GRPO's own divisor
    of the floored rows: value credit is GRPO's advantage plus its departure from it, and where the
    floor changed a row's divisor GRPO's share is divided as GRPO divides it (its group's or the
    batch's std + eps, however small: harmless, its numerator is as small) while the departure
    keeps the floor that stops value credit from being divided by ~0.

    Args:
        rewards: ``(B,)``; group_ids: ``(B,)`` integer or None (``group_std`` and
            ``group_or_batch_std`` need them).
        mode: a registered normaliser; ``eps`` / ``min_std``: its settings (None: its defaults).
        like: the advantages the scale will divide: the rewards are read in their dtype.
    """
    normalizer = get_normalizer(mode)
    check_ndim(rewards, 1, "rewards", "(B,)")
    if group_ids is not None:
        check_shape(group_ids, tuple(rewards.shape), "group_ids", "(B,)")
    kwargs = {}
    if eps is not None:
        kwargs["eps"] = eps
    if min_std is not None:
        kwargs["min_std"] = min_std
    r = as_float(rewards, like=like)
    scale = normalizer(r, group_ids, **kwargs)
    if mode not in GRPO_SCALING or group_ids is None or scale.floored is None:
        return Scale(scale.divisor, None, None, scale.whiten, scale.eps, scale.min_std)
    grpo = get_normalizer(GRPO_SCALING[mode])(r, group_ids, **{**kwargs, "min_std": 0.0})
    return Scale(scale.divisor, scale.floored, grpo.divisor)


def normalize_advantages(
    advantages: Tensor,
    response_mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor | None,
    mode: str,
    eps: float | None = None,
    min_std: float | None = None,
) -> Tensor:
    """Normalise token advantages with a registered normaliser (no GRPO share: see
    :func:`rredcot.algebra.credit.token_advantages` for value credit).

    Modes: ``"none"``; ``"batch_std"`` (divide by the std of the batch's rewards, floored at
    ``min_std = 0.1``); ``"whiten"`` (masked whitening over tokens); ``"group_std"`` (divide by
    each group's reward std + eps; for uniform credit only); ``"group_or_batch_std"``.
    ``eps`` / ``min_std`` = None use the mode's defaults (``eps``: 1e-4 added to a std; 1e-8
    added to the variance for ``whiten``).

    Args:
        advantages: ``(B, T)``; response_mask: ``(B, T)``; rewards: ``(B,)``;
        group_ids: ``(B,)`` integer (needed by the group modes).

    Returns:
        normalised advantages ``(B, T)``, 0 on padding.
    """
    get_normalizer(mode)
    check_ndim(advantages, 2, "advantages", "(B, T)")
    check_shape(response_mask, tuple(advantages.shape), "response_mask", "(B, T)")
    check_shape(rewards, (advantages.shape[0],), "rewards", "(B,)")
    advantages = as_float(advantages)
    scale = advantage_scale(rewards, group_ids, mode, eps, min_std, like=advantages)
    return apply_scale(advantages, response_mask, scale)


def apply_scale(tokens: Tensor, response_mask: Tensor, scale: Scale) -> Tensor:
    """``tokens (B, T)`` divided row by row as ``scale`` says (or whitened), 0 on padding."""
    if scale.whiten:
        return masked_whiten(
            tokens, response_mask, shift_mean=True, eps=scale.eps, min_std=scale.min_std
        )
    return divide_rows(tokens, as_bool(response_mask), scale.divisor)


def divide_rows(tokens: Tensor, mask: Tensor, divisor: Tensor | None) -> Tensor:
    """``tokens / divisor[b]`` where ``mask`` (as they are where ``divisor`` is None), 0
    elsewhere."""
    if divisor is not None:
        tokens = tokens / divisor.to(tokens.device, tokens.dtype)[:, None]
    return torch.where(mask, tokens, torch.zeros_like(tokens))

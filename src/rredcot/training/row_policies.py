"""The update's row policies: which rows and tokens of a step's credited batch the policy update
forwards, after the credit algebra (:mod:`rredcot.algebra.credit`) has made the token
advantages. Pure tensor functions, torch only, shapes in each docstring:

- :func:`drop_small_tails`: each row's advantages cut after its last token with ``|A| >=``
  ``advantage_tail_floor`` (``rredcot train``, TRL's and verl's adapters);
- :func:`sample_rows_to_budget` (and its three stages, for rows split across processes): the
  agreeing groups' rows drawn to ``agreeing_update_fraction`` of their tokens, without bias;
- :func:`last_positions`: the response columns an update must forward to reach a row's last
  credited token (``skip_zero_advantage_rows``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rredcot.algebra.tensor_checks import check_ndim, check_shape

__all__ = [
    "agreeing_rows",
    "credited_columns",
    "forwarded_columns",
    "update_rows",
    "apply_row_draw",
    "budget_keep_probabilities",
    "drop_small_tails",
    "last_positions",
    "row_credit_sizes",
    "sample_rows_to_budget",
]


def agreeing_rows(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """``(B,)`` bool: the rows of groups whose samples all got the same reward, where GRPO's
    advantage is 0 and only finer credit gives them a gradient.

    Args:
        rewards: ``(B,)``; group_ids: ``(B,)`` long.
    """
    check_ndim(rewards, 1, "rewards", "(B,)")
    check_shape(group_ids, tuple(rewards.shape), "group_ids", "(B,)")
    return _agreeing_rows(rewards, group_ids)


def sample_rows_to_budget(
    advantages: Tensor,
    response_mask: Tensor,
    eligible: Tensor,
    fraction: float,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Update on an expected ``fraction`` of the eligible rows' credited tokens, without bias.

    Row ``b`` (eligible, credited tokens ``n_b`` up to its last non-zero advantage, credit norm
    ``m_b = ||A_b||``) is kept with probability ``p_b = min(1, c m_b / sqrt(n_b))``, ``c`` set
    so that ``sum_b p_b n_b = fraction * sum_b n_b`` (the draw of least variance for that
    expected cost), and its advantages are divided by ``p_b``; a row not drawn gets 0, so the
    update skips it (``skip_zero_advantage_rows``). ``E[output] = advantages``: an on-policy
    policy gradient is linear in ``A``, so its expectation is unchanged. Rows not eligible pass
    through; ``fraction`` 1 returns ``advantages`` itself. The three stages
    (:func:`row_credit_sizes`, :func:`budget_keep_probabilities`, :func:`apply_row_draw`) are
    public so that rows split across processes can be drawn as one batch: the sizes gathered,
    the probabilities and one uniform draw over every row, each process keeping its slice.

    Args:
        advantages: ``(B, T)``; response_mask: ``(B, T)``; eligible: ``(B,)`` bool.
        fraction: in ``(0, 1]``.

    Returns:
        ``(advantages (B, T), keep_probability (B,))``, the probability 1 for rows passed through.
    """
    check_ndim(advantages, 2, "advantages", "(B, T)")
    check_shape(response_mask, tuple(advantages.shape), "response_mask", "(B, T)")
    check_shape(eligible, (advantages.shape[0],), "eligible", "(B,)")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction} must be in (0, 1]")
    if fraction == 1:
        keep = torch.ones(advantages.shape[0], dtype=torch.float64, device=advantages.device)
        return advantages, keep
    return _drawn_to_budget(advantages, response_mask, eligible, fraction, generator, _one_process)


def row_credit_sizes(advantages: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(tokens (B,), norm (B,))`` float64: each row's credited tokens up to its last non-zero
    advantage (the columns its update forwards) and the norm of its advantages.

    Args:
        advantages: ``(B, T)``; response_mask: ``(B, T)``.
    """
    check_ndim(advantages, 2, "advantages", "(B, T)")
    check_shape(response_mask, tuple(advantages.shape), "response_mask", "(B, T)")
    return _row_credit_sizes(advantages, response_mask)


def budget_keep_probabilities(
    tokens: Tensor, norm: Tensor, eligible: Tensor, fraction: float
) -> Tensor:
    """``(B,)`` float64 keep probabilities of :func:`sample_rows_to_budget`: ``min(1, c m_b /
    sqrt(n_b))`` for eligible rows with credit (``c`` by water-filling, so that the expected
    credited tokens are ``fraction`` of theirs), 1 for the others.

    Args:
        tokens, norm: ``(B,)`` from :func:`row_credit_sizes`; eligible: ``(B,)`` bool.
        fraction: in ``(0, 1]``.
    """
    check_ndim(tokens, 1, "tokens", "(B,)")
    check_shape(norm, tuple(tokens.shape), "norm", "(B,)")
    check_shape(eligible, tuple(tokens.shape), "eligible", "(B,)")
    return _budget_keep_probabilities(tokens, norm, eligible, fraction)


def apply_row_draw(advantages: Tensor, keep: Tensor, draw: Tensor) -> Tensor:
    """``(B, T)``: row ``b``'s advantages divided by ``keep[b]`` where ``draw[b] < keep[b]``,
    0 elsewhere (the row is skipped). ``keep``, ``draw``: ``(B,)``, ``draw`` uniform in [0, 1).

    Args:
        advantages: ``(B, T)``; keep: ``(B,)`` in (0, 1]; draw: ``(B,)``.
    """
    check_ndim(advantages, 2, "advantages", "(B, T)")
    check_shape(keep, (advantages.shape[0],), "keep", "(B,)")
    check_shape(draw, (advantages.shape[0],), "draw", "(B,)")
    return _apply_row_draw(advantages, keep, draw)


def drop_small_tails(advantages: Tensor, response_mask: Tensor, floor: float) -> Tensor:
    """Zero each row's advantages after its last token with ``|A| >= floor`` (all of a row's,
    where none is): the update can stop there (``skip_zero_advantage_rows``). ``floor`` 0
    returns ``advantages`` unchanged.

    Args:
        advantages: ``(B, T)`` token advantages; response_mask: ``(B, T)``.

    Returns:
        ``(B, T)``, equal to ``advantages`` up to each row's last kept token, 0 after it.
    """
    check_ndim(advantages, 2, "advantages", "(B, T)")
    check_shape(response_mask, tuple(advantages.shape), "response_mask", "(B, T)")
    return _drop_small_tails(advantages, response_mask, floor)


def last_positions(mask: Tensor) -> Tensor:
    """``(B,)`` long: each row's 1-based position of its last True in ``mask`` ``(B, T)``, 0 in a
    row with none (the columns an update must forward to reach it)."""
    check_ndim(mask, 2, "mask", "(B, T)")
    return _last_positions(mask)


# -- the step's rows, in one call (rredcot train); the public functions above check their inputs,
# these trust the trainer's, which the credit algebra has checked


def update_rows(
    advantages: Tensor,
    response_mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor,
    *,
    tail_floor: float,
    agreeing_fraction: float,
    gather: Callable[[list[Tensor]], tuple[int, list[Tensor]]],
    generator: torch.Generator,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The advantages ``(B, T)`` the update uses: the tails below ``tail_floor`` cut
    (:func:`drop_small_tails`), then the agreeing groups' rows drawn to ``agreeing_fraction`` of
    their tokens (:func:`sample_rows_to_budget`) over every process's rows: ``gather`` maps
    per-row columns ``(B,)`` to ``(start, every process's rows in order)``, and the draw of
    ``generator`` over all of them is one process's holding them all.

    Returns ``(advantages, counts)``; ``counts`` (drawn only): this process's ``kept`` and
    ``credited`` agreeing rows, scalars.
    """
    advantages = _drop_small_tails(advantages, response_mask, tail_floor)
    if agreeing_fraction == 1:
        return advantages, {}
    eligible = _agreeing_rows(rewards, group_ids).to(advantages.device)
    out, _ = _drawn_to_budget(
        advantages, response_mask, eligible, agreeing_fraction, generator, gather
    )
    credited = (advantages != 0).any(dim=1) & eligible
    kept = (out != 0).any(dim=1) & credited
    return out, {"kept": kept.sum(), "credited": credited.sum()}


def forwarded_columns(advantages: Tensor, response_mask: Tensor, *, cut: bool) -> Tensor:
    """``(B,)`` long, on the CPU: how many response columns of each row the update forwards,
    computed once per step from its advantages ``(B, T)``. All of them, unless ``cut``
    (``skip_zero_advantage_rows`` where no KL term is formed); then a row is forwarded up to its
    last token with a non-zero advantage, and a row with none gets 0 (left out;
    :func:`credited_columns`). Past that token the PG term is zero in both branches
    (``ratio * 0``; LUFFY's shaped term ``-0 * f``), and a causal model's earlier tokens never
    read the later ones, so the cut adds nothing to the loss or any gradient under every
    aggregation (their normalisers are the whole rows', passed on their own). Under several
    processes each cuts its own rows (the trainer evens out their passes)."""
    rows = torch.arange(advantages.shape[0])
    if not cut:
        return torch.full((len(rows),), response_mask.shape[1], dtype=torch.long)
    return credited_columns(advantages, response_mask, rows)


def credited_columns(advantages: Tensor, response_mask: Tensor, rows: Tensor) -> Tensor:
    """``(len(rows),)`` long: the response columns the update forwards of each of ``rows``, up
    to its last token with a non-zero advantage (0: none; ``skip_zero_advantage_rows``)."""
    here = rows.to(advantages.device)
    credited = (advantages[here] != 0) & (response_mask[here] != 0)
    return _last_positions(credited).to(rows.device)


def _drawn_to_budget(advantages, response_mask, eligible, fraction, generator, gather):
    """:func:`sample_rows_to_budget`'s draw over every process's rows (``gather``, as in
    :func:`update_rows`): ``(advantages (B, T), this process's keep probabilities (B,))``."""
    tokens, norm = _row_credit_sizes(advantages, response_mask)
    start, (tokens, norm, every) = gather([tokens, norm, eligible])
    keep = _budget_keep_probabilities(tokens, norm, every, fraction)
    draw = torch.rand(len(keep), generator=generator, dtype=torch.float64)
    mine = slice(start, start + advantages.shape[0])
    return _apply_row_draw(advantages, keep[mine], draw[mine]), keep[mine]


def _one_process(columns: list[Tensor]) -> tuple[int, list[Tensor]]:
    """The ``gather`` of rows all held by one process."""
    return 0, columns


def _agreeing_rows(rewards: Tensor, group_ids: Tensor) -> Tensor:
    r = rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())
    _, inverse = torch.unique(group_ids.to(r.device), return_inverse=True)
    groups = int(inverse.max()) + 1 if len(r) else 0
    low = torch.full((groups,), float("inf"), dtype=r.dtype, device=r.device)
    high = torch.full((groups,), float("-inf"), dtype=r.dtype, device=r.device)
    low = low.scatter_reduce(0, inverse, r, "amin")
    high = high.scatter_reduce(0, inverse, r, "amax")
    return (low == high)[inverse]


def _row_credit_sizes(advantages: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    credited = (advantages != 0) & (response_mask != 0).to(advantages.device)
    tokens = _last_positions(credited).double()
    norm = (advantages.double() * credited).square().sum(dim=1).sqrt()
    return tokens, norm


def _budget_keep_probabilities(
    tokens: Tensor, norm: Tensor, eligible: Tensor, fraction: float
) -> Tensor:
    tokens, norm = tokens.double(), norm.double().to(tokens.device)
    eligible = (eligible != 0).to(tokens.device)
    live = eligible & (norm > 0)
    weight = torch.where(live, norm / tokens.clamp(min=1).sqrt(), torch.zeros((), dtype=norm.dtype))
    budget = fraction * float(tokens[live].sum())
    capped = torch.zeros_like(live)
    scale = 0.0
    for _ in range(int(live.sum()) + 1):  # water-filling: rows at p = 1 leave the rest less
        free = live & ~capped
        scale = (budget - float(tokens[capped].sum())) / max(
            float((weight * tokens)[free].sum()), 1e-300
        )
        now = live & (capped | (scale * weight >= 1))
        if bool((now == capped).all()):
            break
        capped = now
    prob = torch.where(capped, torch.ones_like(weight), (scale * weight).clamp(max=1.0))
    return torch.where(eligible, prob, torch.ones_like(prob))


def _apply_row_draw(advantages: Tensor, keep: Tensor, draw: Tensor) -> Tensor:
    keep = keep.to(advantages.device)
    drawn = draw.to(keep.device) < keep
    scaled = advantages / keep.clamp(min=1e-12).to(advantages.dtype)[:, None]
    return torch.where(drawn[:, None], scaled, torch.zeros((), dtype=advantages.dtype))


def _drop_small_tails(advantages: Tensor, response_mask: Tensor, floor: float) -> Tensor:
    if floor <= 0:
        return advantages
    big = (advantages.abs() >= floor) & (response_mask != 0).to(advantages.device)
    position = torch.arange(1, advantages.shape[1] + 1, device=advantages.device)
    last = _last_positions(big)[:, None]
    return torch.where(position[None] <= last, advantages, torch.zeros((), dtype=advantages.dtype))


def _last_positions(mask: Tensor) -> Tensor:
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    position = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return ((mask != 0) * position).amax(dim=1)

"""Monte Carlo values (VinePPO; docs/method.md, value sources).

``V(s_k)`` = the mean verified reward of ``K`` continuations sampled from the prefix ``s_k`` by
the current policy with the run's sampling settings (temperature, top-p). A continuation may use
what is left of the rollout's token budget: ``max_new_tokens - b_k`` tokens, at least 1, so a
continued trace is judged under the same truncation as a sampled one. The continuation is decoded
together with the prefix's response tokens and verified by the task like any completion.

Identical prefixes (same problem, same prompt and prefix token ids) are estimated once across the
whole batch: the ``G`` samples of one prompt share ``s_0``, and samples that agree on their first
steps share those prefixes too.

``max_boundaries`` (``credit.monte_carlo.max_boundaries``, 0 = all) caps the boundaries estimated
per trace: an evenly spaced subset ``k = floor(i * n / m)``, ``i = 0..m-1`` (``s_0`` always
included) is estimated, and every skipped boundary takes the value of the nearest estimated boundary
before it, so the segments after a skipped boundary get credit ``0`` and the one after the next
estimated boundary gets the whole change (credit moves to coarser segments; it is never created or
lost).

``V(s_n)`` is not estimated: the credit algebra sets it to the outcome ``R``.
Cost: ``K * n`` generations per trace (fewer after de-duplication), reported as
``credit/extra_generated_tokens`` (continuation tokens, EOS included) and
``credit/extra_forward_tokens`` (prefix tokens re-encoded, ``K`` times per unique prefix).

:func:`mc_values` is the reusable estimator: the credit benchmark calls it with ``K = 32`` as the
ground truth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rredcot.algebra.credit import Cost
from rredcot.config import MonteCarloConfig, SamplingConfig
from rredcot.methods.base import CreditContext, CreditMethod, CreditRows, register_credit
from rredcot.sampling.batch import RolloutBatch
from rredcot.sampling.forward import eval_mode
from rredcot.sampling.memory import ModelShape, generation_rows
from rredcot.sampling.rollout import response_mask_from_ids
from rredcot.tasks.base import checked_verify


def estimated_boundaries(n: int, max_boundaries: int = 0) -> list[int]:
    """Boundaries ``k`` in ``[0, n)`` to estimate: all of them, or ``max_boundaries`` evenly
    spaced ones starting at ``0``."""
    if max_boundaries < 0:
        raise ValueError(f"max_boundaries={max_boundaries} must be >= 0 (0: all)")
    if max_boundaries == 0 or max_boundaries >= n:
        return list(range(n))
    return sorted({i * n // max_boundaries for i in range(max_boundaries)})


def prefix_token_ids(batch: RolloutBatch, row: int, b: int) -> list[int]:
    """The tokens of ``s_k``: the non-pad prompt of ``row`` and its first ``b`` response tokens."""
    P = batch.prompt_len
    keep = batch.attention_mask[row, :P].bool()
    return batch.input_ids[row, :P][keep].tolist() + batch.response_tokens(row, b)


@torch.no_grad()
def generate_from_ids(
    policy,
    tokenizer,
    prefixes: list[list[int]],
    *,
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> list[list[int]]:
    """Sample ``num_samples`` continuations of each token-id prefix (left-padded, one batch).

    Returns ``len(prefixes) * num_samples`` token lists, grouped by prefix, each cut after its
    first EOS (EOS kept) and at ``max_new_tokens``.
    """
    if not prefixes:
        return []
    if any(len(p) == 0 for p in prefixes):
        raise ValueError("a prefix is empty; prefixes must hold at least the prompt's tokens")
    device = next(policy.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad = 0 if pad is None else pad
    width = max(len(p) for p in prefixes)
    ids = torch.full((len(prefixes), width), pad, dtype=torch.long)
    attn = torch.zeros(len(prefixes), width, dtype=torch.long)
    for i, p in enumerate(prefixes):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    ids = ids.repeat_interleave(num_samples, dim=0).to(device)
    attn = attn.repeat_interleave(num_samples, dim=0).to(device)
    out = policy.generate(
        input_ids=ids,
        attention_mask=attn,
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        top_k=0,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
    )
    new = out[:, width:].cpu()
    lengths = response_mask_from_ids(new, tokenizer.eos_token_id).sum(-1).long().tolist()
    return [new[i, : lengths[i]].tolist() for i in range(new.shape[0])]


@dataclass
class _Prefixes:
    """The unique prefixes of a batch to continue, with what verifying a continuation needs."""

    ids: list[list[int]] = field(default_factory=list)  # prompt + response[:b] ids
    heads: list[list[int]] = field(default_factory=list)  # response[:b], decoded with the rest
    problems: list = field(default_factory=list)  # the Problem of each prefix
    budgets: list[int] = field(default_factory=list)  # tokens a continuation may use
    row_estimates: list[dict[int, int]] = field(default_factory=list)  # row: k -> prefix index
    boundaries_estimated: int = 0  # (row, k) pairs, before de-duplication


def _check_mc_inputs(task, batch: RolloutBatch, k: int, max_new_tokens: int, row_boundaries):
    if task is None:
        raise ValueError("monte_carlo needs the task to verify continuations: CreditContext(task=)")
    if k < 1:
        raise ValueError(f"k={k}: Monte Carlo needs at least one continuation per prefix")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if len(batch.problems) != batch.size:
        raise ValueError("monte_carlo needs batch.problems (one Problem per row) to verify")
    if row_boundaries is not None and (
        len(row_boundaries) != batch.size or any(0 not in ks for ks in row_boundaries)
    ):
        raise ValueError("row_boundaries needs one list per row, each holding boundary 0")


def _unique_prefixes(
    batch: RolloutBatch,
    max_new_tokens: int,
    max_boundaries: int,
    row_boundaries: list[list[int]] | None,
) -> _Prefixes:
    """The prefixes ``s_k`` to estimate, each once: identical ones (same problem, same prompt
    and prefix token ids) share an index, across the whole batch."""
    index: dict[tuple, int] = {}
    found = _Prefixes()
    for row, bounds in enumerate(batch.boundaries):
        n = len(bounds) - 1
        picked: dict[int, int] = {}
        wanted = (
            estimated_boundaries(n, max_boundaries)
            if row_boundaries is None
            else sorted(k for k in row_boundaries[row] if 0 <= k < n)
        )
        for j in wanted:
            b = bounds[j]
            ids = prefix_token_ids(batch, row, b)
            problem = batch.problems[row]
            key = (problem.prompt, problem.answer, tuple(ids))
            if key not in index:
                index[key] = len(found.ids)
                found.ids.append(ids)
                found.heads.append(batch.response_tokens(row, b))
                found.problems.append(problem)
                found.budgets.append(max(1, max_new_tokens - b))
            picked[j] = index[key]
            found.boundaries_estimated += 1
        found.row_estimates.append(picked)
    return found


def _continue_and_verify(
    policy,
    tokenizer,
    task,
    prefixes: _Prefixes,
    k: int,
    *,
    temperature: float,
    top_p: float,
    batch_size: int,
    progress: Callable[[int, int], None] | None,
) -> tuple[torch.Tensor, int, int, int]:
    """``(estimates (len(prefixes.ids),), tokens generated, tokens forwarded, bad verdicts)``:
    the mean verified reward of ``k`` continuations of each prefix, generated in chunks of
    similar budget (longest first)."""
    eos = tokenizer.eos_token_id
    estimates = torch.zeros(len(prefixes.ids))
    budgets = prefixes.budgets
    order = sorted(range(len(prefixes.ids)), key=lambda i: -budgets[i])
    per_call = max(1, batch_size // k)
    generated = forwarded = bad = 0
    with eval_mode(policy):
        for start in range(0, len(order), per_call):
            chunk = order[start : start + per_call]
            conts = generate_from_ids(
                policy,
                tokenizer,
                [prefixes.ids[i] for i in chunk],
                num_samples=k,
                max_new_tokens=max(budgets[i] for i in chunk),
                temperature=temperature,
                top_p=top_p,
            )
            for c, i in enumerate(chunk):
                forwarded += k * len(prefixes.ids[i])
                total = 0.0
                for cont in conts[c * k : (c + 1) * k]:
                    cont = cont[: budgets[i]]
                    generated += len(cont)
                    content = cont[:-1] if cont and cont[-1] == eos else cont
                    text = tokenizer.decode(prefixes.heads[i] + content, skip_special_tokens=True)
                    verdict, ok = checked_verify(task, prefixes.problems[i], text)
                    bad += int(not ok)
                    total += float(verdict.reward) if ok else 0.0
                estimates[i] = total / k
            if progress is not None:
                progress(min(start + per_call, len(order)), len(order))
    return estimates, generated, forwarded, bad


def _values_from_estimates(
    batch: RolloutBatch, row_estimates: list[dict[int, int]], estimates: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values (B, S+1), value_mask (B, S+1))`` on the CPU: each row's estimated boundaries,
    a skipped one holding the last estimate before it, and ``values[b, n_b] = R_b``."""
    n = batch.num_segments
    S = int(n.max()) if len(n) else 0
    values = torch.zeros(batch.size, S + 1)
    for row, picked in enumerate(row_estimates):
        last = None
        for j in range(int(n[row])):
            if j in picked:
                last = float(estimates[picked[j]])
            values[row, j] = last
    values[torch.arange(batch.size), n] = batch.rewards.detach().float().cpu()
    mask = torch.arange(S + 1).unsqueeze(0) <= n.unsqueeze(1)
    return values, mask


@torch.no_grad()
def mc_values(
    policy,
    tokenizer,
    task,
    batch: RolloutBatch,
    k: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 64,
    max_boundaries: int = 0,
    batch_size: int = 256,
    progress: Callable[[int, int], None] | None = None,
    row_boundaries: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Monte Carlo ``V(s_k)`` from ``k`` continuations per unique boundary prefix.

    Args:
        k: continuations per prefix (``K``).
        temperature, top_p: sampling settings of the continuations (the rollout's).
        max_new_tokens: the rollout's budget; a continuation of ``s_k`` gets
            ``max(1, max_new_tokens - b_k)`` tokens.
        max_boundaries: boundaries estimated per trace (0: all); see the module docstring.
        batch_size: continuation rows per ``generate`` call.
        progress: called as ``progress(prefixes_done, prefixes_total)`` after each call.
        row_boundaries: per row, the boundaries ``k`` to estimate instead of
            ``estimated_boundaries(n, max_boundaries)`` (each list must hold ``0``; the oracle
            estimates only a trace's still-right prefixes).

    Returns ``(values (B, S+1), value_mask (B, S+1) bool, stats)``; ``values[b, n_b] = R_b``.
    """
    _check_mc_inputs(task, batch, k, max_new_tokens, row_boundaries)
    prefixes = _unique_prefixes(batch, max_new_tokens, max_boundaries, row_boundaries)
    estimates, generated, forwarded, bad = _continue_and_verify(
        policy,
        tokenizer,
        task,
        prefixes,
        k,
        temperature=temperature,
        top_p=top_p,
        batch_size=batch_size,
        progress=progress,
    )
    values, mask = _values_from_estimates(batch, prefixes.row_estimates, estimates)
    device = batch.rewards.device
    stats = {
        "credit/extra_generated_tokens": float(generated),
        "credit/extra_forward_tokens": float(forwarded),
        "credit/mc_prefixes": float(len(prefixes.ids)),
        "credit/mc_boundaries": float(prefixes.boundaries_estimated),
        "credit/mc_continuations": float(len(prefixes.ids) * k),
        "credit/mc_bad_verdicts": float(bad),
    }
    return values.to(device), mask.to(device), stats


@register_credit("monte_carlo", options=MonteCarloConfig)
class MonteCarloCredit(CreditMethod):
    """VinePPO: ``V(s_k)`` = mean reward of ``credit.monte_carlo.rollouts`` continuations from
    ``s_k``."""

    batch_size: int = 256  # continuation rows per generate call, fewer where the micro-batch says

    def __init__(self, config, context: CreditContext) -> None:
        super().__init__(config, context)
        if context.task is None:
            raise ValueError(
                "monte_carlo needs the task to verify continuations; pass CreditContext(task=...)"
            )

    def rows(self, batch: RolloutBatch) -> CreditRows:
        """The batch's rows with the Monte Carlo values of their boundaries."""
        values, mask, stats = self.rollout_values(batch)
        cost, stats = Cost.split_from(stats)
        return CreditRows.of(batch).replace(
            values=values, value_mask=mask, cost=cost, metrics=stats
        )

    def rollout_values(
        self, batch: RolloutBatch
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """``(values (B, S+1), mask (B, S+1), stats)`` of :func:`mc_values`."""
        return context_mc_values(
            self.context,
            batch,
            self.options.rollouts,
            self.batch_size,
            max_boundaries=self.options.max_boundaries,
        )


def context_mc_values(
    ctx: CreditContext, batch: RolloutBatch, rollouts: int, batch_size: int, **options
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """:func:`mc_values` with a credit method's context: its policy, tokenizer, task and sampling
    settings, and at most ``batch_size`` continuation rows per generate call, fewer where the
    micro-batch's memory says (``ctx.micro_batch_tokens``; a prefix and its continuation are at
    most prompt + ``max_new_tokens`` long). ``options``: :func:`mc_values`'s boundary choice."""
    s = ctx.sampling or SamplingConfig()
    if ctx.micro_batch_tokens:
        length = batch.prompt_len + s.max_new_tokens
        shape = ModelShape.of(ctx.policy)
        batch_size = min(batch_size, generation_rows(shape, ctx.micro_batch_tokens, length))
    return mc_values(
        ctx.policy,
        ctx.tokenizer,
        ctx.task,
        batch,
        rollouts,
        temperature=s.temperature,
        top_p=s.top_p,
        max_new_tokens=s.max_new_tokens,
        batch_size=batch_size,
        **options,
    )

"""Continuation likelihood: the policy's probability of finishing a prefix the way known-good
completions finish it (docs/method.md, value sources; the RREDCoT paper's estimator as two
secondary write-ups describe it).

For boundary ``k`` of a trace with prefix ``s_k``, the **known-good continuations** are

- the remainders ``u_j = y_j[b_k^j:]`` of the group's verified-correct completions ``y_j`` after
  *their own* boundary ``k`` (the same step index: on the arithmetic chains with ``newline``
  segments, line ``k``), and
- the reference solution's remainder after its boundary ``k`` where the task has one
  (``task.gold_completion``: GSM8K's worked solutions, the arithmetic gold chains), segmented
  with the same segmenter (with ``newline`` cuts and the same options for the entropy strategies,
  which need the policy's entropies a reference does not have).

Each continuation runs to the completion's end, its EOS included, so it carries the answer: a
continuation ``u`` of a correct completion, appended to any prefix, ends in the same answer, and
``p(u | s_k) = π(u | s_k)`` is the probability that the policy finishes ``s_k`` correctly *that
way*. ``V(s_k) = Σ_{u correct} π(u | s_k)`` sums that over every correct continuation; the
estimators see only a few:

- ``importance`` (default, the paper's form ``V ≈ (1/N) Σ p(u, y | s) ζ(y) / q(u, y)``): the ``G``
  samples of the group are ``N = G`` draws, sample ``j``'s remainder from the proposal
  ``q_j = π(· | its own prefix y_j[:b_k^j])`` (exactly how it was sampled, at temperature 1), with
  utility ``ζ_j = R_j`` (1 for a verified-correct completion, 0 else)::

      V(s_k) = π(r_k | s_k) + (1/G) Σ_{j: R_j = 1, u_j ≠ r_k} π(u_j | s_k) / π(u_j | y_j[:b_k^j])

  with ``r_k`` the reference remainder (counted exactly, not sampled; 0 without a reference).
  For each sample, ``E_{u ~ q_j}[π(u | s) ζ(u) / q_j(u)] = Σ_{u: q_j(u) > 0} π(u | s) ζ(u)``: the
  probability of the correct continuations the proposal can produce, never more than ``V(s)``.
  So the estimate is a **lower bound in expectation** (utilities are non-negative; the proposal
  never covers every correct continuation), unbiased for the part it covers; a single batch's
  estimate can exceed the truth (an importance ratio above 1), so values are clipped to 1.
- ``sum``: ``V(s_k) = Σ_{distinct u} π(u | s_k)`` over the distinct known-good continuations.
  Distinct complete continuations are disjoint events, so this is a lower bound on every batch,
  not just in expectation, but it counts a continuation once however likely the policy was to
  produce it elsewhere.
- ``per_token`` (length-normalised, in log space): ``V(s_k) = (1/C) Σ_{distinct u}
  exp(log π(u | s_k) / |u|)``, the mean over the ``C`` distinct known-good continuations of
  the policy's per-token (geometric-mean) probability of each. No probability and no bound: a
  score in [0, 1] that does not vanish with a continuation's length, as a pretrained model's
  raw probabilities of a whole remainder do (issue 60; the likelihood-reward study, arXiv
  2602.03979, reads log-probabilities for this reason). ``stop_below`` is refused with it.

A sample's own continuation (and that of every sample with the same prefix) has ratio 1 and is
not probed. Continuations per boundary are capped (``max_continuations``; the reference first,
then the group's in row order).

**Cost**: no generation. ``π(u | s_k)`` for every boundary and continuation of a trace goes into one
packed forward row (:func:`rredcot.methods.probe_logprobs.packed_probe_logprobs`: the
prompt, the response, then every continuation with a 4D attention mask that lets it see its own
prefix only); the proposals ``π(u_j | y_j[:b_k^j])`` for every ``k`` at once come from one probe
of the correct sample's whole response from its prompt. Log-probs are gathered only at the scored
positions, ``logits_mb`` MiB of logits at a time. Forward tokens per trace are about
``Σ_k Σ_u |u| ≈ (n/2) · T · C`` (``C`` distinct continuations per boundary; on arithmetic chains
correct completions of one prompt mostly coincide, so ``C`` is 1-2) against ``P + T`` for a
uniform step's forward; ``credit/extra_forward_tokens`` reports it per step.

**Cheap scoring** (:func:`cheap_values_from_scorer`; options ``reuse_reference``, ``window``,
``stop_below``, ``scope``): most of those tokens re-score what one pass already knows. A
prefix that is the reference's own, token for token (every line of a correct arithmetic trace,
a wrong trace's lines before its first error), needs no probe: ``π(r_k | s_k)`` is the
reference's own log-prob from ``b_k`` on, and one pass of prompt + reference per group gives
every ``k`` (exact). Off that path a probe can score only the continuation's next ``window``
lines and read the rest from the source's own pass (an approximation: the lines after the
window are scored as if the prefix were the source's). A prefix that has left every known-good
path only loses value, so with ``stop_below`` a trace's first boundary off the path goes first
and a value below the threshold is given to the trace's later boundaries unprobed. ``scope``
scores some groups only (``all_wrong``: where GRPO gives no credit; ``mixed``: where it does, so
the update forwards what GRPO's does; ``any_wrong``); the others get GRPO's credit.
Costs and credit quality of each: ``benchmarks/results/cheap_continuation/``.

**Several processes**: under TRL a group's samples may sit on several processes; the adapter
gives the batch its groups' other rows (``batch.peers``, :func:`rredcot.methods.processes.group_peers`),
and every process builds its rows' continuations from the whole group, in the order of the rows
of every process, as one process holding every row would (the peers' proposals are scored here,
after their prompt, which the group shares).

**Safe credit**: the guards of every frozen estimator (:mod:`rredcot.methods.value_source`): the
group-mean anchor and the hand-over from uniform by measured reliability.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rredcot.algebra.normalization import group_mean_std
from rredcot.config import CONTINUATION_SCOPES, ContinuationLikelihoodConfig
from rredcot.config.method_options import refuse_per_token_stop_below
from rredcot.methods.base import CreditContext, CreditRows, Estimate, register_credit
from rredcot.methods.probe_logprobs import (
    Probe,
    ProbeScorer,
    packing_disagrees,
    packing_supported,
)
from rredcot.methods.value_source import ValueSourceCredit
from rredcot.sampling.batch import RolloutBatch
from rredcot.sampling.forward import eval_mode
from rredcot.segment import Segmenter, segment_completion

ESTIMATORS = ("importance", "sum", "per_token")
SOURCES = ("group", "reference", "both")
REFERENCE = -1  # a continuation's source when it is the task's reference (Continuation.source)


@dataclass(frozen=True)
class Continuation:
    """One known-good continuation probed after boundary ``k`` of row ``row``.

    ``log_weight``: the log of its factor in the estimate (0 for the reference or the ``sum``
    estimator; ``log Σ_j 1 / (G q_j)`` over the samples that wrote it, for ``importance``;
    ``-log C`` over the boundary's ``C`` continuations, for ``per_token``);
    ``known_logp``: its log-probability where it needs no probe (the prefix is the source's
    own), else None.
    """

    row: int
    k: int
    ids: tuple[int, ...]
    log_weight: float
    known_logp: float | None = None
    source: int = REFERENCE  # or the key of the first correct sample that wrote it (Sample)


@dataclass(frozen=True)
class Sample:
    """A sample of a group as a continuation's source: a row of the batch (``key`` = its row)
    or a row another process holds (``key = -2 - i``: ``batch.peers`` entry ``i``)."""

    key: int
    ids: tuple[int, ...]  # response tokens, EOS included
    bounds: list[int]  # [0, b_1, ..., b_n]
    correct: bool
    prompt_row: int  # a row of the batch with the sample's prompt (its group's)

    def proposal(self) -> Probe:
        """The probe of its whole response after its prompt (the proposal's log-probs)."""
        return Probe(self.prompt_row, 0, 0, self.ids)


def group_samples(batch: RolloutBatch, responses: list[list[int]]) -> dict[int, list[Sample]]:
    """Each group's samples in the order of the rows of every process: the peers that processes
    before this one hold (``batch.peers``), the batch's own rows, then the later peers."""
    first_row: dict[int, int] = {}
    samples = []
    for row, gid in enumerate(batch.group_ids.tolist()):
        first_row.setdefault(gid, row)
        correct = float(batch.rewards[row]) >= 1.0
        samples.append(
            (gid, Sample(row, tuple(responses[row]), batch.boundaries[row], correct, row))
        )
    peers = batch.peers
    if peers is not None:
        theirs = [
            (gid, Sample(-2 - i, ids, bounds, reward >= 1.0, first_row.get(gid, -1)))
            for i, (gid, reward, ids, bounds) in enumerate(
                zip(peers.group_ids, peers.rewards, peers.responses, peers.boundaries)
            )
        ]
        samples = peers.around(samples, theirs)
    groups: dict[int, list[Sample]] = {gid: [] for gid in first_row}
    for gid, sample in samples:
        if gid in groups:  # a peer of a group this batch does not hold is no source here
            groups[gid].append(sample)
    return groups


def proposals(samples: dict[int, list[Sample]], groups=None, skip=None) -> list[Sample]:
    """The correct samples (of ``groups`` only, where given; ``skip(sample)``: leave it out)
    whose proposals the importance weights and the cheap window read."""
    return [
        s
        for gid, members in samples.items()
        if groups is None or gid in groups
        for s in members
        if s.correct and s.ids and not (skip is not None and skip(s))
    ]


def estimate_from_logprobs(
    logp: Tensor, log_weights: Tensor, slots: Tensor, num_slots: int, clip: bool = True
) -> Tensor:
    """``V[slot] = Σ_{c in slot} exp(log_weights[c] + logp[c])``, clipped to [0, 1] (``clip``;
    the clip only lowers an estimate, so the lower bound survives it, but it is biased below
    the covered mass then: ``clip=False`` gives the raw importance sum).

    In log space, so that an importance weight ``1 / q`` of a long continuation never
    overflows on its own: only the product ``p / q`` is formed.

    Args:
        logp: ``(C,)`` log π(u_c | s) of each continuation; log_weights: ``(C,)`` the log of
            its (non-negative) factor; slots: ``(C,)`` long, the (row, boundary) slot of each;
        num_slots: how many slots.

    Returns:
        ``(num_slots,)`` float values.
    """
    out = torch.zeros(num_slots, dtype=torch.float64)
    terms = log_weights.double() + logp.double()
    out = out.index_add(0, slots, (terms.clamp(max=0.0) if clip else terms).exp())
    return (out.clamp(0.0, 1.0) if clip else out).float()


def per_token(conts: list[Continuation], logp: list[float]) -> list[float]:
    """Each continuation's log-probability divided by its length (the ``per_token``
    estimator's terms)."""
    return [lp / max(len(c.ids), 1) for c, lp in zip(conts, logp)]


def _response_tokens(batch: RolloutBatch) -> list[list[int]]:
    return [batch.response_tokens(row) for row in range(batch.size)]


def reference_paths(
    batch: RolloutBatch, tokenizer, task, segmenter: Segmenter
) -> dict[int, tuple[tuple[int, ...], list[int]]]:
    """Per group, the reference completion's token ids (EOS included) and its boundaries
    ``[0, rb_1, ..., rb_n]``; groups whose task has no reference are left out."""
    if segmenter.uses_entropy:  # a reference has no entropies: its lines, with the same options
        segmenter = dataclasses.replace(segmenter, strategy="newline")
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    out: dict[int, tuple[tuple[int, ...], list[int]]] = {}
    for row, problem in enumerate(batch.problems):
        gid = int(batch.group_ids[row])
        if gid in out:
            continue
        gold = task.gold_completion(problem) if task is not None else None
        if not gold:
            continue
        ids = list(tokenizer(gold, add_special_tokens=False)["input_ids"]) + eos
        bounds, _, _ = segment_completion(segmenter, tokenizer, ids, text=gold)
        out[gid] = (tuple(ids), list(bounds))
    return out


def reference_remainders(
    batch: RolloutBatch, tokenizer, task, segmenter: Segmenter
) -> dict[int, list[tuple[int, ...]]]:
    """Per group, the reference completion's remainder after each of its boundaries
    ``[r_0, r_1, ...]`` (``r_k`` = tokens from boundary ``k`` to its end, EOS included); groups
    whose task has no reference are left out."""
    return {
        gid: [ids[b:] for b in bounds[:-1]]
        for gid, (ids, bounds) in reference_paths(batch, tokenizer, task, segmenter).items()
    }


def build_continuations(
    batch: RolloutBatch,
    samples: dict[int, list[Sample]],
    references: dict[int, list[tuple[int, ...]]],
    own_logprobs: dict[int, Tensor],
    *,
    source: str = "both",
    estimator: str = "importance",
    max_continuations: int = 4,
    rows: set[int] | None = None,
) -> list[Continuation]:
    """Every (row, boundary ``k < n``, continuation) of the batch, with its weight (of the rows
    in ``rows`` only, where given).

    ``samples``: each group's samples, its rows here and its ``batch.peers``
    (:func:`group_samples`). ``own_logprobs[key]``: ``(T_j,)`` log π of correct sample ``key``'s
    response tokens from its prompt (:class:`Sample`; the proposal's log-probs; needed for
    ``importance``).
    """
    if source not in SOURCES:
        raise ValueError(f"continuation source={source!r}: use {', '.join(SOURCES)}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"continuation estimator={estimator!r}: use {', '.join(ESTIMATORS)}")
    if max_continuations < 1:
        raise ValueError(f"max_continuations={max_continuations} must be >= 1")
    responses = _response_tokens(batch)
    out: list[Continuation] = []
    for row, bounds in enumerate(batch.boundaries):
        if rows is not None and row not in rows:
            continue
        gid = int(batch.group_ids[row])
        members = samples[gid]
        G = len(members)  # every process's samples of the group
        refs = references.get(gid, []) if source in ("reference", "both") else []
        for k in range(len(bounds) - 1):
            prefix = tuple(responses[row][: bounds[k]])
            found: dict[tuple[int, ...], list] = {}  # ids -> [log-weights, known logp or nan]
            order: list[tuple[int, ...]] = []
            ref = refs[k] if k < len(refs) else None
            if ref is not None:
                found[ref] = [[0.0], float("nan"), REFERENCE]
                order.append(ref)
            if source in ("group", "both"):
                for s in members:
                    bj = s.bounds
                    if not s.correct or k >= len(bj) - 1:
                        continue
                    u = s.ids[bj[k] :]
                    if u == ref:
                        continue  # counted exactly as the reference
                    if u not in found:
                        if len(order) >= max_continuations:
                            continue
                        found[u] = [[], float("nan"), s.key]
                        order.append(u)
                    own = s.ids[: bj[k]] == prefix  # the prefix is the source's own: p = q
                    if estimator in ("sum", "per_token"):
                        found[u][0] = [0.0]
                        if own and s.key in own_logprobs:
                            found[u][1] = float(own_logprobs[s.key][bj[k] :].sum())
                        continue
                    log_q = float(own_logprobs[s.key][bj[k] :].sum())
                    found[u][0].append(-log_q - math.log(G))
                    if own:
                        found[u][1] = log_q
            for u in order:
                log_weights, known, origin = found[u]
                if log_weights:
                    log_weight = float(torch.tensor(log_weights, dtype=torch.float64).logsumexp(0))
                    if estimator == "per_token":  # the mean over the boundary's continuations
                        log_weight = -math.log(len(order))
                    known_logp = None if known != known else known  # nan -> probe it
                    out.append(Continuation(row, k, u, log_weight, known_logp, origin))
    return out


@torch.no_grad()
def continuation_values(
    policy,
    tokenizer,
    task,
    batch: RolloutBatch,
    segmenter: Segmenter,
    *,
    source: str = "both",
    estimator: str = "importance",
    max_continuations: int = 4,
    packing: str = "auto",
    max_batch_tokens: int = 16384,
    logits_mb: int = 256,
    reuse_reference: bool = False,
    window: int = 0,
    stop_below: float = 0.0,
    scope: str = "all",
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """``V(s_k)`` for every boundary ``k < n`` (module docstring); ``values[b, n_b] = R_b``.

    Returns ``(values (B, S+1), value_mask (B, S+1) bool, stats)``; ``packing`` as
    :func:`rredcot.methods.answer_likelihood.answer_values`. ``reuse_reference``, ``window``,
    ``stop_below``, ``scope``: :func:`cheap_values_from_scorer` (any of them set runs it).
    """
    cheap = reuse_reference or window > 0 or stop_below > 0.0 or scope != "all"
    scorer = ProbeScorer(
        policy,
        batch,
        packing,
        name="continuation_likelihood",
        max_batch_tokens=max_batch_tokens,
        logits_mb=logits_mb,
    )
    with eval_mode(policy):
        paths = (
            reference_paths(batch, tokenizer, task, segmenter)
            if source in ("reference", "both")
            else {}
        )
        references = {g: [ids[b:] for b in bounds[:-1]] for g, (ids, bounds) in paths.items()}
        options = {"source": source, "estimator": estimator, "max_continuations": max_continuations}
        if cheap:
            values, mask, stats = cheap_values_from_scorer(
                batch, paths, scorer, window=window, stop_below=stop_below, scope=scope, **options
            )
        else:
            values, mask, stats = values_from_scorer(batch, references, scorer, **options)
    stats.update(
        {
            "credit/extra_forward_tokens": float(scorer.forwarded),
            "credit/extra_generated_tokens": 0.0,
            "credit/probe_packed": float(scorer.packed),
            "credit/probe_from_cache": scorer.from_cache / max(scorer.probes, 1),
            "credit/reference_groups": float(len(references)),
        }
    )
    device = batch.rewards.device
    return values.to(device), mask.to(device), stats


def values_from_scorer(
    batch: RolloutBatch,
    references: dict[int, list[tuple[int, ...]]],
    score: Callable[[list[Probe]], list[Tensor]],
    *,
    source: str = "both",
    estimator: str = "importance",
    max_continuations: int = 4,
    clip: bool = True,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """The estimate with log-probs from ``score`` (probes -> per-token log-prob tensors): the
    proposals (each correct sample's response from its prompt), then every continuation that
    needs a probe. :func:`continuation_values` scores with the policy's packed forward; a test
    can score with a distribution it knows exactly.

    Returns ``(values (B, S+1) on the CPU, value_mask (B, S+1) bool, stats)``.
    """
    samples = group_samples(batch, _response_tokens(batch))
    sources = proposals(samples) if source in ("group", "both") else []
    probes = [s.proposal() for s in sources]
    own_logprobs = {s.key: lp for s, lp in zip(sources, score(probes) if probes else [])}
    conts = build_continuations(
        batch,
        samples,
        references,
        own_logprobs,
        source=source,
        estimator=estimator,
        max_continuations=max_continuations,
    )
    probes = [
        Probe(c.row, c.k, batch.boundaries[c.row][c.k], c.ids)
        for c in conts
        if c.known_logp is None
    ]
    probed = iter(score(probes) if probes else [])
    logp = torch.tensor(
        [c.known_logp if c.known_logp is not None else float(next(probed).sum()) for c in conts],
        dtype=torch.float64,
    )
    if estimator == "per_token":
        logp = torch.tensor(per_token(conts, logp.tolist()), dtype=torch.float64)
    n = batch.num_segments.cpu()
    S = int(n.max()) if len(n) else 0
    slots = torch.tensor([c.row * (S + 1) + c.k for c in conts], dtype=torch.long)
    log_weights = torch.tensor([c.log_weight for c in conts], dtype=torch.float64)
    flat = estimate_from_logprobs(logp, log_weights, slots, batch.size * (S + 1), clip)
    values = flat.view(batch.size, S + 1).clone()
    values[torch.arange(batch.size), n] = batch.rewards.detach().float().cpu()
    mask = torch.arange(S + 1).unsqueeze(0) <= n.unsqueeze(1)
    stats = {
        "credit/continuations": float(len(conts)),
        "credit/continuations_probed": float(len(probes)),
        "credit/continuations_per_boundary": len(conts) / max(int(n.sum()), 1),
        "credit/continuation_tokens": float(sum(len(p.ids) for p in probes)),
    }
    return values, mask, stats


def _reference_followed(sample: Sample, path: tuple[tuple[int, ...], list[int]] | None) -> bool:
    """Whether ``sample`` is its group's reference ``path`` token for token, cut at the same
    boundaries (then every remainder of it is the reference's)."""
    return path is not None and (sample.ids, sample.bounds) == path


@dataclass
class _SourcePasses:
    """Cheap scoring's first pass: each group's reference ``paths`` (ids, boundaries), with its
    per-token log-probs from the prompt (``reference``, by group), and the proposals of the
    correct samples off the reference (``own``, by :class:`Sample` key; ``bounds``: their
    boundaries)."""

    paths: dict[int, tuple[tuple[int, ...], list[int]]]
    reference: dict[int, Tensor]
    own: dict[int, Tensor]
    bounds: dict[int, list[int]]

    def remainders(self) -> dict[int, list[tuple[int, ...]]]:
        """Per group, the reference's remainder after each of its boundaries."""
        return {g: [ids[b:] for b in bounds[:-1]] for g, (ids, bounds) in self.paths.items()}

    def of(self, c: Continuation, batch: RolloutBatch) -> tuple[Tensor, list[int]]:
        """The per-token log-probs of ``c``'s source from its own prefix, and its boundaries."""
        if c.source == REFERENCE:
            g = int(batch.group_ids[c.row])
            return self.reference[g], self.paths[g][1]
        return self.own[c.source], self.bounds[c.source]


def _rows_in_scope(batch: RolloutBatch, scope: str) -> set[int]:
    """The rows scored: those of :func:`groups_in_scope`, read over each group's samples on
    every process (its ``batch.peers`` included)."""
    rewards, group_ids = batch.rewards.detach().float().cpu(), batch.group_ids.cpu()
    if batch.peers is not None and len(batch.peers):
        rewards = torch.cat([rewards, torch.tensor(batch.peers.rewards, dtype=torch.float32)])
        group_ids = torch.cat([group_ids, torch.tensor(batch.peers.group_ids, dtype=torch.long)])
    scored = groups_in_scope(rewards, group_ids, scope)
    return {r for r, g in enumerate(batch.group_ids.tolist()) if g in scored}


def _source_passes(
    batch: RolloutBatch,
    samples: dict[int, list[Sample]],
    paths: dict[int, tuple[tuple[int, ...], list[int]]],
    score: Callable[[list[Probe]], list[Tensor]],
    in_scope: set[int],
    source: str,
) -> _SourcePasses:
    """Step 1 of cheap scoring: one pass scores each in-scope group's reference from its
    prompt, and the proposals of the correct samples that are not the reference."""
    gids = batch.group_ids.tolist()
    first_row: dict[int, int] = {}
    for r in sorted(in_scope):
        first_row.setdefault(gids[r], r)
    ref_groups = [g for g in first_row if g in paths]
    ref_probes = [Probe(first_row[g], 0, 0, paths[g][0]) for g in ref_groups]
    sources = []
    if source in ("group", "both"):
        sources = proposals(
            samples,
            set(first_row),
            skip=lambda s: _reference_followed(s, paths.get(gids[s.prompt_row])),
        )
    probes = ref_probes + [s.proposal() for s in sources]
    first = score(probes) if probes else []
    return _SourcePasses(
        paths=paths,
        reference=dict(zip(ref_groups, first[: len(ref_probes)])),
        own={s.key: lp for s, lp in zip(sources, first[len(ref_probes) :])},
        bounds={s.key: s.bounds for s in sources},
    )


def _read_from_reference(
    batch: RolloutBatch,
    responses: list[list[int]],
    conts: list[Continuation],
    passes: _SourcePasses,
) -> tuple[list[float | None], int]:
    """Each continuation's log-prob where it needs no probe: known already, or a reference
    remainder after a prefix that is the reference's own (read from its pass: exact). Returns
    the log-probs (None: to probe) and how many were read from the reference."""
    logp: list[float | None] = [c.known_logp for c in conts]
    from_reference = 0
    for i, c in enumerate(conts):
        if logp[i] is None and c.source == REFERENCE:
            g = int(batch.group_ids[c.row])
            ids, bounds = passes.paths[g]
            if tuple(responses[c.row][: batch.boundaries[c.row][c.k]]) == ids[: bounds[c.k]]:
                logp[i] = float(passes.reference[g][bounds[c.k] :].sum())
                from_reference += 1
    return logp, from_reference


def _probe_heads(
    batch: RolloutBatch,
    conts: list[Continuation],
    logp: list[float | None],
    passes: _SourcePasses,
    window: int,
) -> dict[int, tuple[int, float]]:
    """Step 2 of cheap scoring, for each continuation still to probe: ``(tokens probed,
    log-prob of the rest)``. With ``window > 0`` the probe covers the first ``window``
    segments and the rest is read from the source's own pass; else the whole continuation."""
    heads: dict[int, tuple[int, float]] = {}
    for i, c in enumerate(conts):
        if logp[i] is not None:
            continue
        head, tail = len(c.ids), 0.0
        if window:
            lps, bounds = passes.of(c, batch)
            if c.k + window < len(bounds) - 1:
                head = bounds[c.k + window] - bounds[c.k]
                tail = float(lps[bounds[c.k] + head :].sum())
        heads[i] = (head, tail)
    return heads


def _probe_continuations(
    batch: RolloutBatch,
    conts: list[Continuation],
    heads: dict[int, tuple[int, float]],
    logp: list[float | None],
    score: Callable[[list[Probe]], list[Tensor]],
    stop_below: float,
) -> tuple[list[Probe], dict[int, tuple[int, float]]]:
    """Step 3 of cheap scoring: probe the ``heads`` and fill ``logp`` in place. With
    ``stop_below > 0`` each trace's first probed boundary goes first, and a trace whose value
    there is below ``stop_below`` is not probed further. Returns the probes run and the stopped
    traces, ``{row: (boundary, its value)}``."""
    probes_run: list[Probe] = []

    def probe(indices: list[int]) -> None:
        probes = [
            Probe(
                conts[i].row,
                conts[i].k,
                batch.boundaries[conts[i].row][conts[i].k],
                conts[i].ids[: heads[i][0]],
            )
            for i in indices
        ]
        for i, lp in zip(indices, score(probes) if probes else []):
            logp[i] = float(lp.sum()) + heads[i][1]
        probes_run.extend(probes)

    stopped: dict[int, tuple[int, float]] = {}
    if stop_below > 0.0:
        by_row: dict[int, list[int]] = {}
        for i in heads:
            by_row.setdefault(conts[i].row, []).append(i)
        firsts = {row: min(conts[i].k for i in idx) for row, idx in by_row.items()}
        probe([i for row, idx in by_row.items() for i in idx if conts[i].k == firsts[row]])
        for row, k in firsts.items():
            at = [i for i, c in enumerate(conts) if c.row == row and c.k == k]
            v = sum(math.exp(min(0.0, conts[i].log_weight + logp[i])) for i in at)
            if v < stop_below:
                stopped[row] = (k, min(v, 1.0))
    probe([i for i in heads if logp[i] is None and conts[i].row not in stopped])
    return probes_run, stopped


def _cheap_values(
    batch: RolloutBatch,
    conts: list[Continuation],
    logp: list[float],
    stopped: dict[int, tuple[int, float]],
    in_scope: set[int],
    clip: bool,
) -> tuple[Tensor, Tensor]:
    """The estimate from the continuations' log-probs: a stopped trace's later boundaries take
    its stop value, rows out of scope their group's mean reward, and ``values[b, n_b] = R_b``.
    Returns ``(values (B, S+1) on the CPU, value_mask (B, S+1) bool)``."""
    n = batch.num_segments.cpu()
    S = int(n.max()) if len(n) else 0
    extra = [(row, k2) for row, (k, _) in stopped.items() for k2 in range(k + 1, int(n[row]))]
    slots = torch.tensor(
        [c.row * (S + 1) + c.k for c in conts] + [row * (S + 1) + k2 for row, k2 in extra],
        dtype=torch.long,
    )
    log_terms = torch.tensor(
        logp + [math.log(max(stopped[row][1], 1e-300)) for row, _ in extra], dtype=torch.float64
    )
    log_weights = torch.tensor(
        [c.log_weight for c in conts] + [0.0] * len(extra), dtype=torch.float64
    )
    flat = estimate_from_logprobs(log_terms, log_weights, slots, batch.size * (S + 1), clip)
    values = flat.view(batch.size, S + 1).clone()
    outside = [r for r in range(batch.size) if r not in in_scope]
    if outside:
        mean, _ = group_mean_std(batch.rewards.detach().float().cpu(), batch.group_ids.cpu())
        values[outside] = mean[outside].unsqueeze(1).expand(-1, S + 1)
    values[torch.arange(batch.size), n] = batch.rewards.detach().float().cpu()
    mask = torch.arange(S + 1).unsqueeze(0) <= n.unsqueeze(1)
    return values, mask


def cheap_values_from_scorer(
    batch: RolloutBatch,
    paths: dict[int, tuple[tuple[int, ...], list[int]]],
    score: Callable[[list[Probe]], list[Tensor]],
    *,
    source: str = "both",
    estimator: str = "importance",
    max_continuations: int = 4,
    window: int = 0,
    stop_below: float = 0.0,
    scope: str = "all",
    clip: bool = True,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """:func:`values_from_scorer`'s estimate with fewer forward tokens (module docstring, cheap
    scoring); ``paths``: :func:`reference_paths`.

    1. One pass scores each group's reference from its prompt, and the proposals of the correct
       samples that are not the reference. ``π(r_k | s_k)`` of a prefix that is the reference's
       own (token for token) is read from it: exact, no probe.
    2. ``window > 0``: a probe scores the first ``window`` segments of its continuation only;
       the rest is read from its source's own pass (the reference's, or the sample's proposal).
    3. ``stop_below > 0``: each trace's first probed boundary goes first; a trace whose value
       there is below ``stop_below`` gives that value to its later boundaries unprobed.
    4. ``scope`` other than ``all``: only the groups of :func:`groups_in_scope` are scored; the
       others get the group's mean reward at every boundary (GRPO's values; the method gives
       them lambda 1).

    Returns ``(values (B, S+1) on the CPU, value_mask (B, S+1) bool, stats)``.
    """
    if window < 0 or not 0.0 <= stop_below < 1.0:
        raise ValueError(f"window={window} must be >= 0 and stop_below={stop_below} in [0, 1)")
    refuse_per_token_stop_below(estimator, stop_below)
    responses = _response_tokens(batch)
    in_scope = _rows_in_scope(batch, scope)
    paths = dict(paths) if source in ("reference", "both") else {}
    samples = group_samples(batch, responses)
    passes = _source_passes(batch, samples, paths, score, in_scope, source)
    conts = build_continuations(
        batch,
        samples,
        passes.remainders(),
        passes.own,
        source=source,
        estimator=estimator,
        max_continuations=max_continuations,
        rows=in_scope,
    )
    logp, from_reference = _read_from_reference(batch, responses, conts, passes)
    heads = _probe_heads(batch, conts, logp, passes, window)
    probes_run, stopped = _probe_continuations(batch, conts, heads, logp, score, stop_below)
    skipped = [i for i in heads if logp[i] is None]
    for i in skipped:
        logp[i] = -math.inf  # a stopped trace's later continuations: its stop value instead
    if estimator == "per_token":
        logp = per_token(conts, logp)
    values, mask = _cheap_values(batch, conts, logp, stopped, in_scope, clip)
    n = batch.num_segments
    stats = {
        "credit/continuations": float(len(conts)),
        "credit/continuations_probed": float(len(probes_run)),
        "credit/continuations_per_boundary": len(conts) / max(int(n.sum()), 1),
        "credit/continuation_tokens": float(sum(len(p.ids) for p in probes_run)),
        "credit/continuations_from_reference": float(from_reference),
        "credit/continuations_stopped": float(len(skipped)),
        "credit/continuation_rows": float(len(in_scope)),
    }
    return values, mask, stats


def groups_in_scope(rewards: Tensor, group_ids: Tensor, scope: str) -> set[int]:
    """The ids of the groups ``scope`` scores (a sample is correct when ``R >= 1``): every
    group (``all``), those with no correct sample (``all_wrong``), with a correct and a wrong
    one (``mixed``), with a wrong one (``any_wrong``).

    Args:
        rewards: ``(B,)``; group_ids: ``(B,)`` long.
    """
    right = (rewards.detach().cpu() >= 1.0).tolist()
    gids = group_ids.cpu().tolist()
    with_right = {g for g, r in zip(gids, right) if r}
    with_wrong = {g for g, r in zip(gids, right) if not r}
    chosen = {
        "all": set(gids),
        "all_wrong": set(gids) - with_right,
        "mixed": with_right & with_wrong,
        "any_wrong": with_wrong,
    }
    if scope not in chosen:
        raise ValueError(f"continuation scope={scope!r}: use {', '.join(CONTINUATION_SCOPES)}")
    return chosen[scope]


@register_credit("continuation_likelihood", options=ContinuationLikelihoodConfig)
class ContinuationLikelihoodCredit(ValueSourceCredit):
    """Values from the policy's likelihood of known-good continuations after each prefix, with
    the guards of every frozen estimator (anchor, hand-over, safe normalisation; module
    docstring). The first batch in ``auto`` packing is also scored unpacked once; a mismatch (a
    model that ignores the custom 4D mask) switches to unpacked scoring with a warning."""

    probes_prefixes = True
    reads_group_samples = True  # its continuations are the group's correct samples

    def __init__(self, config, context: CreditContext) -> None:
        super().__init__(config, context)
        if context.segmenter is None:
            raise ValueError(
                "continuation_likelihood needs the segmenter (it aligns continuations at the "
                "same boundary index); pass CreditContext(segmenter=...)"
            )
        self._packing = "auto"
        self._checked = False

    def _options(self) -> dict:
        o = self.options
        return {
            "source": o.source,
            "estimator": o.estimator,
            "max_continuations": o.max_continuations,
            "max_batch_tokens": o.chunk_tokens,
            "logits_mb": o.logits_mb,
            "reuse_reference": o.reuse_reference,
            "window": o.window,
            "stop_below": o.stop_below,
            "scope": o.scope,
        }

    def _check_packing(self, batch: RolloutBatch) -> None:
        """Compare packed and unpacked log-probs on the first correct row's own response."""
        ctx = self.context
        correct = [r for r in range(batch.size) if float(batch.rewards[r]) >= 1.0]
        if not packing_supported(ctx.policy) or not correct:
            return
        self._checked = True
        row = correct[0]
        tokens = _response_tokens(batch)[row]
        bounds = batch.boundaries[row]
        probes = [Probe(row, 0, 0, tuple(tokens))]
        if len(bounds) > 2:
            probes.append(Probe(row, 1, bounds[1], tuple(tokens[bounds[1] :])))
        if packing_disagrees(ctx.policy, batch, probes, name="continuation_likelihood"):
            self._packing = "unpacked"

    def estimate(self, rows: CreditRows) -> Estimate:
        """The guarded estimate; with a ``scope`` other than ``all`` the rows of the groups not
        scored (valued at their group's mean reward) get lambda 1: GRPO's credit."""
        est = super().estimate(rows)
        if self.options.scope == "all":
            return est
        scored = groups_in_scope(rows.rewards, rows.group_ids, self.options.scope)
        grpo_rows = torch.tensor([int(g) not in scored for g in rows.group_ids.tolist()])
        mask = est.credit.mask
        lam = torch.full(mask[:, 1:].shape, float(est.credit.lam), device=mask.device)
        lam[grpo_rows.to(mask.device)] = 1.0
        return dataclasses.replace(est, credit=dataclasses.replace(est.credit, lam=lam))

    def boundary_values(self, batch: RolloutBatch) -> tuple[Tensor, Tensor, dict[str, float]]:
        """``(values, mask, stats)`` of :func:`continuation_values`, not anchored."""
        # packing is checked on the first batch that re-forwards its probes (one that carries
        # the sampling's cache reads them from it)
        if not self._checked and batch.probe_cache is None:
            self._check_packing(batch)
        ctx = self.context
        return continuation_values(
            ctx.policy,
            ctx.tokenizer,
            ctx.task,
            batch,
            ctx.segmenter,
            packing=self._packing,
            **self._options(),
        )

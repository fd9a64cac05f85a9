"""Answer likelihood: the policy as its own judge (DESIGN.md section 3).

``V(s_k) = sum_{a in A+} pi(probe(a) | s_k)``: the probability that the policy, made to answer
right after the prefix ``s_k``, states a correct answer. ``probe(a)`` is the text
``task.render_answer(a)`` followed by EOS, preceded by a newline when the prefix does not already
end with one (gold traces put the answer line on a line of its own: ``...20-5=15\\nA:15``; the
newline segmenter's segments and the arithmetic prompt end with ``\\n``, so there the probe is
just ``A:15<eos>``). The probe is tokenised on its own, not jointly with the prefix.

``A+`` (``credit.answer_source``): ``reference`` the problem's reference answer, ``group`` the
distinct parsed answers of the group's verified-correct completions, ``both`` their union
(deduplicated by rendered text). The estimate can only **under**-estimate the true probability of
answering correctly: a correct answer written some other way (``15.0``, ``fifteen``, another
line format) is not probed. A group with an empty ``A+`` (``group`` source, no correct sample)
gets ``V = 0`` at every boundary.

Where it works: a model that has learned to answer from a partial chain (warm-start with
``early_answer_prob > 0``). A model that only ever copies its final running result into the
answer line gives every intermediate probe a probability near zero, and the estimator then
cannot tell good steps from bad ones (DESIGN.md section 7).

Cost: no generation. All probes of a trace (``n`` boundaries x ``|A+|`` answers) go into **one**
packed forward pass: ``[prompt | response up to b_{n-1} | probe_0 | probe_1 | ...]`` with a 4D
float attention mask (0 allowed, dtype-min elsewhere) under which each probe sees the prompt, the
response up to its boundary and its own earlier tokens, and position ids that continue from its
prefix. Models whose attention does not take a custom 4D mask (or whose packed log-probs do not
match the unpacked ones on a first check) fall back to one row per probe with a warning.
``V(s_n)`` is not probed: the credit algebra sets it to the outcome ``R``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rredcot.methods.base import (
    CreditContext,
    CreditMethod,
    CreditOutput,
    RolloutBatch,
    register_credit,
)
from rredcot.rollout import eval_mode, position_ids_from_mask

PACKING_MODES = ("auto", "packed", "unpacked")
_PACKED_ATTENTION = ("eager", "sdpa")  # attention implementations that add a custom 4D mask


@dataclass(frozen=True)
class Probe:
    """One answer probe: answer token ids ``ids`` right after boundary ``b`` of row ``row``."""

    row: int
    k: int  # boundary index: the prefix is s_k
    b: int  # response tokens in the prefix (b_k)
    ids: tuple[int, ...]


# ---------------------------------------------------------------------------------------------
# What to probe


def correct_answers(batch: RolloutBatch, source: str = "reference") -> list[list[str]]:
    """Per row, the answers counted as correct (``A+``), in a stable order.

    ``reference``: ``problem.answer``; ``group``: distinct ``verdict.answer`` of the rows of the
    same group with reward 1; ``both``: the union.
    """
    if source not in ("reference", "group", "both"):
        raise ValueError(f"answer_source={source!r}: use reference, group or both")
    if source in ("reference", "both") and len(batch.problems) != batch.size:
        raise ValueError("answer_source needs batch.problems (one Problem per row)")
    if source in ("group", "both") and len(batch.verdicts) != batch.size:
        raise ValueError("answer_source 'group' needs batch.verdicts (one Verdict per row)")
    group_answers: dict[int, list[str]] = {}
    if source in ("group", "both"):
        for row, verdict in enumerate(batch.verdicts):
            gid = int(batch.group_ids[row])
            found = group_answers.setdefault(gid, [])
            correct = float(batch.rewards[row]) >= 1.0 and verdict.answer is not None
            if correct and str(verdict.answer) not in found:
                found.append(str(verdict.answer))
    out = []
    for row in range(batch.size):
        answers: list[str] = []
        if source in ("reference", "both"):
            ref = batch.problems[row].answer
            if ref is not None and str(ref) != "":
                answers.append(str(ref))
        for a in group_answers.get(int(batch.group_ids[row]), []):
            if a not in answers:
                answers.append(a)
        out.append(answers)
    return out


def probe_token_ids(tokenizer, text: str) -> tuple[int, ...]:
    """``text`` tokenised without special tokens, followed by EOS (when the tokenizer has one)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError(f"probe text {text!r} encodes to no tokens and the tokenizer has no EOS")
    return tuple(ids)


def prompt_token_ids(batch: RolloutBatch, row: int) -> list[int]:
    """The non-pad prompt tokens of ``row``."""
    P = batch.prompt_len
    keep = batch.attention_mask[row, :P].bool()
    return batch.input_ids[row, :P][keep].tolist()


def build_probes(
    batch: RolloutBatch, tokenizer, task, answers: list[list[str]]
) -> tuple[list[Probe], list[list[int]]]:
    """Every probe of the batch: for each row, each boundary ``k < n`` and each answer.

    Returns the probes and, per row, the boundaries probed. The probe text is
    ``render_answer(a)`` if the prefix ends with a newline, else ``"\\n" + render_answer(a)``.
    """
    P = batch.prompt_len
    cache: dict[tuple[str, bool], tuple[int, ...]] = {}
    newline_cache: dict[int, bool] = {}
    probes: list[Probe] = []
    probed: list[list[int]] = []
    for row, bounds in enumerate(batch.boundaries):
        n = len(bounds) - 1
        ks = list(range(n)) if answers[row] else []
        probed.append(ks)
        for k in ks:
            b = bounds[k]
            last_id = int(batch.input_ids[row, P + b - 1])  # b = 0: the last prompt token
            if last_id not in newline_cache:
                newline_cache[last_id] = tokenizer.decode([last_id]).endswith("\n")
            ends_nl = newline_cache[last_id]
            for a in answers[row]:
                key = (a, ends_nl)
                if key not in cache:
                    text = task.render_answer(a)
                    cache[key] = probe_token_ids(tokenizer, text if ends_nl else "\n" + text)
                probes.append(Probe(row, k, b, cache[key]))
    # Two answers that render the same are one answer: drop repeated (row, k, ids).
    unique = list(dict.fromkeys(probes))
    return unique, probed


# ---------------------------------------------------------------------------------------------
# Log-probabilities of the probes


def _chunks(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Group item indices so that ``rows * longest`` stays under ``max_batch_tokens``."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, length in enumerate(lengths):
        new_longest = max(longest, length)
        if current and (len(current) + 1) * new_longest > max_batch_tokens:
            groups.append(current)
            current, new_longest = [], length
        current.append(i)
        longest = new_longest
    if current:
        groups.append(current)
    return groups


def _model_device_dtype(policy) -> tuple[torch.device, torch.dtype]:
    param = next(policy.parameters())
    dtype = param.dtype if param.dtype.is_floating_point else torch.float32
    return param.device, dtype


@torch.no_grad()
def packed_probe_logprobs(
    policy, batch: RolloutBatch, probes: list[Probe], max_batch_tokens: int = 65536
) -> tuple[list[torch.Tensor], int]:
    """Per-token log-probs of every probe, all probes of a trace in one packed row.

    Row layout ``[prompt (P columns, left-padded) | response[:c] | probe_0 | probe_1 | ...]``
    (``c`` the largest boundary probed in that row), right-padded to the chunk's longest row.
    Mask ``(R, 1, L, L)``: context tokens are causal over the non-pad context; a probe at
    boundary ``b`` sees the prompt, ``response[:b]`` and its own earlier tokens. Positions of a
    probe continue from its prefix (``prompt tokens + b``).

    Returns (one ``(len(probe.ids),)`` float tensor per probe, in order; tokens forwarded).
    """
    device, dtype = _model_device_dtype(policy)
    P = batch.prompt_len
    by_row: dict[int, list[int]] = {}
    for i, p in enumerate(probes):
        by_row.setdefault(p.row, []).append(i)
    rows = list(by_row)
    ctx = {r: max(probes[i].b for i in by_row[r]) for r in rows}
    lengths = [P + ctx[r] + sum(len(probes[i].ids) for i in by_row[r]) for r in rows]
    pad = _pad_id(policy)
    out: list[torch.Tensor | None] = [None] * len(probes)
    forwarded = 0
    for group in _chunks(lengths, max_batch_tokens):
        L = max(lengths[g] for g in group)
        R = len(group)
        ids = torch.full((R, L), pad, dtype=torch.long)
        pos = torch.zeros(R, L, dtype=torch.long)
        allowed = torch.zeros(R, L, L, dtype=torch.bool)
        allowed[:, torch.arange(L), torch.arange(L)] = True  # pad queries see themselves only
        predictors: list[tuple[int, torch.Tensor, torch.Tensor, int]] = []  # (r, cols, targets, i)
        for r, g in enumerate(group):
            row = rows[g]
            C = P + ctx[row]
            ids[r, :C] = batch.input_ids[row, :C].cpu()
            key = torch.ones(C, dtype=torch.bool)
            key[:P] = batch.attention_mask[row, :P].bool().cpu()
            allowed[r, :C, :C] = torch.tril(torch.ones(C, C, dtype=torch.bool)) & key
            allowed[r, torch.arange(C), torch.arange(C)] = True
            pos[r, :C] = position_ids_from_mask(key.long())
            n_prompt = int(key[:P].sum())
            forwarded += n_prompt + ctx[row]
            start = C
            for i in by_row[row]:
                p = probes[i]
                m = len(p.ids)
                sl = slice(start, start + m)
                ids[r, sl] = torch.tensor(p.ids)
                allowed[r, sl, :P] = key[:P]
                allowed[r, sl, P : P + p.b] = True
                allowed[r, sl, sl] = torch.tril(torch.ones(m, m, dtype=torch.bool))
                pos[r, sl] = n_prompt + p.b + torch.arange(m)
                cols = torch.cat([torch.tensor([P + p.b - 1]), torch.arange(start, start + m - 1)])
                predictors.append((r, cols, torch.tensor(p.ids), i))
                forwarded += m
                start += m
        mask = torch.zeros(R, 1, L, L, dtype=dtype)
        mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)
        logits = policy(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=pos.to(device),
            use_cache=False,
        ).logits
        _gather(logits, predictors, out)
    return out, forwarded  # type: ignore[return-value]


@torch.no_grad()
def unpacked_probe_logprobs(
    policy, batch: RolloutBatch, probes: list[Probe], max_batch_tokens: int = 65536
) -> tuple[list[torch.Tensor], int]:
    """The same log-probs as :func:`packed_probe_logprobs`, one left-padded row per probe
    (``prompt + response[:b] + probe``): the reference, and the fallback for models that do not
    take a custom 4D attention mask."""
    device, _ = _model_device_dtype(policy)
    P = batch.prompt_len
    seqs = []
    for p in probes:
        prefix = prompt_token_ids(batch, p.row) + batch.input_ids[p.row, P : P + p.b].tolist()
        seqs.append(prefix + list(p.ids))
    pad = _pad_id(policy)
    out: list[torch.Tensor | None] = [None] * len(probes)
    forwarded = sum(len(s) for s in seqs)
    for group in _chunks([len(s) for s in seqs], max_batch_tokens):
        L = max(len(seqs[i]) for i in group)
        ids = torch.full((len(group), L), pad, dtype=torch.long)
        attn = torch.zeros(len(group), L, dtype=torch.long)
        predictors = []
        for r, i in enumerate(group):
            s = seqs[i]
            ids[r, L - len(s) :] = torch.tensor(s)
            attn[r, L - len(s) :] = 1
            m = len(probes[i].ids)
            predictors.append((r, torch.arange(L - m - 1, L - 1), torch.tensor(probes[i].ids), i))
        logits = policy(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            position_ids=position_ids_from_mask(attn).to(device),
            use_cache=False,
        ).logits
        _gather(logits, predictors, out)
    return out, forwarded  # type: ignore[return-value]


def _gather(logits: torch.Tensor, predictors: list, out: list) -> None:
    """Log-probs of each probe's targets from the logits at its predictor columns."""
    if not predictors:
        return
    rows = torch.cat([torch.full_like(cols, r) for r, cols, _, _ in predictors]).to(logits.device)
    cols = torch.cat([c for _, c, _, _ in predictors]).to(logits.device)
    targets = torch.cat([t for _, _, t, _ in predictors]).to(logits.device)
    logp = F.log_softmax(logits[rows, cols].float(), dim=-1)
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).cpu()
    start = 0
    for _, c, _, i in predictors:
        out[i] = token_logp[start : start + len(c)]
        start += len(c)


def _pad_id(policy) -> int:
    pad = getattr(getattr(policy, "config", None), "pad_token_id", None)
    return int(pad) if pad is not None else 0


def packing_supported(policy) -> bool:
    """Whether the policy's attention implementation adds a custom 4D float mask as given."""
    impl = getattr(getattr(policy, "config", None), "_attn_implementation", None)
    return impl in _PACKED_ATTENTION


# ---------------------------------------------------------------------------------------------
# Values


@torch.no_grad()
def answer_values(
    policy,
    tokenizer,
    task,
    batch: RolloutBatch,
    *,
    answer_source: str = "reference",
    packing: str = "auto",
    max_batch_tokens: int = 65536,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``V(s_k) = sum_{a in A+} exp(sum log pi(probe(a) | s_k))`` for every boundary ``k < n``.

    Returns ``(values (B, S+1), value_mask (B, S+1) bool, stats)``; ``values[b, n_b] = R_b``
    (the algebra sets ``V(s_n) := R`` anyway). ``packing``: ``packed`` (one forward row per
    trace), ``unpacked`` (one row per probe) or ``auto`` (packed when the attention
    implementation takes a custom 4D mask, else unpacked with a warning; a packed pass that
    raises also falls back with a warning).
    """
    if packing not in PACKING_MODES:
        raise ValueError(f"packing={packing!r}: use {', '.join(PACKING_MODES)}")
    if task is None:
        raise ValueError(
            "answer_likelihood needs the task (its render_answer writes the probes); "
            "pass CreditContext(task=...)"
        )
    answers = correct_answers(batch, answer_source)
    probes, _ = build_probes(batch, tokenizer, task, answers)
    use_packed = packing == "packed"
    if packing == "auto":
        use_packed = packing_supported(policy)
        if not use_packed:
            impl = getattr(policy.config, "_attn_implementation", None)
            warnings.warn(
                f"answer_likelihood: attention implementation {impl!r} may not take a custom 4D "
                "mask; probing with one row per probe (slower). Load the policy with "
                "attn_implementation='sdpa' or 'eager' to pack the probes.",
                stacklevel=2,
            )
    with eval_mode(policy):
        logprobs, forwarded = None, 0
        if use_packed and probes:
            try:
                logprobs, forwarded = packed_probe_logprobs(policy, batch, probes, max_batch_tokens)
            except (RuntimeError, ValueError, TypeError) as err:
                if packing == "packed":
                    raise
                warnings.warn(
                    f"answer_likelihood: the packed probe pass failed ({type(err).__name__}: "
                    f"{err}); falling back to one row per probe",
                    stacklevel=2,
                )
                use_packed = False
        if logprobs is None:
            logprobs, forwarded = unpacked_probe_logprobs(policy, batch, probes, max_batch_tokens)

    n = batch.num_segments
    S = int(n.max()) if len(n) else 0
    values = torch.zeros(batch.size, S + 1, dtype=torch.float)
    for p, lp in zip(probes, logprobs):
        values[p.row, p.k] += float(lp.sum().exp())
    values = values.clamp(max=1.0)
    rows = torch.arange(batch.size)
    values[rows, n] = batch.rewards.detach().float().cpu()
    mask = torch.arange(S + 1).unsqueeze(0) <= n.unsqueeze(1)
    device = batch.rewards.device
    stats = {
        "credit/extra_forward_tokens": float(forwarded),
        "credit/extra_generated_tokens": 0.0,
        "credit/probe_tokens": float(sum(len(p.ids) for p in probes)),
        "credit/probes": float(len(probes)),
        "credit/probe_packed": float(use_packed),
        "credit/empty_answer_sets": float(sum(1 for a in answers if not a)),
    }
    return values.to(device), mask.to(device), stats


@register_credit("answer_likelihood")
class AnswerLikelihoodCredit(CreditMethod):
    """Values from the policy's probability of answering correctly right after each prefix.

    The first batch in ``auto`` packing is also probed unpacked once, and a mismatch (a model
    whose attention does not honour the custom 4D mask) switches this instance to unpacked
    probing with a warning.
    """

    max_batch_tokens: int = 65536

    def __init__(self, config, context: CreditContext) -> None:
        super().__init__(config, context)
        if context.task is None:
            raise ValueError(
                "answer_likelihood needs the task (its render_answer writes the probes); "
                "pass CreditContext(task=...)"
            )
        self._packing = "auto"
        self._checked = False
        self._stats: dict[str, float] = {}

    def _check_packing(self, batch: RolloutBatch) -> None:
        """Compare packed and unpacked log-probs on the first row that has probes."""
        self._checked = True
        ctx = self.context
        if not packing_supported(ctx.policy):
            return
        answers = correct_answers(batch, self.config.answer_source)
        probes, _ = build_probes(batch, ctx.tokenizer, ctx.task, answers)
        if not probes:
            self._checked = False  # nothing to compare yet
            return
        first = [p for p in probes if p.row == probes[0].row]
        with torch.no_grad(), eval_mode(ctx.policy):
            try:
                packed, _ = packed_probe_logprobs(ctx.policy, batch, first)
            except (RuntimeError, ValueError, TypeError):
                return  # answer_values falls back (and warns) on its own
            plain, _ = unpacked_probe_logprobs(ctx.policy, batch, first)
        _, dtype = _model_device_dtype(ctx.policy)
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        worst = max(float((a - b).abs().max()) for a, b in zip(packed, plain))
        if worst > tol:
            warnings.warn(
                f"answer_likelihood: packed probe log-probs differ from unpacked ones by {worst:.3g} "
                "(the model does not honour a custom 4D attention mask); probing with one row per "
                "probe from now on",
                stacklevel=3,
            )
            self._packing = "unpacked"

    def segment_values(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._checked:
            self._check_packing(batch)
        ctx = self.context
        values, mask, self._stats = answer_values(
            ctx.policy,
            ctx.tokenizer,
            ctx.task,
            batch,
            answer_source=self.config.answer_source,
            packing=self._packing,
            max_batch_tokens=self.max_batch_tokens,
        )
        return values, mask

    def compute(self, batch: RolloutBatch) -> CreditOutput:
        out = super().compute(batch)
        out.metrics.update(self._stats)
        return out

"""Answer likelihood: the policy as its own judge (docs/method.md, value sources).

``V(s_k) = sum_{a in A+} pi(probe(a) | s_k)``: the probability that the policy, made to answer
right after the prefix ``s_k``, states a correct answer.

**The probe** is ``cue ⊕ a ⊕ close ⊕ eos`` (``credit.answer_likelihood.cue``,
``credit.answer_likelihood.eos``):

- ``task``: the task's own answer line ``task.render_answer(a)`` (``A:15``, ``#### 15``,
  ``\\boxed{15}``) on a line of its own, so ``\\nA:15`` after a prefix that ends mid-line and
  ``A:15`` after one that ends with a newline (gold arithmetic traces put the answer on its own
  line: ``...20-5=15\\nA:15``).
- ``think``: ``\\n</think>\\n\\nThe final answer is \\boxed{15}`` for models that reason inside
  ``<think> ... </think>``. Such a model never answers mid-thought, so a plain answer line scores
  near zero at every boundary of a long trace; closing the thought first asks the question it does
  answer. Once the prefix has closed the thought itself (its last ``</think>`` comes after its last
  ``<think>``, the prompt included), the probe leaves ``</think>`` out.
- ``auto`` (default): ``think`` when the tokenizer or its chat template knows ``</think>``, else
  ``task``. Any other text is a literal cue: the answer follows it and every brace it leaves open
  is closed after the answer.

Leading newlines of the probe that the prefix already ends with are dropped (a prefix ending in
``\\n\\n`` gets ``The final answer is ...``). The probe is tokenised on its own, not jointly with
the prefix. ``eos``: ``true``, ``false`` or ``auto``, where ``auto`` appends EOS only when the
probe does not end in a closing bracket or tag (``A:15<eos>`` must not count ``A:150``;
``\\boxed{15}`` is complete, and a model usually writes more after it). Without EOS, a probe that
is a prefix of another one (``A:1`` of ``A:15``) already counts its mass, so the longer one is
dropped.

**The correct answers** ``A+`` (``credit.answer_likelihood.source``): ``reference`` the problem's
reference answer, ``group`` the distinct parsed answers of the group's verified-correct completions,
``both`` their union. With ``credit.answer_likelihood.renderings`` each answer also brings its
equivalent renderings (:func:`rredcot.tasks.answers.equivalent_renderings`: ``20``, ``20.0``,
``$20``, ``1,000``, ``3/4``, ``\\frac{3}{4}``) that the task's verifier accepts on the task's own
answer line (the arithmetic verifier takes integers only, so there ``A+`` stays ``{15}``). Probes
with the same token ids count once. A group with an empty ``A+`` (``group`` source, no correct
sample) gets ``V = 0`` at every boundary.

The estimate can only **under**-estimate the probability of answering correctly: a correct answer
written in a way that is not probed is missed. Measured (``benchmarks/answer_likelihood_probes.py``
on the model of ``test_missing_renderings_under_estimate``): a tiny Llama taught to write
``\\boxed{15}`` and ``\\boxed{15.0}`` about equally often gets, on 12 gold traces right before
``</think>``, a mean ``V = 0.083`` from the reference rendering alone and ``0.167`` with
``credit.answer_likelihood.renderings``: half of its probability of answering correctly was missed.

Where it works: a model that has learned to answer from a partial chain (warm-start with
``early_answer_prob > 0``), or a reasoning model probed with the cue it answers after. A model
that only ever copies its final running result into the answer line gives every intermediate
probe a probability near zero, and the estimator then cannot tell good steps from bad ones
(docs/method.md, failure modes).

**Safe credit** (the value head's guards, :mod:`rredcot.methods.guard`): the values are anchored
on the group's mean reward (``credit.anchor=group``: ``V'(s_k) = V(s_k) - V(s_0) + mean R_group``,
so every trace gets GRPO's total credit); the credit is handed over from uniform (GRPO) credit by a
weight ``w`` that tracks the estimator's measured reliability on fresh outcomes (the slope
``prediction_slope`` of the batch's outcomes on ``V'(s_{n-1})``, measured in ``update`` after the
step's credit was computed, smoothed across steps, clipped to [0, 1]; ``credit.handover.mode``); and
the advantages are divided by the group's reward std, or by the batch's where a group's rewards
agree (``group_or_batch_std``). With ``w = 0`` (the first step) the credit is uniform GRPO credit
bit for bit. A batch whose values hardly depart from the baseline (root mean square of ``V'(s_{n-1})
- mean R_group`` below ``MIN_DEPARTURE_RMS = 0.01``) leaves the reliability as it is: on the default
warm-start, which never answers early, every probe before the last step is near 0, and over the 20
fit batches of ``rredcot bench credit`` the slope of those tiny departures averaged 3,417; clipped
to 1 it handed over (reliability 0.69) an estimator with nothing to say, and at ``lam < 1`` its
credit is the all-blame-on-the-last-segment credit of docs/method.md, failure modes.

**Cost and memory**: no generation. All probes of a trace (``n`` boundaries x ``|A+|`` answers) go
into **one** packed forward pass: ``[prompt | response up to b_{n-1} | probe_0 | probe_1 | ...]``
with a 4D float attention mask (0 allowed, dtype-min elsewhere) under which each probe sees the
prompt, the response up to its boundary and its own earlier tokens, and position ids that continue
from its prefix. Models whose attention does not take a custom 4D mask (or whose packed log-probs do
not match the unpacked ones on a first check) fall back to one row per probe with a warning. Rows
are grouped into forwards of at most ``credit.answer_likelihood.chunk_tokens`` tokens. The forward
runs the model's trunk only (``get_decoder()``); the output head is applied to the hidden states of
the scored positions alone, at most ``credit.answer_likelihood.logits_mb`` MiB of fp32 logits at a
time, so no ``(rows, length, vocab)`` logits tensor is ever built (models whose trunk and head do
not reproduce their logits on a first check use the full forward). ``V(s_n)`` is not probed: the
credit algebra sets it to the outcome ``R``.
"""

from __future__ import annotations

import re
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rredcot.batch import RolloutBatch
from rredcot.config import AnswerLikelihoodConfig
from rredcot.methods.base import CreditContext, register_credit
from rredcot.methods.value_source import ValueSourceCredit
from rredcot.rollout import eval_mode, position_ids_from_mask
from rredcot.tasks.answers import equivalent_renderings
from rredcot.tasks.base import safe_verify

PACKING_MODES = ("auto", "packed", "unpacked")
CUE_PRESETS = ("auto", "task", "think")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
THINK_CUE = "\n</think>\n\nThe final answer is \\boxed{"
NUM_FEATURES = 2  # value-head features: V and its squashed log
_PACKED_ATTENTION = ("eager", "sdpa")  # attention implementations that add a custom 4D mask
_CLOSED_END = re.compile(r"(?:[}\])]|</[^<>\s]+>)\s*$")
_TAIL_TOKENS = 4  # prefix tokens decoded to see how the prefix ends


@dataclass(frozen=True)
class Probe:
    """One answer probe: answer token ids ``ids`` right after boundary ``b`` of row ``row``."""

    row: int
    k: int  # boundary index: the prefix is s_k
    b: int  # response tokens in the prefix (b_k)
    ids: tuple[int, ...]


@dataclass(frozen=True)
class ProbeFormat:
    """How a probe is written: ``cue`` (``auto``, ``task``, ``think`` or literal text), ``eos``
    (``auto``, ``true``, ``false``) and whether equivalent ``renderings`` are probed too."""

    cue: str = "auto"
    eos: str = "auto"
    renderings: bool = True

    def __post_init__(self) -> None:
        if not self.cue:
            raise ValueError("answer cue is empty: use auto, task, think or the literal cue text")
        if self.eos not in ("auto", "true", "false"):
            raise ValueError(f"answer eos={self.eos!r}: use auto, true or false")

    @classmethod
    def from_config(cls, config: AnswerLikelihoodConfig) -> ProbeFormat:
        """From ``credit.answer_likelihood``'s ``cue``, ``eos`` and ``renderings``."""
        return cls(config.cue, config.eos, bool(config.renderings))


# ---------------------------------------------------------------------------------------------
# What to probe


def correct_answers(batch: RolloutBatch, source: str = "reference") -> list[list[str]]:
    """Per row, the answers counted as correct (``A+``, before renderings), in a stable order.

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


def answer_renderings(task, problem, answer: str) -> list[str]:
    """``answer`` and those of its :func:`equivalent_renderings` that the task's verifier scores
    correct (reward >= 1) when written on the task's own answer line."""
    out = [answer]
    for form in equivalent_renderings(answer)[1:]:
        if safe_verify(task, problem, task.render_answer(form)).reward >= 1.0:
            out.append(form)
    return out


def probe_answers(
    batch: RolloutBatch, task, source: str = "reference", renderings: bool = True
) -> list[list[str]]:
    """Per row, every answer string to probe: :func:`correct_answers`, each followed by its
    accepted renderings when ``renderings`` (no repeats)."""
    answers = correct_answers(batch, source)
    if not renderings:
        return answers
    cache: dict[tuple[str, str], list[str]] = {}
    out = []
    for row, found in enumerate(answers):
        problem = batch.problems[row] if batch.problems else None
        expanded: list[str] = []
        for a in found:
            key = (a, "" if problem is None else problem.prompt)
            if key not in cache:
                cache[key] = [a] if problem is None else answer_renderings(task, problem, a)
            expanded += [r for r in cache[key] if r not in expanded]
        out.append(expanded)
    return out


def uses_think_tags(tokenizer) -> bool:
    """Whether the tokenizer (its vocabulary or its chat template) knows ``</think>``."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    if isinstance(template, str) and THINK_CLOSE in template:
        return True
    try:
        token_id = tokenizer.convert_tokens_to_ids(THINK_CLOSE)
    except (AttributeError, KeyError, TypeError):
        return False
    return token_id is not None and token_id != getattr(tokenizer, "unk_token_id", None)


def resolve_cue(cue: str, tokenizer) -> str:
    """``auto`` -> ``think`` or ``task`` (see the module docstring); anything else unchanged."""
    if cue == "auto":
        return "think" if uses_think_tags(tokenizer) else "task"
    return cue


def thought_closed(text: str) -> bool:
    """Whether ``text`` has closed its thought: a ``</think>`` after its last ``<think>``."""
    close = text.rfind(THINK_CLOSE)
    return close >= 0 and close > text.rfind(THINK_OPEN)


def _drop_newline_overlap(tail: str, text: str) -> str:
    """``text`` without the leading newlines that ``tail`` (how the prefix ends) already has."""
    lead = len(text) - len(text.lstrip("\n"))
    k = lead
    while k > 0 and not tail.endswith("\n" * k):
        k -= 1
    return text[k:]


def probe_text(task, answer: str, cue: str, tail: str = "\n", closed: bool = False) -> str:
    """The text appended after a prefix that ends with ``tail`` to state ``answer``.

    ``cue``: ``task``, ``think`` or literal text (``auto`` resolved already, see
    :func:`resolve_cue`); ``closed``: the prefix has closed its thought (``think`` and literal cues
    holding ``</think>`` then leave it out).
    """
    if cue == "auto":
        raise ValueError("probe_text needs a resolved cue: call resolve_cue(cue, tokenizer)")
    if cue == "task":
        text = "\n" + task.render_answer(answer)
    else:
        opening = THINK_CUE if cue == "think" else cue
        if closed and THINK_CLOSE in opening:
            opening = opening[opening.index(THINK_CLOSE) + len(THINK_CLOSE) :]
        unclosed = max(opening.count("{") - opening.count("}"), 0)
        text = opening + answer + "}" * unclosed
    return _drop_newline_overlap(tail, text)


def wants_eos(text: str, eos: str) -> bool:
    """``eos`` ``true``/``false`` as given; ``auto``: unless ``text`` ends in ``} ] )`` or a
    closing tag."""
    if eos == "auto":
        return _CLOSED_END.search(text) is None
    return eos == "true"


def probe_token_ids(tokenizer, text: str, eos: bool = True) -> tuple[int, ...]:
    """``text`` tokenised without special tokens, then EOS (with ``eos`` and a tokenizer that has
    one)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if eos and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError(f"probe text {text!r} encodes to no tokens (and no EOS is appended)")
    return tuple(ids)


def prompt_token_ids(batch: RolloutBatch, row: int) -> list[int]:
    """The non-pad prompt tokens of ``row``."""
    P = batch.prompt_len
    keep = batch.attention_mask[row, :P].bool()
    return batch.input_ids[row, :P][keep].tolist()


def _drop_dominated(probes: list[Probe]) -> list[Probe]:
    """Drop a probe whose ids extend another probe's at the same boundary (its mass is counted in
    the shorter one already); keeps the order."""
    by_slot: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for p in probes:
        by_slot.setdefault((p.row, p.k), []).append(p.ids)
    keep = []
    for p in probes:
        others = by_slot[(p.row, p.k)]
        if not any(len(o) < len(p.ids) and p.ids[: len(o)] == o for o in others):
            keep.append(p)
    return keep


def build_probes(
    batch: RolloutBatch,
    tokenizer,
    task,
    answers: list[list[str]],
    probe: ProbeFormat | None = None,
) -> tuple[list[Probe], list[list[int]]]:
    """Every probe of the batch: for each row, each boundary ``k < n`` and each answer.

    Returns the probes and, per row, the boundaries probed. The text of each probe is
    :func:`probe_text` for the prefix ``s_k`` (see the module docstring for the cue rules).
    """
    probe = probe or ProbeFormat()
    cue = resolve_cue(probe.cue, tokenizer)
    needs_closure = cue == "think" or THINK_CLOSE in cue
    P = batch.prompt_len
    id_cache: dict[str, tuple[int, ...]] = {}
    tail_cache: dict[tuple[int, ...], str] = {}
    probes: list[Probe] = []
    probed: list[list[int]] = []
    for row, bounds in enumerate(batch.boundaries):
        n = len(bounds) - 1
        ks = list(range(n)) if answers[row] else []
        probed.append(ks)
        if not ks:
            continue
        prompt_ids = prompt_token_ids(batch, row)
        response = batch.input_ids[row, P : P + bounds[-1]].tolist()
        prompt_text = (
            tokenizer.decode(prompt_ids, skip_special_tokens=False) if needs_closure else ""
        )
        for k in ks:
            b = bounds[k]
            last = tuple((prompt_ids + response[:b])[-_TAIL_TOKENS:])
            if last not in tail_cache:
                tail_cache[last] = tokenizer.decode(list(last), skip_special_tokens=False)
            closed = needs_closure and thought_closed(
                prompt_text + tokenizer.decode(response[:b], skip_special_tokens=False)
            )
            for a in answers[row]:
                text = probe_text(task, a, cue, tail_cache[last], closed)
                if text not in id_cache:
                    id_cache[text] = probe_token_ids(tokenizer, text, wants_eos(text, probe.eos))
                probes.append(Probe(row, k, b, id_cache[text]))
    # Two answers that render the same are one answer: drop repeated (row, k, ids).
    unique = list(dict.fromkeys(probes))
    return _drop_dominated(unique), probed


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


def _unwrap(policy):
    """The model inside a DDP / DeepSpeed style wrapper (``.module``)."""
    while isinstance(getattr(policy, "module", None), nn.Module):
        policy = policy.module
    return policy


def _plain_forward(policy):
    """The model's own ``forward`` at its parameters' dtype: the class's method on the unwrapped
    model. Mixed precision (accelerate's ``prepare`` with bf16, as TRL runs on a CPU by default)
    wraps the *instance's* forward in an autocast; calling the trunk directly bypasses that
    wrapper, so the logits it is checked against must bypass it too."""
    model = _unwrap(policy)
    return type(model).forward.__get__(model)


def _no_autocast(device: torch.device):
    """Probe log-probs at the parameters' own dtype whatever autocast is active outside: packed
    and unpacked passes then agree to that dtype's precision (under a bf16 autocast they differ
    by ~0.1-0.2 nats on a 30-layer model, which read as a mask the model does not honour)."""
    return torch.autocast(device_type=device.type, enabled=False)


def _vocab_size(policy, head: nn.Module | None) -> int:
    size = getattr(head, "out_features", None) or getattr(
        getattr(_unwrap(policy), "config", None), "vocab_size", None
    )
    if not size:
        raise ValueError("cannot tell the policy's vocabulary size (no config.vocab_size)")
    return int(size)


def _softcap(policy, logits: Tensor) -> Tensor:
    cap = getattr(getattr(_unwrap(policy), "config", None), "final_logit_softcapping", None)
    return logits if not cap else torch.tanh(logits / cap) * cap


_SPLIT_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _trunk_and_head(policy) -> tuple[nn.Module, nn.Module] | None:
    """``(trunk, output head)`` of a causal LM whose ``head(trunk(x))`` (soft-capped as the model
    does) reproduces its logits, checked once per model on a short input; None otherwise."""
    model = _unwrap(policy)
    if model in _SPLIT_CHECKED:
        return _SPLIT_CHECKED[model]
    split = None
    try:
        trunk, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError, ValueError):
        trunk = head = None
    separable = isinstance(trunk, nn.Module) and isinstance(head, nn.Module) and trunk is not model
    if separable:
        device, dtype = _model_device_dtype(model)
        vocab = _vocab_size(model, head)
        ids = (torch.arange(6, device=device) * 7 + 3).remainder(vocab).unsqueeze(0)
        with torch.no_grad(), eval_mode(model), _no_autocast(device):
            try:
                full = _plain_forward(model)(input_ids=ids, use_cache=False).logits.float()
                hidden = _last_hidden(trunk(input_ids=ids, use_cache=False))
                mine = _softcap(model, head(hidden)).float()
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                if mine.shape == full.shape and bool(
                    ((mine - full).abs() <= tol * (1.0 + full.abs())).all()
                ):
                    split = (trunk, head)
            except (RuntimeError, TypeError, ValueError, AttributeError):
                split = None
    if split is None:
        why = "do not reproduce its logits" if separable else "are not separable"
        warnings.warn(
            f"answer_likelihood: {type(model).__name__}'s trunk and output head "
            f"(get_decoder(), get_output_embeddings()) {why}; probes are scored from the full "
            f"logits: {4 * (getattr(model.config, 'vocab_size', 0) or 0) / 2**20:.2f} MiB of fp32 "
            "per forwarded token "
            "(rows x length x vocabulary) instead of per probe token only (lower "
            "credit.answer_likelihood.chunk_tokens if it runs out)",
            stacklevel=3,
        )
    _SPLIT_CHECKED[model] = split
    return split


def _last_hidden(output) -> Tensor:
    hidden = getattr(output, "last_hidden_state", None)
    return hidden if hidden is not None else output[0]


def _score(
    policy,
    forward: dict[str, Tensor],
    predictors: list[tuple[int, Tensor, Tensor, int]],
    out: list,
    logits_mb: int,
) -> None:
    """Log-probs of each probe's targets at its predictor columns, into ``out[i]``.

    The trunk's hidden states are gathered at the predictor positions before the output head, and
    the head and log-softmax run over at most ``logits_mb`` MiB of fp32 logits at a time.
    """
    if not predictors:
        return
    with _no_autocast(forward["input_ids"].device):
        _score_at_own_dtype(policy, forward, predictors, out, logits_mb)


def _score_at_own_dtype(policy, forward, predictors, out, logits_mb) -> None:
    split = _trunk_and_head(policy)
    device = forward["input_ids"].device
    rows = torch.cat([torch.full_like(cols, r) for r, cols, _, _ in predictors]).to(device)
    cols = torch.cat([c for _, c, _, _ in predictors]).to(device)
    targets = torch.cat([t for _, _, t, _ in predictors]).to(device)
    if split is not None:
        trunk, head = split
        picked = _last_hidden(trunk(**forward, use_cache=False))[rows, cols]  # (N, H)

        def logits_of(sl: slice) -> Tensor:
            return _softcap(policy, head(picked[sl]))
    else:
        head = None
        picked = _plain_forward(policy)(**forward, use_cache=False).logits[rows, cols]  # (N, V)

        def logits_of(sl: slice) -> Tensor:
            return picked[sl]

    step = max(1, (logits_mb << 20) // (4 * _vocab_size(policy, head)))
    token_logp = torch.empty(len(targets), dtype=torch.float32)
    for start in range(0, len(targets), step):
        sl = slice(start, start + step)
        logits = logits_of(sl).float()
        chosen = logits.gather(-1, targets[sl].unsqueeze(-1)).squeeze(-1)
        token_logp[sl] = (chosen - torch.logsumexp(logits, dim=-1)).cpu()
        del logits
    start = 0
    for _, c, _, i in predictors:
        out[i] = token_logp[start : start + len(c)]
        start += len(c)


@torch.no_grad()
def packed_probe_logprobs(
    policy,
    batch: RolloutBatch,
    probes: list[Probe],
    max_batch_tokens: int = 16384,
    logits_mb: int = 256,
) -> tuple[list[Tensor], int]:
    """Per-token log-probs of every probe, all probes of a trace in one packed row.

    Row layout ``[prompt (P columns, left-padded) | response[:c] | probe_0 | probe_1 | ...]``
    (``c`` the largest boundary probed in that row), right-padded to the chunk's longest row.
    Mask ``(R, 1, L, L)``: context tokens are causal over the non-pad context; a probe at
    boundary ``b`` sees the prompt, ``response[:b]`` and its own earlier tokens. Positions of a
    probe continue from its prefix (``prompt tokens + b``). Rows go into forwards of at most
    ``max_batch_tokens`` (rows x longest row); ``logits_mb`` bounds the logits (see
    :func:`_score`).

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
    out: list[Tensor | None] = [None] * len(probes)
    forwarded = 0
    for group in _chunks(lengths, max_batch_tokens):
        L = max(lengths[g] for g in group)
        R = len(group)
        ids = torch.full((R, L), pad, dtype=torch.long)
        pos = torch.zeros(R, L, dtype=torch.long)
        allowed = torch.zeros(R, L, L, dtype=torch.bool)
        allowed[:, torch.arange(L), torch.arange(L)] = True  # pad queries see themselves only
        predictors: list[tuple[int, Tensor, Tensor, int]] = []  # (r, cols, targets, i)
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
        del allowed
        forward = {
            "input_ids": ids.to(device),
            "attention_mask": mask.to(device),
            "position_ids": pos.to(device),
        }
        del mask
        _score(policy, forward, predictors, out, logits_mb)
    return out, forwarded  # type: ignore[return-value]


@torch.no_grad()
def unpacked_probe_logprobs(
    policy,
    batch: RolloutBatch,
    probes: list[Probe],
    max_batch_tokens: int = 16384,
    logits_mb: int = 256,
) -> tuple[list[Tensor], int]:
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
    out: list[Tensor | None] = [None] * len(probes)
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
        forward = {
            "input_ids": ids.to(device),
            "attention_mask": attn.to(device),
            "position_ids": position_ids_from_mask(attn).to(device),
        }
        _score(policy, forward, predictors, out, logits_mb)
    return out, forwarded  # type: ignore[return-value]


def probe_pass_tokens(batch: RolloutBatch, probes: list[Probe]) -> tuple[int, int]:
    """``(packed, unpacked)``: the tokens a probe pass forwards with one packed row per trace
    (prompt, the longest probed prefix, every probe) and with one row per probe (each re-runs its
    prompt and prefix). Their ratio is what falling back to unpacked probing costs."""
    P = batch.prompt_len
    prompt = batch.attention_mask[:, :P].sum(dim=1).tolist()
    longest: dict[int, int] = {}
    packed = unpacked = 0
    for p in probes:
        longest[p.row] = max(longest.get(p.row, 0), p.b)
        packed += len(p.ids)
        unpacked += int(prompt[p.row]) + p.b + len(p.ids)
    packed += sum(int(prompt[r]) + b for r, b in longest.items())
    return packed, unpacked


def _fallback_cost(batch: RolloutBatch, probes: list[Probe]) -> str:
    packed, unpacked = probe_pass_tokens(batch, probes)
    ratio = unpacked / max(packed, 1)
    return (
        f"one row per probe re-runs each probe's prompt and prefix: {ratio:.1f}x the forward "
        f"tokens of packing on this batch ({unpacked} against {packed}), so expect the probe pass "
        f"to take about {ratio:.1f}x as long"
    )


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
    max_batch_tokens: int = 16384,
    probe: ProbeFormat | None = None,
    logits_mb: int = 256,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """``V(s_k) = sum_{a in A+} exp(sum log pi(probe(a) | s_k))`` for every boundary ``k < n``.

    Returns ``(values (B, S+1), value_mask (B, S+1) bool, stats)``; ``values[b, n_b] = R_b``
    (the algebra sets ``V(s_n) := R`` anyway). ``probe`` says how probes are written (default:
    :class:`ProbeFormat` ``()``); ``packing``: ``packed`` (one forward row per trace),
    ``unpacked`` (one row per probe) or ``auto`` (packed when the attention implementation takes
    a custom 4D mask, else unpacked with a warning; a packed pass that raises also falls back
    with a warning).
    """
    if packing not in PACKING_MODES:
        raise ValueError(f"packing={packing!r}: use {', '.join(PACKING_MODES)}")
    if task is None:
        raise ValueError(
            "answer_likelihood needs the task (its render_answer writes the probes); "
            "pass CreditContext(task=...)"
        )
    probe = probe or ProbeFormat()
    answers = probe_answers(batch, task, answer_source, probe.renderings)
    probes, _ = build_probes(batch, tokenizer, task, answers, probe)
    use_packed = packing == "packed"
    if packing == "auto":
        use_packed = packing_supported(policy)
        if not use_packed:
            impl = getattr(policy.config, "_attn_implementation", None)
            warnings.warn(
                f"answer_likelihood: attention implementation {impl!r} may not take a custom 4D "
                f"mask; probing with one row per probe: {_fallback_cost(batch, probes)}. Load the "
                "policy with attn_implementation='sdpa' or 'eager' to pack the probes.",
                stacklevel=2,
            )
    budget = {"max_batch_tokens": max_batch_tokens, "logits_mb": logits_mb}
    with eval_mode(policy):
        logprobs, forwarded = None, 0
        if use_packed and probes:
            try:
                logprobs, forwarded = packed_probe_logprobs(policy, batch, probes, **budget)
            except (RuntimeError, ValueError, TypeError) as err:
                if packing == "packed":
                    raise
                warnings.warn(
                    f"answer_likelihood: the packed probe pass failed ({type(err).__name__}: "
                    f"{err}); falling back to one row per probe: {_fallback_cost(batch, probes)}",
                    stacklevel=2,
                )
                use_packed = False
        if logprobs is None:
            logprobs, forwarded = unpacked_probe_logprobs(policy, batch, probes, **budget)

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
    probed_rows = [a for a in answers if a]
    stats = {
        "credit/extra_forward_tokens": float(forwarded),
        "credit/extra_generated_tokens": 0.0,
        "credit/probe_tokens": float(sum(len(p.ids) for p in probes)),
        "credit/probes": float(len(probes)),
        "credit/probe_packed": float(use_packed),
        "credit/probe_think_cue": float(resolve_cue(probe.cue, tokenizer) != "task"),
        "credit/answers_per_row": sum(len(a) for a in probed_rows) / max(len(probed_rows), 1),
        "credit/empty_answer_sets": float(sum(1 for a in answers if not a)),
    }
    return values.to(device), mask.to(device), stats


def prefix_features(values: Tensor, value_mask: Tensor) -> Tensor:
    """Answer-likelihood values as value-head input features: ``[V, -log(1 - log V)]`` at every
    boundary ``k < n`` (the log squashed as the log-prob features are), 0 at ``s_n`` (where
    :func:`answer_values` holds the outcome, which a feature must never see) and on padding.

    Args:
        values: ``(B, S+1)`` from :func:`answer_values`; value_mask: ``(B, S+1)``.

    Returns:
        ``(B, S+1, 2)`` float32.
    """
    mask = value_mask.bool()
    n = mask.sum(dim=1) - 1
    cols = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    keep = mask & (cols < n.unsqueeze(1))
    v = torch.where(keep, values.float(), torch.zeros_like(values, dtype=torch.float32))
    log_v = torch.log(v.clamp_min(1e-30))
    feats = torch.stack([v, -torch.log1p(-log_v)], dim=-1)
    return torch.where(keep.unsqueeze(-1), feats, torch.zeros_like(feats))


# ---------------------------------------------------------------------------------------------
# The credit method


@register_credit("answer_likelihood", options=AnswerLikelihoodConfig)
class AnswerLikelihoodCredit(ValueSourceCredit):
    """Values from the policy's probability of answering correctly right after each prefix, with
    the value head's guards (anchor, hand-over, safe normalisation; module docstring).

    ``compute(batch)`` probes the batch and hands credit over from uniform by ``reliability``
    (from earlier batches); ``update(batch)`` then scores those same values against the batch's
    outcomes and folds the slope into ``reliability``. ``pretrain(sample_batch, steps)`` earns
    reliability on the warm-start policy's samples before RL.

    The first batch in ``auto`` packing is also probed unpacked once, and a mismatch (a model
    whose attention does not honour the custom 4D mask) switches this instance to unpacked
    probing with a warning.
    """

    def __init__(self, config, context: CreditContext) -> None:
        super().__init__(config, context)
        if context.task is None:
            raise ValueError(
                "answer_likelihood needs the task (its render_answer writes the probes); "
                "pass CreditContext(task=...)"
            )
        self.probe = ProbeFormat.from_config(self.options)
        self._packing = "auto"
        self._checked = False

    @property
    def max_batch_tokens(self) -> int:
        return int(self.options.chunk_tokens)

    def _check_packing(self, batch: RolloutBatch) -> None:
        """Compare packed and unpacked log-probs on the first row that has probes."""
        self._checked = True
        ctx = self.context
        if not packing_supported(ctx.policy):
            return
        answers = probe_answers(batch, ctx.task, self.options.source, self.probe.renderings)
        probes, _ = build_probes(batch, ctx.tokenizer, ctx.task, answers, self.probe)
        if not probes:
            self._checked = False  # nothing to compare yet
            return
        first = [p for p in probes if p.row == probes[0].row]
        budget = {
            "max_batch_tokens": self.max_batch_tokens,
            "logits_mb": self.options.logits_mb,
        }
        with torch.no_grad(), eval_mode(ctx.policy):
            try:
                packed, _ = packed_probe_logprobs(ctx.policy, batch, first, **budget)
            except (RuntimeError, ValueError, TypeError):
                return  # answer_values falls back (and warns) on its own
            plain, _ = unpacked_probe_logprobs(ctx.policy, batch, first, **budget)
        _, dtype = _model_device_dtype(ctx.policy)
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        worst = max(float((a - b).abs().max()) for a, b in zip(packed, plain))
        if worst > tol:
            warnings.warn(
                f"answer_likelihood: packed probe log-probs differ from unpacked ones by {worst:.3g} "
                "(the model does not honour a custom 4D attention mask with per-probe position "
                f"ids); probing with one row per probe from now on: {_fallback_cost(batch, probes)}",
                stacklevel=3,
            )
            self._packing = "unpacked"

    # -- values ---------------------------------------------------------------------------------
    def boundary_values(self, batch: RolloutBatch) -> tuple[Tensor, Tensor, dict[str, float]]:
        """``(values (B, S+1), mask (B, S+1), stats)``: the probed values, not anchored, with
        ``values[:, n] = R``, and the probe pass's statistics."""
        if not self._checked:
            self._check_packing(batch)
        ctx = self.context
        return answer_values(
            ctx.policy,
            ctx.tokenizer,
            ctx.task,
            batch,
            answer_source=self.options.source,
            packing=self._packing,
            max_batch_tokens=self.max_batch_tokens,
            probe=self.probe,
            logits_mb=self.options.logits_mb,
        )

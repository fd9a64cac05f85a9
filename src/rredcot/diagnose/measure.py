"""The measurement of ``rredcot diagnose``: sample the policy's groups, read each token's
probability, run Monte Carlo from the segment boundaries of a capped subset, score the cheap
estimators against it (:mod:`rredcot.explain.scores`, the credit benchmark's scoring), and hand
the figures to :mod:`.figures` and the headline to :func:`.verdict.verdict`.

:func:`diagnose` (a loaded policy) and :func:`diagnose_source` (what the CLI calls: the policy
from a path, alias or run directory) return a :class:`~.report.DiagnoseReport`.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoConfig

from rredcot.algebra import credit as credit_algebra
from rredcot.config import CreditConfig, SamplingConfig
from rredcot.config.diagnose import DiagnoseConfig
from rredcot.config.io import brief, from_dict
from rredcot.diagnose.figures import (
    CONFIDENCE,
    Chunk,
    agreement_by_group_size,
    chunk_from_batch,
    gradient_figures,
    interval_entry,
    ratio_interval,
    step_credit_figures,
    trace_figures,
)
from rredcot.diagnose.report import DiagnoseReport
from rredcot.diagnose.verdict import verdict
from rredcot.errors import UserError
from rredcot.explain.model import (
    ResolvedCheckpoint,
    choose_task,
    load_method_state,
    resolve_checkpoint,
    run_credit_config,
)
from rredcot.explain.scores import GroundTruth, Traces, evaluate_method, masked_rows, method_scores
from rredcot.machine import refuse_beyond_memory, resolve_device
from rredcot.methods.auto import SUCCESS, policy_figures
from rredcot.methods.base import CreditContext, build_credit
from rredcot.methods.monte_carlo import mc_values
from rredcot.models import load_policy
from rredcot.sampling.batch import RolloutBatch
from rredcot.sampling.forward import eval_mode, policy_forward
from rredcot.sampling.rollout import build_rollout_batch, context_limit, segment_batch
from rredcot.segment import segmenter_from_config
from rredcot.tasks import get_task
from rredcot.tasks.base import Task, read_task_data
from rredcot.training.sft import default_policy_source

# ---------------------------------------------------------------------------------------------
# the forward the figures read


LOGIT_BUDGET = 64_000_000
"""Logits (rows x response length x vocabulary) scored per forward in :func:`token_probabilities`;
a real model's vocabulary makes one forward over every row of a big batch run out of memory
(256 rows x 72 tokens x 49k vocabulary: 3.6 GB per float32 copy)."""


@torch.no_grad()
def token_probabilities(
    policy, batch: RolloutBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p(y_t) (B, T), entropy (B, T))`` of the sampled response tokens under ``policy`` at
    the sampling ``temperature`` (logits / T, as the loss scores them); no-grad forwards over
    as many rows at a time as :data:`LOGIT_BUDGET` allows."""
    vocab = policy.get_output_embeddings().weight.shape[0]
    rows = max(1, LOGIT_BUDGET // max(1, batch.response_len * vocab))
    probs, entropies = [], []
    with eval_mode(policy):
        for start in range(0, batch.size, rows):
            part = slice(start, start + rows)
            fwd = policy_forward(
                policy,
                batch.input_ids[part],
                batch.attention_mask[part],
                batch.prompt_len,
                temperature=temperature,
                with_entropy=True,
            )
            probs.append(fwd.logprobs.exp())
            entropies.append(fwd.entropy)
    return torch.cat(probs), torch.cat(entropies)


# ---------------------------------------------------------------------------------------------
# the measurement


def _sample_chunks(policy, tokenizer, task, problems, segmenter, cfg, s, log) -> list[Chunk]:
    """Sample, verify, segment and score every chunk of prompts."""
    chunks: list[Chunk] = []
    bar = tqdm(
        total=len(problems), desc="sampling", unit="prompt", disable=not cfg.progress, leave=False
    )
    for i in range(0, len(problems), cfg.chunk_prompts):
        part = problems[i : i + cfg.chunk_prompts]
        torch.manual_seed(cfg.seed + i)
        batch, _ = build_rollout_batch(
            policy,
            tokenizer,
            task,
            part,
            segmenter,
            num_generations=cfg.samples,
            max_new_tokens=s["max_new_tokens"],
            temperature=s["temperature"],
            top_p=s["top_p"],
        )
        token_p, entropy = token_probabilities(policy, batch, s["temperature"])
        if segmenter.uses_entropy:
            batch = segment_batch(batch, tokenizer, segmenter, entropy)
        chunks.append(chunk_from_batch(batch, i, token_p, entropy, segmenter))
        bar.update(len(part))
    bar.close()
    return chunks


def _mc_subset(chunks: list[Chunk], cfg: DiagnoseConfig, budget: int) -> list[tuple[int, int]]:
    """A seeded random sample of up to ``cfg.mc_traces`` traces ``(chunk, row)`` with at least
    one segment."""
    rows = [
        (ci, r)
        for ci, c in enumerate(chunks)
        for r in range(c.batch.size)
        if len(c.batch.boundaries[r]) > 1
    ]
    return random.Random(cfg.seed).sample(rows, min(budget, len(rows)))


def _mc_cost(chunks: list[Chunk], picked: list[tuple[int, int]], k: int) -> tuple[int, int, float]:
    """``(unique prefixes, continuations, estimated generated tokens)`` of Monte Carlo values at
    every boundary ``s_0 .. s_{n-1}`` of the picked traces; a continuation of ``s_k`` is expected
    to be as long as the rest of its own trace (``length - b_k``, EOS included)."""
    seen: set = set()
    tokens = 0.0
    for ci, r in picked:
        b = chunks[ci].batch
        P = b.prompt_len
        keep = b.attention_mask[r, :P].bool()
        prompt = tuple(b.input_ids[r, :P][keep].tolist())
        length = int(b.response_mask[r].sum())
        for bk in b.boundaries[r][:-1]:
            key = (prompt, tuple(b.input_ids[r, P : P + bk].tolist()))
            if key in seen:
                continue
            seen.add(key)
            tokens += k * max(1, length - bk)
    return len(seen), len(seen) * k, tokens


def _monte_carlo(policy, tokenizer, task, chunks, cfg: DiagnoseConfig, s, rate, log):
    """Section 3 (and the batches and values section 4 scores against)."""
    picked, prefixes, conts, tokens = _mc_plan(chunks, cfg, rate, log)
    if not picked:
        return None, []
    t0 = time.perf_counter()
    by_chunk: dict[int, list[int]] = {}
    for ci, r in sorted(picked):
        by_chunk.setdefault(ci, []).append(r)
    bar = tqdm(total=prefixes, desc="Monte Carlo", unit="prefix", disable=not cfg.progress)
    subs = []
    sums: dict[str, list[np.ndarray]] = {}
    stats: dict[str, float] = {}
    wrong = 0
    definition = set()
    for ci, rows in by_chunk.items():
        c = chunks[ci]
        sub = c.batch.select(rows)
        values, vmask, st = _mc_values(policy, tokenizer, task, sub, cfg, s, bar)
        for key, x in st.items():
            stats[key] = stats.get(key, 0.0) + x
        ends = _prefix_ends(c, sub, rows, values, vmask, definition)
        wrong += sum(end is not None for end in ends)
        rows_t = torch.tensor(rows)
        figures = step_credit_figures(
            values.cpu(),
            vmask.cpu(),
            sub.rewards.cpu(),
            sub.segment_ids.cpu(),
            sub.response_mask.cpu(),
            c.token_p[rows_t],
            c.advantages[rows_t],
            ends,
        )
        for key, x in figures.items():
            sums.setdefault(key, []).append(x)
        subs.append((sub, values, vmask, c.batch, rows))
    bar.close()
    seconds = time.perf_counter() - t0
    result = {
        "traces": len(picked),
        "wrong_traces": wrong,
        "k": cfg.mc_k,
        "prefixes": int(stats.get("credit/mc_prefixes", prefixes)),
        "continuations": int(stats.get("credit/mc_continuations", conts)),
        "estimated_tokens": tokens,
        "generated_tokens": stats.get("credit/extra_generated_tokens", 0.0),
        "seconds": seconds,
        **_mc_shares(sums, subs, definition, cfg.bootstrap, cfg.seed),
    }
    return result, subs


def _mc_plan(chunks: list[Chunk], cfg: DiagnoseConfig, rate, log):
    """The Monte Carlo subset ``(chunk, row)`` and its cost ``(prefixes, continuations,
    estimated tokens)``, cut from the end until the cost fits ``cfg.mc_max_tokens``; logs both."""
    picked = _mc_subset(chunks, cfg, cfg.mc_traces)
    prefixes, conts, tokens = _mc_cost(chunks, picked, cfg.mc_k)
    log(
        f"Monte Carlo values: {len(picked)} traces, {prefixes} boundary prefixes x K = "
        f"{cfg.mc_k}: {conts} continuations, about {tokens:,.0f} generated tokens"
        + (f" (~{tokens / rate:.0f} s at this run's sampling rate)" if rate else "")
    )
    if tokens > cfg.mc_max_tokens:
        while picked and _mc_cost(chunks, picked, cfg.mc_k)[2] > cfg.mc_max_tokens:
            picked = picked[:-1]
        prefixes, conts, tokens = _mc_cost(chunks, picked, cfg.mc_k)
        log(
            f"  over --mc-max-tokens {cfg.mc_max_tokens:,}: the subset is cut to {len(picked)} "
            f"traces ({conts} continuations, about {tokens:,.0f} tokens)"
        )
    return picked, prefixes, conts, tokens


def _mc_values(policy, tokenizer, task, sub: RolloutBatch, cfg: DiagnoseConfig, s, bar):
    """:func:`mc_values` of ``sub``'s boundaries at the report's sampling settings, advancing
    ``bar`` by the prefixes done."""

    def advance(n: int, total: int) -> None:
        bar.update(n - advance.last)
        advance.last = n

    advance.last = 0
    return mc_values(
        policy,
        tokenizer,
        task,
        sub,
        cfg.mc_k,
        temperature=s["temperature"],
        top_p=s["top_p"],
        max_new_tokens=s["max_new_tokens"],
        progress=advance,
    )


def _prefix_ends(
    c: Chunk, sub: RolloutBatch, rows: list[int], values, vmask, definition: set[str]
) -> list[int | None]:
    """Where the still-right prefix of each of ``rows`` (of chunk ``c``; ``sub`` holds them)
    ends: ``None`` for a right trace; else the segment of the verifier's first wrong line, or
    failing that the segment Monte Carlo blames most. Adds the definitions used to
    ``definition``."""
    seg_r, _ = credit_algebra.redistribute(values.double(), vmask, sub.rewards.double())
    ends: list[int | None] = []
    for j, r in enumerate(rows):
        if float(c.batch.rewards[r]) >= SUCCESS:
            ends.append(None)
            continue
        if c.error_segments[r] is not None:
            ends.append(c.error_segments[r])
            definition.add("before the segment of the verifier's first wrong line")
        else:
            n = len(sub.boundaries[j]) - 1
            ends.append(int(torch.argmin(seg_r[j, :n]).item()))
            definition.add("before the segment Monte Carlo blames most (min r_k)")
    return ends


def _mc_shares(
    sums: dict[str, list[np.ndarray]], subs: list, definition: set[str], reps: int, seed: int
) -> dict[str, Any]:
    """The Monte Carlo figures with their intervals: the mean square step values remove, and
    the still-right prefix's share of tokens and of GRPO's and step credit's blame."""
    f = {k: np.concatenate(v) for k, v in sums.items()}
    removed = ratio_interval(f["step_sq"], f["outcome_sq"], reps=reps, seed=seed)
    removed_grad = ratio_interval(f["step_sq_grad"], f["outcome_sq_grad"], reps=reps, seed=seed)
    # prefix sums are 0 on right traces (no prefix); the denominators count wrong traces only
    wrong_rows = np.concatenate([(sub.rewards.cpu() < SUCCESS).numpy() for sub, *_ in subs])
    only_wrong = lambda x: np.where(wrong_rows, x, 0.0)  # noqa: E731
    pt = ratio_interval(f["prefix_tokens"], only_wrong(f["tokens"]), reps=reps, seed=seed)
    gp = ratio_interval(f["grpo_prefix"], only_wrong(f["grpo_blame"]), reps=reps, seed=seed)
    sp = ratio_interval(f["step_prefix"], only_wrong(f["step_blame"]), reps=reps, seed=seed)
    return {
        "variance_removed": _one_minus(removed),
        "gradient_variance_removed": _one_minus(removed_grad),
        "prefix_definition": "; ".join(sorted(definition)) or "no wrong trace in the subset",
        "prefix_tokens": interval_entry(*pt, 0),
        "grpo_prefix_blame": interval_entry(*gp, 0),
        "step_prefix_blame": interval_entry(*sp, 0),
    }


def _one_minus(interval) -> dict[str, float]:
    """``1 - x`` of a :func:`ratio_interval` result with one label (the bounds swap)."""
    point, lo, hi = interval
    return {"value": float(1 - point[0]), "lo": float(1 - hi[0]), "hi": float(1 - lo[0])}


def _select(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """``batch.select(rows)`` with ``prefix_ids`` cut to the selected rows' own segment count
    (the value head checks that they match the boundaries)."""
    sub = batch.select(rows)
    if sub.prefix_ids is None:
        return sub
    width = max((len(b) for b in sub.boundaries), default=1)
    return sub.replace(prefix_ids=sub.prefix_ids[:, :width])


def estimator_specs(cfg: DiagnoseConfig) -> list[tuple[str, str, CreditConfig]]:
    """``(name, credit method, CreditConfig)`` of every estimator the flags ask for, uniform
    first; a run that is not a value_head run or a bad process-reward setting is refused here,
    before any sampling."""
    wanted: list[tuple[str, str, CreditConfig]] = [("uniform", "uniform", CreditConfig())]
    if cfg.value_head_run:
        saved = run_credit_config(cfg.value_head_run)
        if saved is None or saved[0] != "value_head":
            raise UserError(
                f"--value-head-run {cfg.value_head_run}: not a run directory of a value_head run "
                "(its config.yaml names another credit method, or there is none)"
            )
        wanted.append(("value_head", "value_head", saved[1]))
    if cfg.answer_likelihood:
        wanted.append(("answer_likelihood", "answer_likelihood", CreditConfig()))
    if cfg.process_reward_function or cfg.process_reward_model:
        pr = {
            "function": cfg.process_reward_function or "",
            "model": cfg.process_reward_model or "",
        }
        wanted.append(
            ("process_reward", "process_reward", from_dict(CreditConfig, {"process_reward": pr}))
        )
    return wanted


def _estimators(policy, tokenizer, task, subs, segmenter, wanted, cfg: DiagnoseConfig, s, log):
    """Section 4: each cheap estimator asked for, scored against the Monte Carlo values with the
    credit benchmark's definitions (:mod:`rredcot.explain.scores`, at the comparison lambda 0 and
    blame threshold 0), uniform credit as reference."""
    # Each method runs on the whole groups the subset came from (its group statistics, anchors
    # and hand-over see every sample of a prompt, as in training); the subset's rows are then
    # scored against the Monte Carlo values. One batch per group: a real model's forward over a
    # whole chunk runs out of memory.
    traces = Traces.of([sub for sub, *_ in subs])
    groups, picked, offset = [], [], 0
    for _, _, _, batch, rows in subs:
        ids = batch.group_ids.cpu()
        for g in sorted({int(ids[r]) for r in rows}):
            members = (ids == g).nonzero().flatten().tolist()
            groups.append(_select(batch, members))
            picked += [offset + members.index(r) for r in rows if int(ids[r]) == g]
            offset += len(members)
    full = Traces.of(groups)
    adv_rows, value_rows = [], []
    for sub, v, m, _, _ in subs:
        adv, seg_mask, _ = credit_algebra.segment_advantages_from_values(
            v.double(), m, sub.rewards.double().to(v.device), 0.0
        )
        adv_rows += masked_rows(adv, seg_mask)
        value_rows += [r[:-1] for r in masked_rows(v, m)]
    gt = GroundTruth(adv_rows, value_rows, [(v, m) for _, v, m, _, _ in subs], {}, 0.0)
    sampling = SamplingConfig(
        num_generations=cfg.samples,
        temperature=s["temperature"],
        top_p=s["top_p"],
        max_new_tokens=s["max_new_tokens"],
    )
    device = next(policy.parameters()).device
    rows = []
    for name, method_name, credit_cfg in wanted:
        credit_cfg = dataclasses.replace(credit_cfg, segmenter=segmenter.strategy)
        ctx = CreditContext(
            policy=policy,
            tokenizer=tokenizer,
            task=task,
            segmenter=segmenter,
            sampling=sampling,
            device=device,
        )
        method = build_credit(method_name, credit_cfg, ctx)
        if name == "value_head":
            load_method_state(method, cfg.value_head_run)
        col = evaluate_method(
            method, policy, full, temperature=s["temperature"], lam=0.0, device=device
        )
        col.adv = [col.adv[i] for i in picked]
        col.values = None if col.values is None else [col.values[i] for i in picked]
        scores = method_scores(col, gt, traces, blame_threshold=0.0)
        # the cost columns are a cost benchmark's (`rredcot bench credit`); here they would count
        # the whole groups the methods ran on against the subset's traces
        row = {"method": name, **{k: v for k, v in scores.items() if not k.endswith("_per_trace")}}
        rows.append(row)
        log(f"  {name}: rho {row['spearman_pooled']:.3f}, error_acc {row.get('error_acc')}")
    return rows


def _settings(task: Task, cfg: DiagnoseConfig, sampling: SamplingConfig | None) -> dict:
    """Sampling settings: the config's, else the run's, else the defaults."""
    run = sampling or SamplingConfig()
    temperature = cfg.temperature if cfg.temperature is not None else run.temperature
    top_p = cfg.top_p if cfg.top_p is not None else run.top_p
    max_new = cfg.max_new_tokens or run.max_new_tokens or task.suggested_max_new_tokens() or 64
    return {"temperature": temperature, "top_p": top_p, "max_new_tokens": int(max_new)}


def refuse_lengths(task: Task, cfg: DiagnoseConfig, s: dict, limit: int | None) -> None:
    """Refuse, before any prompt is made (a task sized past the model took minutes to make
    its prompts), a completion length ``s["max_new_tokens"]`` that leaves no room for a prompt
    in the policy's ``limit`` positions, or prompts x samples rows of it beyond memory."""
    max_new = s["max_new_tokens"]
    if limit is not None and max_new >= limit:
        raise UserError(
            f"task {task.name}{_changed_params(task)} asks for {max_new:,} new tokens, no room "
            f"for a prompt in the policy's {limit:,} positions; size the task down (e.g. "
            "--task.num_steps), give a smaller --max-new-tokens, or a model with a longer context"
        )
    refuse_beyond_memory(
        f"--prompts {cfg.prompts} x --samples {cfg.samples}",
        cfg.prompts * cfg.samples,
        max_new,
        "lower them",
    )


def _task_params(task: Task) -> dict[str, Any]:
    """The task's parameters as a dict (none where they are not a dataclass)."""
    return dataclasses.asdict(task.params) if dataclasses.is_dataclass(task.params) else {}


def _changed_params(task: Task) -> str:
    """`` (name=value, ...)``: the task's parameters that differ from their defaults."""
    params = task.params
    if not dataclasses.is_dataclass(params):
        return ""
    changed = [
        f"{f.name}={brief(getattr(params, f.name), 40)}"
        for f in dataclasses.fields(params)
        if f.default is not dataclasses.MISSING and getattr(params, f.name) != f.default
    ]
    return f" ({', '.join(changed)})" if changed else ""


def saved_context_limit(model_dir: Path) -> int | None:
    """The positions of the model saved in ``model_dir`` (its config's
    max_position_embeddings), read without loading it; None where it is not a local model."""
    if not (Path(model_dir) / "config.json").is_file():
        return None
    return getattr(AutoConfig.from_pretrained(str(model_dir)), "max_position_embeddings", None)


def diagnose(
    policy,
    tokenizer,
    task: Task,
    config: DiagnoseConfig | None = None,
    *,
    sampling: SamplingConfig | None = None,
    credit: CreditConfig | None = None,
    source: str = "",
    log=print,
) -> DiagnoseReport:
    """Will finer credit help this policy on this task? Sample, measure, and say (module doc).

    Args:
        policy, tokenizer: a causal LM (``rredcot.models.load_policy``) and its tokenizer.
        task: a :class:`~rredcot.tasks.base.Task` (``rredcot.tasks.get_task``).
        config: what to sample and measure (:class:`DiagnoseConfig`; its ``policy``, ``task``,
            ``out``, ``device`` and ``threads`` are the CLI's and are not read here).
        sampling: a run's sampling settings (temperature, top-p, length) where the config leaves
            them unset.
        credit: a run's credit settings (its segmenter); the answer line is always its own
            segment here.
        source: where the policy came from (for the report).

    Returns a :class:`DiagnoseReport`. Deterministic for a seed on the CPU.
    """
    cfg = config or DiagnoseConfig()
    t_start = time.perf_counter()
    s = _settings(task, cfg, sampling)
    refuse_lengths(task, cfg, s, context_limit(policy))
    credit_cfg = dataclasses.replace(credit or CreditConfig(), separate_answer=True)
    if cfg.segmenter:
        credit_cfg = dataclasses.replace(credit_cfg, segmenter=cfg.segmenter)
    segmenter = segmenter_from_config(credit_cfg, task.answer_line_pattern)
    problems = task.eval_problems(cfg.prompts, seed=cfg.seed)
    if not problems:
        raise UserError(f"task {task.name!r} gave no evaluation problems; check its data")
    sizes = cfg.group_size_list()
    wanted = estimator_specs(cfg)  # bad estimator flags are refused before any sampling
    policy.eval()
    log(
        f"diagnose: {len(problems)} prompts x {cfg.samples} samples of {task.name} at temperature "
        f"{s['temperature']:g}, {s['max_new_tokens']} new tokens, segmenter {segmenter.strategy}"
    )
    m = _measure(policy, tokenizer, task, problems, segmenter, wanted, sizes, cfg, s, log)
    headline = _run_headline(m, cfg, policy, tokenizer, task, problems)
    head, reasons = verdict(headline)
    settings = {
        "policy": source or getattr(getattr(policy, "config", None), "_name_or_path", ""),
        "task": task.name,
        "task_params": _task_params(task),
        "prompts": len(problems),
        "samples": cfg.samples,
        "group_sizes": sizes,
        **s,
        "segmenter": segmenter.strategy,
        "uncertain_p": cfg.uncertain_p,
        "position_bins": cfg.position_bins,
        "mc_traces": cfg.mc_traces,
        "mc_k": cfg.mc_k,
        "bootstrap": cfg.bootstrap,
        "confidence": CONFIDENCE,
        "seed": cfg.seed,
        "traces": m.traces,
        "mean_reward": m.groups["mean_reward"],
        "sample_seconds": m.sample_seconds,
        "seconds": time.perf_counter() - t_start,
    }
    return DiagnoseReport(
        settings=settings,
        groups=m.groups,
        gradient=m.gradient,
        trace=m.trace,
        monte_carlo=m.monte_carlo,
        estimators=m.estimators,
        verdict=head,
        reasons=reasons,
        headline=headline,
    )


def _run_headline(m, cfg: DiagnoseConfig, policy, tokenizer, task: Task, problems) -> dict:
    """The verdict's figures, and what its recommendations were measured on: the task, the
    policy's kind (``credit_choice.policy_figures``) and whether it has reference solutions."""
    headline = {**_headline(m, cfg.uncertain_p), **policy_figures(policy, tokenizer)}
    headline["task"] = task.name
    headline["has_references"] = all(task.gold_completion(p) is not None for p in problems)
    return headline


@dataclass
class _Measured:
    """The four sections of a report (:func:`_measure`), and what sampling took."""

    groups: dict[str, Any]
    gradient: dict[str, Any]
    trace: dict[str, Any]
    monte_carlo: dict[str, Any] | None
    estimators: list[dict[str, Any]] | None
    traces: int  # rows sampled (skipped samples left out)
    sample_seconds: float


def _measure(
    policy, tokenizer, task, problems, segmenter, wanted, sizes, cfg: DiagnoseConfig, s, log
) -> _Measured:
    """Sample, verify, segment and score every prompt's group, then measure each section
    (``sizes``: the group sizes of section 1; ``wanted``: :func:`estimator_specs`)."""
    t0 = time.perf_counter()
    chunks = _sample_chunks(policy, tokenizer, task, problems, segmenter, cfg, s, log)
    sample_seconds = time.perf_counter() - t0
    num_units = len(problems)
    rewards = torch.cat([c.batch.rewards.cpu() for c in chunks])
    units = torch.cat([c.units for c in chunks])
    generated = float(sum(c.batch.response_mask.sum() for c in chunks))
    rate = generated / sample_seconds if sample_seconds > 0 else None

    # 1. where GRPO is blind
    groups = {
        "by_group_size": agreement_by_group_size(rewards, units, sizes, cfg.bootstrap, cfg.seed),
        "mean_reward": float(rewards.mean()) if len(rewards) else float("nan"),
    }
    # 2. where its update lands
    gradient = gradient_figures(chunks, cfg, num_units)
    trace = trace_figures(chunks, cfg, num_units)
    # 3. what better credit could change
    monte_carlo, subs = None, []
    if cfg.mc_traces > 0:
        monte_carlo, subs = _monte_carlo(policy, tokenizer, task, chunks, cfg, s, rate, log)
    # 4. the cheap estimators against it
    estimators = None
    if subs:
        estimators = _estimators(policy, tokenizer, task, subs, segmenter, wanted, cfg, s, log)
    return _Measured(
        groups, gradient, trace, monte_carlo, estimators, int(len(rewards)), sample_seconds
    )


def _headline(m: _Measured, uncertain_p: float) -> dict[str, Any]:
    """The figures :func:`verdict` reads. GRPO's share on the still-right prefix comes from the
    step labels where the verifier gives them, else from the Monte Carlo subset."""
    at_g = m.groups["by_group_size"][-1]
    wrong_kinds = m.gradient["wrong_kinds"]
    labelled = m.gradient["labelled_wrong_traces"] > 0
    prefix_share = wrong_kinds["correct_prefix"]["mass"]["value"] if labelled else None
    prefix_tokens = wrong_kinds["correct_prefix"]["tokens"]["value"] if labelled else None
    monte_carlo = m.monte_carlo
    if not labelled and monte_carlo and monte_carlo["wrong_traces"]:
        prefix_share = monte_carlo["grpo_prefix_blame"]["value"]
        prefix_tokens = monte_carlo["prefix_tokens"]["value"]
    return {
        "mean_reward": m.groups["mean_reward"],
        "all_wrong": at_g["all_wrong"],
        "all_right": at_g["all_right"],
        "agree": at_g["agree"],
        "prefix_share": prefix_share,
        "prefix_tokens": prefix_tokens,
        "error_share": wrong_kinds["first_error"]["mass"]["value"] if labelled else None,
        "uncertain_per_trace": m.trace["uncertain_per_trace"]["value"],
        "uncertain_p": uncertain_p,
        "variance_removed": monte_carlo["gradient_variance_removed"]["value"]
        if monte_carlo
        else None,
    }


def diagnose_source(cfg: DiagnoseConfig, log=print) -> DiagnoseReport:
    """:func:`diagnose` on the policy ``cfg.policy`` names (a model, checkpoint or run directory,
    a .gguf file, a hub id or a shipped alias; empty: `rredcot train`'s default for the task),
    with a run directory's sampling and credit settings where ``cfg`` leaves them unset."""
    device = resolve_device(cfg.device)  # a device the machine lacks is refused first
    estimator_specs(cfg)  # and bad estimator flags, before the policy loads
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    source = cfg.policy
    if not source:
        task0 = get_task(cfg.task or "arithmetic", **cfg.task_args)
        read_task_data(task0)  # a bad data file is refused before a model is built
        source = default_policy_source(task0, None, log=log)
    local = Path(source).expanduser()
    try:
        resolved = resolve_checkpoint(source)
    except FileNotFoundError:
        if local.exists() or source.startswith((".", "/", "~")):
            raise
        resolved = ResolvedCheckpoint(Path(source), None, None)  # a hub id
    task = choose_task(resolved, cfg.task, cfg.task_args)
    read_task_data(task)
    saved = run_credit_config(resolved.run_dir)
    credit_cfg, sampling = (saved[1], saved[2]) if saved else (None, None)
    refuse_lengths(
        task, cfg, _settings(task, cfg, sampling), saved_context_limit(resolved.policy_dir)
    )
    policy, tokenizer = load_policy(str(resolved.policy_dir))
    policy.to(device)
    return diagnose(
        policy,
        tokenizer,
        task,
        cfg,
        sampling=sampling,
        credit=credit_cfg,
        source=str(source),
        log=log,
    )

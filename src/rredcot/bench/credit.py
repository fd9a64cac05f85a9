"""``rredcot bench credit``: how good is each method's credit on a frozen policy? (docs/method.md, s. 6)

Read top to bottom:

1. Sample ``N`` prompts x ``G`` completions from the frozen policy (held-out problems,
   ``task.eval_problems(N, seed)``), verify and segment them. With several segmenters the *same*
   traces are re-segmented, so segmenters are compared on identical text.
2. Ground truth: ``V_MC(s_k)`` = mean reward of ``K`` (default 32) Monte Carlo continuations from
   every boundary (:func:`rredcot.methods.monte_carlo.mc_values`), and ground-truth segment
   advantages ``A*_k`` from them through :func:`rredcot.algebra.credit.segment_advantages_from_values`
   at the comparison lambda ``lam`` (default 0, so ``A*_k = r_k = V_MC(s_k) - V_MC(s_{k-1})``,
   ``V(s_n) := R``).
3. Every method (and named variant) computes its credit on the same batches exactly as the trainer
   would (one ``fill_forward`` with the hidden layers it needs, then ``compute``). Its segment
   advantages for the comparison are taken at the *same* ``lam`` for every method: from its values
   ``CreditOutput.values`` when it has them (so the value head's hand-over blend with uniform credit
   is not applied: the estimator is judged, not the schedule), else by segment GAE over its segment
   credit (attribution methods: ``r_k = w_k (R - mean R)``). Under ``lam = 0`` uniform credit (a
   constant value) puts all of ``R - mean R`` on the last segment; under ``lam = 1`` it is GRPO.
4. Learned methods (the value head) are first fitted on ``--value-fit-batches`` *separate* batches
   sampled from the same frozen policy on training problems (fresh traces, never the evaluated
   ones), each batch scored before the head trains on it, as in RL (``ValueHeadCredit.pretrain``);
   or their state is loaded from a training run (``--run``). A value head with a teacher
   (``value_head.teacher``) learns from the teacher on its fit batches and is scored on its own
   values (teacher paused): the head's agreement as it trains is this row at several
   ``--value-fit-batches``; the teacher's own is its method's row (``cl_cheap``).

Metrics per (method, segmenter):

- ``spearman_pooled``: Spearman rho (average ranks for ties) between the method's and the ground
  truth's segment advantages, pooled over all segments of all traces (it rewards ranking traces
  as well as segments within a trace).
- ``spearman_trace_mean``: mean per-trace rho over traces with >= 2 segments whose ground truth is
  not constant; a method constant on such a trace scores 0 there (it ranks nothing).
- ``sign_agreement``: over segments whose ground-truth advantage is non-zero, the share where the
  method's advantage has the same sign (a zero advantage counts one half).
- ``value_mse`` and ``value_ece``: the method's ``V(s_k)``, ``k < n``, against ``V_MC(s_k)``; ECE
  bins the predictions into 10 equal-width bins and averages ``|mean V - mean V_MC|`` weighted by
  bin counts. Only for methods with values.
- ``error_acc``, ``correct_acc``, ``f1`` (:mod:`rredcot.algebra.localisation`, threshold
  ``--blame-threshold`` on the comparison advantages) on tasks whose verifier reports the first
  wrong step; ``chance_error_acc`` is the expected error_acc of random blame.
- Cost per trace: ``extra_forward_tokens``, ``extra_generated_tokens`` (from the method's
  ``credit/extra_*`` metrics), ``seconds_per_trace`` = (the shared no-grad forward + the method's
  ``compute``) / traces and ``credit_seconds_per_trace`` (``compute`` alone);
  ``time_ratio_to_uniform`` divides ``seconds_per_trace`` by uniform's in the same run
  (``timed_in``): a run that scores any method times uniform again, and a row kept from an
  earlier run keeps that run's time and ratio.

A ``ground_truth`` row scores the ``K``-rollout values themselves on localisation (the ceiling a
value-based method can reach with these traces).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from rredcot.algebra import credit as credit_algebra
from rredcot.bench.configs import CreditBenchConfig
from rredcot.bench.report import fmt, markdown_table, write_report
from rredcot.bench.variants import Variant, dir_name, parse_variants
from rredcot.config import SamplingConfig
from rredcot.explain.model import (
    choose_task,
    load_method_state,
    read_method_state,
    resolve_checkpoint,
    run_credit_config,
    segment_credits,
)
from rredcot.explain.pictures import SegmentCredit, render_html
from rredcot.explain.scores import (
    GroundTruth,
    Traces,
    comparison_advantages,
    evaluate_method,
    masked_rows,
    method_scores,
)
from rredcot.machine import resolve_device
from rredcot.methods.base import CreditContext, build_credit
from rredcot.methods.monte_carlo import mc_values
from rredcot.models import load_policy
from rredcot.safe_fs import MAX_CONFIG_BYTES, read_json_file, write_text_atomic
from rredcot.sampling.batch import RolloutBatch
from rredcot.sampling.forward import fill_forward, policy_forward
from rredcot.sampling.rollout import build_rollout_batch, segment_batch
from rredcot.segment import Segmenter, get_segmenter, segmenter_from_config

# ---------------------------------------------------------------------------------------------
# batches


def resegment(
    batch: RolloutBatch, tokenizer, segmenter, policy=None, temperature: float = 1.0
) -> RolloutBatch:
    """The same traces cut by another segmenter (:func:`rredcot.sampling.rollout.segment_batch`, the one
    segmentation entry point: boundaries, segment ids, segment starts and shared-prefix ids);
    hidden states are dropped, the next ``fill_forward`` recomputes them. The entropy strategies
    read the ``policy``'s next-token entropies at the sampling ``temperature`` (one no-grad
    forward, as the trainer reads them from its loss forward)."""
    entropies = None
    if segmenter.uses_entropy:
        if policy is None:
            raise ValueError(f"segmenter {segmenter.strategy!r} needs the policy's entropies")
        with torch.no_grad():
            entropies = policy_forward(
                policy,
                batch.input_ids,
                batch.attention_mask,
                batch.prompt_len,
                with_entropy=True,
                temperature=temperature,
            ).entropy
    cut = segment_batch(batch, tokenizer, segmenter, entropies)
    return cut.replace(old_logprobs=None, hidden_states=None)


@contextlib.contextmanager
def _attention_for(policy, method: str):
    """Eager attention while the ``attention`` method runs (the one kernel that returns weights,
    as the trainer loads it for that method); the policy's own kernel for every other method."""
    before = getattr(policy.config, "_attn_implementation", None)
    switch = method == "attention" and before != "eager"
    if switch:
        policy.set_attn_implementation("eager")
    try:
        yield
    finally:
        if switch:
            policy.set_attn_implementation(before)


# ---------------------------------------------------------------------------------------------
# the benchmark


def _head_only(method):
    """A value head with a teacher is scored on its own values (the teacher is a variant of its
    own: ``cl_cheap``); anything else as it is."""
    if getattr(method, "teacher", None) is None:
        return contextlib.nullcontext()
    return method.teacher_paused()


def _method_context(policy, tokenizer, task, segmenter, cfg: CreditBenchConfig, device):
    sampling = SamplingConfig(
        num_generations=cfg.samples,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
    )
    return CreditContext(
        policy=policy,
        tokenizer=tokenizer,
        task=task,
        segmenter=segmenter,
        sampling=sampling,
        device=device,
    )


def ground_truth(
    policy, tokenizer, task, traces: Traces, cfg: CreditBenchConfig, device: torch.device
) -> GroundTruth:
    """The values every method is compared with, and their advantages at ``cfg.lam``:
    ``V_MC`` from ``cfg.mc_k`` rollouts a boundary, or the oracle's first-error values."""
    if cfg.ground_truth == "oracle":
        return oracle_truth(policy, tokenizer, task, traces, cfg, device)
    return monte_carlo_truth(policy, tokenizer, task, traces, cfg)


def monte_carlo_truth(policy, tokenizer, task, traces: Traces, cfg) -> GroundTruth:
    """``V_MC`` from ``cfg.mc_k`` rollouts per boundary and the advantages at ``cfg.lam``."""
    t0 = time.perf_counter()
    gt = GroundTruth([], [], [], {}, 0.0, label=f"V_MC, K = {cfg.mc_k}")
    for c, b in enumerate(traces.batches):
        bar = tqdm(
            desc=f"ground truth {c + 1}/{len(traces.batches)}",
            unit="prefix",
            dynamic_ncols=True,
            leave=False,
        )

        def advance(done: int, total: int, bar=bar) -> None:
            bar.total = total
            bar.update(done - bar.n)

        v, m, st = mc_values(
            policy,
            tokenizer,
            task,
            b,
            cfg.mc_k,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            progress=advance,
        )
        bar.close()
        adv, seg_mask, _ = credit_algebra.segment_advantages_from_values(
            v.double(), m, b.rewards.double().to(v.device), cfg.lam
        )
        gt.adv += masked_rows(adv, seg_mask)
        gt.values += [r[:-1] for r in masked_rows(v, m)]  # drop s_n (it is R)
        gt.full.append((v, m))
        for k, x in st.items():
            gt.stats[k] = gt.stats.get(k, 0.0) + x
    gt.seconds = time.perf_counter() - t0
    return gt


def _oracle_credit_config(overrides: dict[str, str]):
    """The oracle's credit settings under ``--set`` (its ``credit.oracle.*`` among them)."""
    return Variant("oracle", "oracle").credit_config(overrides)


def oracle_truth(policy, tokenizer, task, traces: Traces, cfg, device) -> GroundTruth:
    """The oracle method's values (the verifier's first-wrong-line labels, its
    ``credit.oracle.*`` settings from ``--set``) and their advantages at ``cfg.lam``. Only the
    traces whose every boundary has a value are kept (``GroundTruth.keep``): a trace the labels
    cannot judge would get GRPO's credit, which is no truth."""
    t0 = time.perf_counter()
    credit_cfg = _oracle_credit_config(cfg.overrides)
    ctx = CreditContext(policy=policy, tokenizer=tokenizer, task=task, device=device)
    oracle = build_credit("oracle", credit_cfg, ctx)
    label = f"oracle, {credit_cfg.oracle.values} values"
    gt = GroundTruth([], [], [], {}, 0.0, label=label, keep=[])
    for b in traces.batches:
        rows = oracle.rows(b)  # a label-less row's boundaries are NaN here, before the estimate
        unknown = rows.values.isnan() & rows.value_mask  # hands them GRPO's credit
        gt.keep += (~unknown.any(dim=1)).tolist()
        out = oracle.credit_output(rows, oracle.estimate(rows), b.segment_ids, b.response_mask)
        v, m = out.values, out.value_mask.bool()
        adv = comparison_advantages(out, b.rewards, cfg.lam, oracle, b)
        gt.adv += masked_rows(adv, out.segment_mask.bool())
        gt.values += [r[:-1] for r in masked_rows(v, m)]  # drop s_n (it is R)
        gt.full.append((v, m))
        for k, x in out.metrics.items():
            if k.startswith("credit/extra_"):
                gt.stats[k] = gt.stats.get(k, 0.0) + float(x)
    if not any(gt.keep):
        raise ValueError(
            f"--ground_truth oracle: none of the {traces.size} traces has step labels (task "
            f"{task.name!r} reports no first wrong step for them, or every trace was cut by the "
            "token cap); use a task with step labels (arithmetic, word_problems, gsm8k_steps), "
            "a larger --max_new_tokens, or --ground_truth monte_carlo"
        )
    gt.stats["judged_traces"] = float(sum(gt.keep))
    gt.seconds = time.perf_counter() - t0
    return gt


def fit_method(method, name: str, fit_batches, saved_run, cfg, policy, tokenizer, segmenter, log):
    """Make a learned method meaningful on the frozen policy: load it from ``--run`` or fit it
    on the fresh ``fit_batches`` (each scored before the head trains on it). Returns a summary."""
    if not method.state_dict():
        return {}
    if saved_run is not None and saved_run[0] == method.name:
        return {"loaded_from": str(load_method_state(method, cfg.run))}
    if method.learns and fit_batches:
        layers = method.hidden_layers if method.needs_hidden_states else None
        queue = iter(fit_batches)

        def next_batch() -> RolloutBatch:  # one scoring pass: entropies for the cuts, features
            b = fill_forward(
                policy,
                next(queue),
                hidden_layers=layers,
                temperature=cfg.temperature,
                with_entropy=segmenter.uses_entropy,
            )
            return segment_batch(b, tokenizer, segmenter, b.entropies)

        t0 = time.perf_counter()
        fit = method.pretrain(next_batch, len(fit_batches))
        fit["seconds"] = time.perf_counter() - t0
        return fit
    log(f"warning: {name} is untrained (--value-fit-batches 0 and no --run)")
    return {"warning": "untrained: no fit batches and no --run"}


@dataclass
class _Bench:
    """What every stage of one credit benchmark shares: its settings and the frozen policy."""

    cfg: CreditBenchConfig
    policy: Any
    tokenizer: Any
    task: Any
    device: torch.device
    sampling_segmenter: Segmenter  # the first strategy; the traces are re-segmented per strategy
    saved_run: tuple | None  # run_credit_config(cfg.run): a trained method's state to load
    log: Callable[..., Any]
    started: str  # when this bench run started (UTC, ISO): the `timed_in` stamp of its rows

    def sample(self, problems: list, seed: int) -> list[RolloutBatch]:
        """``cfg.samples`` completions of each problem, in chunks of ``cfg.chunk_prompts``
        prompts, chunk ``i`` sampled under seed ``seed + i``."""
        cfg = self.cfg
        batches = []
        for i in range(0, len(problems), cfg.chunk_prompts):
            torch.manual_seed(seed + i)
            batch, _ = build_rollout_batch(
                self.policy,
                self.tokenizer,
                self.task,
                problems[i : i + cfg.chunk_prompts],
                self.sampling_segmenter,
                num_generations=cfg.samples,
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
            )
            batches.append(batch)
        return batches


ROWS = "credit_rows.json"  # every row scored on these traces, kept for a later run to reuse


def traces_fingerprint(cfg: CreditBenchConfig, sampled: list[RolloutBatch]) -> str:
    """What a scored row depends on besides its own variant: every setting but the output
    directory and the lists of methods and segmenters, and the sampled traces themselves (their
    tokens and rewards), so that a row is reused only for the very same traces."""
    settings = {
        k: v
        for k, v in dataclasses.asdict(cfg).items()
        if k not in ("out", "methods", "segmenters")
    }
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for b in sampled:
        h.update(b.input_ids.cpu().numpy().tobytes())
        h.update(b.rewards.cpu().double().numpy().tobytes())
    return h.hexdigest()


class ScoredRows:
    """The rows scored on a run's traces, kept in ``out/credit_rows.json`` (rewritten atomically
    after every method), so that a stopped run started again with the same command, or a later
    run with more methods, samples its traces again (the same seed gives the same traces),
    checks that they are the same, and scores only the methods not yet scored. Rows of other
    traces or settings are dropped."""

    def __init__(self, out_dir: Path, fingerprint: str, log) -> None:
        self.path = out_dir / ROWS
        self.fingerprint = fingerprint
        self.rows: dict[str, dict[str, Any]] = {}
        if not (self.path.exists() or self.path.is_symlink()):
            return
        saved = read_json_file(self.path, "kept credit rows", follow=False, limit=MAX_CONFIG_BYTES)
        if not isinstance(saved, dict) or saved.get("fingerprint") != fingerprint:
            log(f"{self.path}: rows of other traces or settings; scoring every method again")
            return
        self.rows = dict(saved.get("rows", {}))
        if self.rows:
            log(f"{self.path}: reusing {len(self.rows)} row(s) scored on these traces")

    @staticmethod
    def key(seg_name: str, variant: Variant) -> str:
        overrides = json.dumps(variant.overrides, sort_keys=True)
        return f"{seg_name}|{variant.name}|{variant.method}|{overrides}"

    def has(self, seg_name: str, variant: Variant) -> bool:
        return self.key(seg_name, variant) in self.rows

    def get(self, seg_name: str, variant: Variant) -> tuple[dict, dict[int, list]] | None:
        saved = self.rows.get(self.key(seg_name, variant))
        if saved is None:
            return None
        examples = {
            int(i): [SegmentCredit(**s) for s in segs] for i, segs in saved["examples"].items()
        }
        return saved["row"], examples

    def put(self, seg_name: str, variant: Variant, row: dict, examples: dict[int, list]) -> None:
        self.rows[self.key(seg_name, variant)] = {
            "row": row,
            "examples": {
                str(i): [dataclasses.asdict(s) for s in segs] for i, segs in examples.items()
            },
        }
        text = json.dumps({"fingerprint": self.fingerprint, "rows": self.rows})
        write_text_atomic(self.path, text)


def _variants_and_segmenters(cfg: CreditBenchConfig) -> tuple[list[Variant], list[str]]:
    """The variants to score (uniform first when not named) and the segmentation strategies."""
    variants = parse_variants(cfg.methods)
    if "uniform" not in [v.name for v in variants]:
        variants.insert(0, Variant("uniform", "uniform"))
    segmenter_names = [s.strip() for s in cfg.segmenters.split(",") if s.strip()]
    if not segmenter_names:
        raise ValueError("--segmenter: give at least one segmentation strategy")
    return variants, segmenter_names


def _fit_batches(bench: _Bench, variants: list[Variant]) -> list[RolloutBatch]:
    """Fresh traces on training problems (never the evaluated ones) to fit the learned methods
    on; none when no variant learns or every learned one is loaded from ``--run``."""
    cfg = bench.cfg
    # any segmenter: this context only asks each method whether it has state to fit, and
    # continuation_likelihood cannot be built without one
    newline = get_segmenter("newline")
    ctx0 = _method_context(bench.policy, bench.tokenizer, bench.task, newline, cfg, bench.device)
    needs_fit = any(
        build_credit(v.method, v.credit_config(cfg.overrides), ctx0).state_dict()
        and (bench.saved_run is None or bench.saved_run[0] != v.method)
        for v in variants
    )
    fit_batches: list[RolloutBatch] = []
    if needs_fit and cfg.value_fit_batches > 0:
        fit_problems = bench.task.train_problems(
            cfg.value_fit_batches * cfg.value_fit_prompts, seed=cfg.seed + 1
        )
        for i in range(cfg.value_fit_batches):
            chunk = fit_problems[i * cfg.value_fit_prompts : (i + 1) * cfg.value_fit_prompts]
            if chunk:
                fit_batches += bench.sample(chunk, cfg.seed + 100_000 + 1_000 * i)
    return fit_batches


def _truth_name(cfg: CreditBenchConfig) -> str:
    return f"K={cfg.mc_k}" if cfg.ground_truth == "monte_carlo" else "oracle (step labels)"


def _ground_truth_summary(gt: GroundTruth, traces: Traces, cfg: CreditBenchConfig) -> dict:
    """The report's ``ground_truth`` entry of one segmentation: settings, time and cost."""
    return {
        "ground_truth": gt.label,
        **({"k": cfg.mc_k} if cfg.ground_truth == "monte_carlo" else {}),
        "lam": cfg.lam,
        "seconds": gt.seconds,
        "segments_per_trace": sum(len(r) for r in gt.adv) / max(traces.size, 1),
        **{k.replace("credit/", ""): x for k, x in gt.stats.items()},
    }


def _ground_truth_row(
    gt: GroundTruth, traces: Traces, cfg: CreditBenchConfig, seg_name: str
) -> dict[str, Any]:
    """The ``ground_truth`` result row: it agrees with itself, and scores its localisation."""
    judged = traces.select(gt.keep)
    n = max(judged.size, 1)
    return {
        "method": "ground_truth",
        "base_method": gt.label,
        "segmenter": seg_name,
        "num_traces": judged.size,
        "num_segments": sum(len(r) for r in gt.kept(gt.adv)),
        "spearman_pooled": 1.0,
        "spearman_trace_mean": 1.0,
        "sign_agreement": 1.0,
        "extra_generated_tokens_per_trace": gt.stats.get("credit/extra_generated_tokens", 0) / n,
        "extra_forward_tokens_per_trace": gt.stats.get("credit/extra_forward_tokens", 0) / n,
        **judged.localisation(gt.kept(gt.adv), cfg.blame_threshold),
    }


def _ground_truth_pages(
    gt: GroundTruth, traces: Traces, examples: list[int], cfg: CreditBenchConfig
) -> dict[int, list]:
    """Per example trace, its entries of the example page, starting with the ground truth's."""
    pages: dict[int, list] = {i: [] for i in examples}
    for i in examples:
        c, r = traces.locate(i)
        b, (v, m) = traces.batches[c], gt.full[c]
        adv, _, _ = credit_algebra.segment_advantages_from_values(
            v.double(), m, b.rewards.double().to(v.device), cfg.lam
        )
        pages[i].append((f"ground truth {gt.label}", segment_credits(b, r, adv, v, m)))
    return pages


def _method_row(
    bench: _Bench,
    variant: Variant,
    seg_name: str,
    segmenter: Segmenter,
    traces: Traces,
    gt: GroundTruth,
    fit_batches: list[RolloutBatch],
    examples: list[int],
) -> tuple[dict[str, Any], dict[int, list]]:
    """Build, fit and evaluate one variant on one segmentation: its result row and its entries
    of the example pages."""
    cfg, policy = bench.cfg, bench.policy
    credit_cfg = variant.credit_config(cfg.overrides)
    credit_cfg.segmenter = seg_name
    ctx = _method_context(policy, bench.tokenizer, bench.task, segmenter, cfg, bench.device)
    method = build_credit(variant.method, credit_cfg, ctx)
    fit = fit_method(
        method,
        variant.name,
        fit_batches,
        bench.saved_run,
        cfg,
        policy,
        bench.tokenizer,
        segmenter,
        bench.log,
    )
    with _attention_for(policy, variant.method), _head_only(method):
        col = evaluate_method(
            method,
            policy,
            traces,
            temperature=cfg.temperature,
            lam=cfg.lam,
            device=bench.device,
            example_rows=examples,
        )
    row = {
        "method": variant.name,
        "base_method": variant.method,
        "overrides": variant.overrides,
        "segmenter": seg_name,
        **method_scores(col, gt, traces, cfg.blame_threshold),
        "fit": fit,
    }
    return row, col.examples


def _time_against(row: dict[str, Any], uniform: dict[str, Any], started: str) -> None:
    """Stamp ``row`` with the run that timed it and its ``time_ratio_to_uniform`` against
    ``uniform``'s time in that same run (times of different runs differ with the machine's load)."""
    uniform_s = uniform["seconds_per_trace"]
    row["timed_in"] = started
    row["time_ratio_to_uniform"] = row["seconds_per_trace"] / uniform_s if uniform_s else None


def _score_segmentation(
    bench: _Bench,
    seg_name: str,
    segmenter: Segmenter,
    sampled: list[RolloutBatch],
    variants: list[Variant],
    fit_batches: list[RolloutBatch],
    out_dir: Path,
    scored: ScoredRows,
) -> tuple[list[dict[str, Any]], dict[str, Any], str | None]:
    """The sampled traces cut by ``segmenter``, scored by the ground truth and every variant:
    ``(result rows, the ground truth's summary, the example page's file name or None)``."""
    cfg, policy, tokenizer = bench.cfg, bench.policy, bench.tokenizer
    traces = Traces.of(
        [resegment(b, tokenizer, segmenter, policy, cfg.temperature) for b in sampled]
    )
    # 2. ground truth
    gt = ground_truth(policy, tokenizer, bench.task, traces, cfg, bench.device)
    summary = _ground_truth_summary(gt, traces, cfg)
    bench.log(f"[{seg_name}] ground truth in {gt.seconds:.1f}s")
    examples = traces.example_rows(cfg.examples, [len(r) for r in gt.adv], gt.keep)
    results = [_ground_truth_row(gt, traces, cfg, seg_name)]
    # 3. every method not scored by an earlier run on these traces; uniform, the time
    # reference, is timed again in every run that scores anything
    pages = _ground_truth_pages(gt, traces, examples, cfg)
    uniform = next(v for v in variants if v.name == "uniform")
    fresh = [v for v in variants if not scored.has(seg_name, v)]
    if fresh:
        for b in traces.batches:  # untimed warm-up, so that the first method pays no start-up
            fill_forward(policy, b)  # (result unused)
        fresh = [uniform] + [v for v in fresh if v is not uniform]
    reference: dict[str, Any] = {}
    for variant in fresh:
        row, method_examples = _method_row(
            bench, variant, seg_name, segmenter, traces, gt, fit_batches, examples
        )
        reference = reference or row
        _time_against(row, reference, bench.started)
        scored.put(seg_name, variant, row, method_examples)
    for variant in variants:  # a row of an earlier run keeps the timing and ratio of that run
        row, method_examples = scored.get(seg_name, variant)
        results.append(row)
        for i, segs in method_examples.items():
            pages[i].append((variant.name, segs))
        bench.log(
            f"[{seg_name}] {variant.name}: rho {fmt(row['spearman_pooled'])}, "
            f"sign {fmt(row['sign_agreement'])}, {row['seconds_per_trace'] * 1e3:.2f} ms/trace"
        )
    if not examples:
        return results, summary, None
    page = out_dir / f"examples_{dir_name(seg_name)}.html"
    write_text_atomic(page, render_html(_example_sections(traces, pages)))  # no link followed
    return results, summary, page.name


def run_credit_bench(cfg: CreditBenchConfig, log=print) -> dict[str, Any]:
    """Run the credit-quality benchmark; writes ``credit.json``, ``credit.md`` and example
    pages ``examples_<segmenter>.html`` under ``cfg.out`` and returns the JSON content."""
    variants, segmenter_names = _variants_and_segmenters(cfg)
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    resolved = resolve_checkpoint(cfg.checkpoint)
    task = choose_task(resolved, cfg.task, cfg.task_args)
    saved_run = run_credit_config(cfg.run) if cfg.run else None
    if cfg.run and saved_run is None:
        raise FileNotFoundError(f"--run {cfg.run!r}: no config.yaml there; is it a run directory?")
    if saved_run is not None and any(v.method == saved_run[0] for v in variants):
        read_method_state(cfg.run)  # a cut or refused state stops here, before the ground truth
    if cfg.max_new_tokens is None:
        own = run_credit_config(resolved.run_dir)
        cfg.max_new_tokens = (own[2].max_new_tokens if own else 0) or (
            task.suggested_max_new_tokens() or 64
        )
    device = resolve_device(cfg.device)
    policy, tokenizer = load_policy(str(resolved.policy_dir))
    policy.to(device).eval()
    base_credit = Variant("base", "uniform").credit_config(cfg.overrides)
    log(
        f"credit bench: {cfg.prompts} prompts x {cfg.samples} samples of {task.name}, "
        f"ground truth {_truth_name(cfg)}, methods {', '.join(v.name for v in variants)}"
    )
    pattern = task.answer_line_pattern
    first = segmenter_from_config(base_credit, pattern, segmenter_names[0])
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")
    bench = _Bench(cfg, policy, tokenizer, task, device, first, saved_run, log, started)

    # 1. the evaluated traces, sampled once (re-segmented per segmenter below)
    t0 = time.perf_counter()
    sampled = bench.sample(task.eval_problems(cfg.prompts, seed=cfg.seed), cfg.seed)
    sample_seconds = time.perf_counter() - t0
    rewards = torch.cat([b.rewards.cpu() for b in sampled])
    log(f"sampled {len(rewards)} traces in {sample_seconds:.1f}s, mean reward {rewards.mean():.3f}")
    scored = ScoredRows(out_dir, traces_fingerprint(cfg, sampled), log)
    unscored = [v for s in segmenter_names for v in variants if not scored.has(s, v)]
    fit_batches = _fit_batches(bench, unscored) if unscored else []

    results: list[dict[str, Any]] = []
    gt_summary: dict[str, Any] = {}
    example_pages: dict[str, str] = {}
    for seg_name in segmenter_names:
        segmenter = segmenter_from_config(base_credit, pattern, seg_name)
        rows, gt_summary[seg_name], page = _score_segmentation(
            bench, seg_name, segmenter, sampled, variants, fit_batches, out_dir, scored
        )
        results += rows
        if page is not None:
            example_pages[seg_name] = page

    report = {
        "config": dataclasses.asdict(cfg),
        "policy": str(resolved.policy_dir),
        "task": task.name,
        "task_params": dataclasses.asdict(task.params)
        if dataclasses.is_dataclass(task.params)
        else {},
        "num_traces": len(rewards),
        "mean_reward": float(rewards.mean()) if len(rewards) else float("nan"),
        "sample_seconds": sample_seconds,
        "comparison_lam": cfg.lam,
        "ground_truth": gt_summary,
        "results": results,
        "examples": example_pages,
        "definitions": DEFINITIONS,
    }
    md = write_report(report, out_dir, "credit", credit_markdown)
    log(md)
    return report


def _example_sections(traces: Traces, pages: dict[int, list]) -> list:
    sections = []
    for i, entries in pages.items():
        c, r = traces.locate(i)
        b = traces.batches[c]
        fe = b.verdicts[r].first_error_step
        head = f"trace {i + 1} (R = {float(b.rewards[r]):g}" + (
            f", first wrong line {fe + 1})" if fe is not None and fe >= 0 else ")"
        )
        sections += [(f"{head}: {name}", b.problems[r].prompt, segs) for name, segs in entries]
    return sections


DEFINITIONS = {
    "spearman_pooled": "Spearman rho (average ranks for ties) over all segments of all traces",
    "spearman_trace_mean": "mean per-trace rho over traces with >= 2 segments and a non-constant "
    "ground truth; a constant prediction scores 0",
    "sign_agreement": "share of segments with non-zero ground truth whose advantage has the same "
    "sign (a zero advantage counts 1/2)",
    "value_mse/value_ece": "the method's V(s_k), k < n, against the ground truth's",
    "seconds_per_trace": "(shared no-grad forward + method.compute) / traces",
    "comparison_lam": "every method's segment advantages (and the ground truth's) at this lambda",
}


COLUMNS = [
    ("method", "method", "s"),
    ("segmenter", "segmenter", "s"),
    ("ρ pooled", "spearman_pooled", ".3f"),
    ("ρ per trace", "spearman_trace_mean", ".3f"),
    ("sign agr.", "sign_agreement", ".3f"),
    ("value MSE", "value_mse", ".4f"),
    ("value ECE", "value_ece", ".3f"),
    ("error_acc", "error_acc", ".3f"),
    ("correct_acc", "correct_acc", ".3f"),
    ("F1", "f1", ".3f"),
    ("fwd tok/trace", "extra_forward_tokens_per_trace", ".0f"),
    ("gen tok/trace", "extra_generated_tokens_per_trace", ".0f"),
    ("ms/trace", "seconds_per_trace", ".2f"),
    ("× uniform", "time_ratio_to_uniform", ".2f"),
]


def _truth_text(report: dict[str, Any]) -> str:
    config = report["config"]
    if config.get("ground_truth", "monte_carlo") == "monte_carlo":
        return f"V_MC from {config['mc_k']} Monte Carlo rollouts per boundary"
    judged = {seg: int(s.get("judged_traces", 0)) for seg, s in report["ground_truth"].items()}
    counts = ", ".join(
        f"{n}" + (f" ({seg})" if len(judged) > 1 else "") for seg, n in judged.items()
    )
    return (
        "the oracle's values from the verifier's first-wrong-line labels "
        f"(credit.oracle.values={_oracle_credit_config(config['overrides']).oracle.values}); "
        f"scored over the {counts} traces the labels judge"
    )


def credit_markdown(report: dict[str, Any]) -> str:
    """``credit.md``: the results table, what the columns mean, links to example pages."""
    rows = []
    for r in report["results"]:
        cells = []
        for _, key, spec in COLUMNS:
            value = r.get(key)
            if key == "seconds_per_trace" and value is not None:
                value = value * 1e3
            cells.append(fmt(value, spec) if spec != "s" else str(value))
        rows.append(cells)
    lam = report["comparison_lam"]
    chance = {  # each segmenter cuts its own segments, so random blame has its own score
        r["segmenter"]: r["chance_error_acc"]
        for r in report["results"]
        if r["method"] == "ground_truth" and r.get("chance_error_acc") is not None
    }
    chance_text = ", ".join(
        f"{fmt(x)}" + (f" ({seg})" if len(chance) > 1 else "") for seg, x in chance.items()
    )
    lines = [
        "# Credit quality on a frozen policy",
        "",
        f"Policy `{report['policy']}`, task `{report['task']}`, {report['num_traces']} traces "
        f"(mean reward {fmt(report['mean_reward'])}). Ground truth: {_truth_text(report)}; "
        f"every method's segment advantages are compared at λ = {lam:g}"
        + (" (A_k = r_k = V(s_k) − V(s_{k−1}))" if lam == 0 else "")
        + ".",
        "",
        markdown_table([c[0] for c in COLUMNS], rows),
        "",
        "- ρ pooled: Spearman over all segments of all traces; ρ per trace: mean over traces with "
        "≥ 2 segments and non-constant ground truth (constant credit scores 0).",
        "- sign agr.: share of segments with non-zero ground truth whose credit has its sign.",
        "- value MSE / ECE: the method's V(s_k) against the ground truth's (methods with values "
        "only).",
        "- error_acc / correct_acc / F1: first-error localisation (ProcessBench terms)"
        + (f"; random blame scores error_acc {chance_text}." if chance else "."),
        "- fwd / gen tok: extra forward and generated tokens per trace; ms/trace: shared forward + "
        "credit computation; × uniform: ratio of that time to uniform's.",
    ]
    runs = {r.get("timed_in", "earlier") for r in report["results"] if "seconds_per_trace" in r}
    if len(runs) > 1:
        lines.append(
            f"- The rows were timed in {len(runs)} runs on the same traces (a resumed run; "
            "`timed_in` in credit.json): each row's × uniform is against uniform timed in its own "
            "run, and ms/trace of different runs differ with the machine's load."
        )
    if report.get("examples"):
        lines += ["", "Example traces, segment by segment:"]
        lines += [f"- [{seg}]({page})" for seg, page in report["examples"].items()]
    return "\n".join(lines) + "\n"


def merge_credit_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from runs that scored the same traces with different segmenters (one process
    per segmenter, e.g. on a machine with several cores): the runs must agree on everything but
    ``segmenters`` and ``out``, and have sampled the same traces (count and mean reward)."""
    if not reports:
        raise ValueError("merge_credit_reports: no reports given")
    first = reports[0]

    def settings(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r["config"].items() if k not in ("segmenters", "out")}

    def traces(r: dict[str, Any]) -> tuple:
        return r["num_traces"], r["mean_reward"], r["policy"]

    base = settings(first)
    segmenters: list[str] = []
    for r in reports:
        mine = settings(r)
        differing = sorted(k for k in base.keys() | mine.keys() if mine.get(k) != base.get(k))
        if differing:
            raise ValueError(
                f"credit reports differ in {', '.join(differing)}: only runs of the same command "
                "with other --segmenters can be merged"
            )
        if traces(r) != traces(first):
            raise ValueError(
                "credit reports sampled different traces (trace count, mean reward or policy "
                "differ): run them with the same --seed on the same checkpoint and thread count"
            )
        for seg in r["ground_truth"]:
            if seg in segmenters:
                raise ValueError(f"segmenter {seg!r} is in more than one report")
            segmenters.append(seg)
    merged = dict(first)
    merged["config"] = {**first["config"], "segmenters": ",".join(segmenters)}
    merged["ground_truth"] = {k: v for r in reports for k, v in r["ground_truth"].items()}
    merged["results"] = [row for r in reports for row in r["results"]]
    merged["examples"] = {k: v for r in reports for k, v in r.get("examples", {}).items()}
    merged["sample_seconds"] = max(r["sample_seconds"] for r in reports)
    return merged

"""``rredcot bench learn``: does better credit learn faster? (docs/method.md, measurement protocol)

Every method (or named variant, :mod:`rredcot.bench.variants`) trains from ONE warm-start
checkpoint, with the same prompt stream (the trainer's prompts are a function of (seed, step)) and
the same budget of sampled tokens, for several seeds. The budget counts the policy's rollout tokens
*plus* the tokens a credit method generates on top (Monte Carlo continuations): that is what a run
pays for in generation, so it is the honest comparison of cost (``TrainConfig.max_tokens_generated``
stops the run; both figures are reported).

Each run lives in ``OUT/runs/<variant>/seed<k>/`` (a normal run directory). A run whose
``result.json`` exists is complete and skipped; any other is resumed from its last checkpoint by the
trainer, so a killed bench picks up where it stopped.

Outputs in ``OUT``: ``learn.json``, ``learn.md``, ``accuracy_vs_tokens.png``,
``accuracy_vs_wallclock.png`` (held-out greedy accuracy, mean ± std over seeds, linearly
interpolated onto a common grid up to the shortest run), ``grad_variance.png``.

Policy-gradient variance (``--variance-probes P``): at ``P`` matched points of the token budget
(fractions ``0, 1/(P-1), ..., 1``; the first is the warm-start policy itself, identical for every
method, so there the methods differ only in their credit) a fixed probe batch is scored: the same
``--variance-prompts`` training problems, ``G`` completions each sampled from the current policy
with a fixed seed, the method's advantages computed as in training (without updating the method).
The policy-gradient loss at ratio 1 (``-A log pi``, the run's loss aggregation) is differentiated
separately for each prompt group, giving one flattened gradient ``g_i`` per group. Minibatches of
``--variance-minibatch`` groups are drawn with replacement (``--variance-bootstrap`` draws) and
``grad_var_trace`` is the mean of ``||mean_{i in S} g_i - g_bar||^2`` over the draws: a bootstrap
estimate of the trace of the covariance of a minibatch gradient estimate at a fixed sample count
(in expectation ``(1/m) * (1/N) sum_i ||g_i - g_bar||^2``). ``grad_mean_sqnorm`` is
``||g_bar||^2``. The probe neither consumes the run's random numbers nor counts toward its budget.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from rredcot.algebra.loss import LossSettings, policy_loss
from rredcot.bench.configs import LearnBenchConfig
from rredcot.bench.report import (
    fmt,
    fmt_mean_std,
    interpolate_runs,
    markdown_table,
    mean_std,
    plot_mean_std,
    write_json,
    write_report,
)
from rredcot.bench.stats import interval_estimate, paired_difference, probability_of_improvement
from rredcot.bench.variants import Variant, dir_name, parse_variants
from rredcot.config import TrainConfig
from rredcot.config.io import load_yaml, resolve_config, to_dict
from rredcot.methods.auto import AUTO, CreditChoice, apply_choice
from rredcot.safe_fs import (
    MAX_CONFIG_BYTES,
    loads_json,
    make_dirs,
    open_for_append,
    read_json_file,
    read_regular,
)
from rredcot.sampling.forward import policy_forward
from rredcot.tasks import get_task
from rredcot.training import runio
from rredcot.training.runio import MetricsLog
from rredcot.training.setup import resolve_max_new_tokens
from rredcot.training.sft import default_policy_source
from rredcot.training.trainer import Trainer

PROBE_SEED = 987_654  # problems and sampling of the variance probe batch
RESULT = "result.json"
VARIANCE = "variance.jsonl"


# ---------------------------------------------------------------------------------------------
# policy-gradient variance


def bootstrap_trace_cov(
    grads: torch.Tensor, minibatch: int, draws: int, seed: int = 0
) -> tuple[float, float]:
    """Bootstrap estimate of the trace of the covariance of a minibatch-mean gradient.

    Args:
        grads: ``(N, D)`` one gradient per unit (prompt group).
        minibatch: units per minibatch ``m``, drawn with replacement.
        draws: bootstrap draws.

    Returns ``(mean over draws of ||mean_S g - g_bar||^2, ||g_bar||^2)``. Works through the Gram
    matrix ``G G^T`` (``N x N``), so draws cost nothing per parameter.
    """
    n = grads.shape[0]
    if n < 1:
        return float("nan"), float("nan")
    g = grads.double()
    gram = g @ g.T
    mean_sq = float(gram.sum()) / n**2
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (draws, minibatch), generator=gen)
    counts = torch.zeros(draws, n, dtype=torch.float64)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float64))
    w = counts / minibatch - 1.0 / n  # (draws, N): minibatch mean minus full mean
    d = ((w @ gram.cpu()) * w).sum(-1)
    return float(d.mean()), mean_sq


def group_gradients(trainer: Trainer, batch, advantages: torch.Tensor) -> torch.Tensor:
    """``(groups, D)``: the flattened policy gradient of each prompt group's PG loss at ratio 1."""
    cfg = trainer.cfg
    params = [p for p in trainer.policy.parameters() if p.requires_grad]
    rows_by_group: dict[int, list[int]] = {}
    for row, g in enumerate(batch.group_ids.tolist()):
        rows_by_group.setdefault(g, []).append(row)
    out = []
    for rows in rows_by_group.values():
        idx = torch.tensor(rows, device=batch.input_ids.device)
        mask = batch.response_mask[idx]
        fwd = policy_forward(
            trainer.policy,
            batch.input_ids[idx],
            batch.attention_mask[idx],
            batch.prompt_len,
            temperature=cfg.sampling.temperature,
        )
        loss, _ = policy_loss(
            fwd.logprobs,
            fwd.logprobs.detach(),
            advantages[idx],
            mask,
            LossSettings(**cfg.loss_settings()),
            num_rows=len(rows),
            num_tokens=float(mask.sum()),
        )
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        flat = torch.cat(
            [
                (g if g is not None else torch.zeros_like(p)).detach().float().flatten().cpu()
                for g, p in zip(grads, params)
            ]
        )
        out.append(flat)
    return torch.stack(out)


class VarianceProbe:
    """Measures the policy-gradient variance of a run at fixed fractions of its token budget
    (see the module docstring); results go to ``run_dir/variance.jsonl``."""

    def __init__(self, cfg: LearnBenchConfig, run_dir: Path) -> None:
        p = cfg.variance_probes
        self.fractions = [0.0] if p == 1 else [j / (p - 1) for j in range(p)]
        self.cfg = cfg
        self.path = run_dir / VARIANCE
        self.done = {r["fraction"] for r in self.read()}

    def read(self) -> list[dict[str, Any]]:
        return _read_variance(self.path)

    def maybe_measure(self, trainer: Trainer, final: bool = False) -> None:
        if trainer.method is None:  # --credit auto chooses at step 1: measured after it
            return
        budget = trainer.cfg.max_tokens_generated
        used = trainer.tokens_generated + trainer.extra_tokens_generated
        for f in self.fractions:
            if f in self.done:
                continue
            if used >= f * budget or (final and f == self.fractions[-1]):
                self.measure(trainer, f, used)

    def measure(self, trainer: Trainer, fraction: float, used: int) -> None:
        cfg = self.cfg
        devices = [trainer.device] if trainer.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(PROBE_SEED)
            problems = trainer.task.train_problems(cfg.variance_prompts, seed=PROBE_SEED)
            batch, _ = trainer.rollout(problems)
            method = trainer.method
            advantages = method.compute(batch).advantages.detach()
            grads = group_gradients(trainer, batch, advantages)
        var, mean_sq = bootstrap_trace_cov(
            grads, cfg.variance_minibatch, cfg.variance_bootstrap, seed=PROBE_SEED
        )
        record = {
            "fraction": fraction,
            "step": trainer.step,
            "budget_tokens_used": used,
            "groups": int(grads.shape[0]),
            "minibatch_groups": cfg.variance_minibatch,
            "grad_var_trace": var,
            "grad_mean_sqnorm": mean_sq,
            "probe_reward_mean": float(batch.rewards.mean()),
        }
        with os.fdopen(open_for_append(self.path), "a", encoding="utf-8") as fh:  # no link
            fh.write(json.dumps(record) + "\n")
        self.done.add(fraction)


def _read_variance(path: Path) -> list[dict[str, Any]]:
    """The records of a run's ``variance.jsonl`` (a few lines: a link, a FIFO or a file over
    16 MiB is refused in one line)."""
    try:
        lines = read_regular(path, VARIANCE, limit=MAX_CONFIG_BYTES).decode().splitlines()
    except FileNotFoundError:
        return []
    return [loads_json(line, f"{path} line {i}") for i, line in enumerate(lines, 1) if line.strip()]


class ProbedTrainer(Trainer):
    """A :class:`Trainer` that lets a :class:`VarianceProbe` look before each step."""

    def __init__(self, cfg, probe: VarianceProbe | None = None, log=print) -> None:
        super().__init__(cfg, log=log)
        self.probe = probe

    def train_step(self, step: int) -> dict[str, Any]:
        if self.probe is not None:
            self.probe.maybe_measure(self)
        return super().train_step(step)


# ---------------------------------------------------------------------------------------------
# the runs


def base_init(cfg: LearnBenchConfig, log) -> str:
    """The one warm-start checkpoint every run starts from."""
    if cfg.init:
        return cfg.init
    base = resolve_config(
        TrainConfig, cfg.config, _task_override(cfg, cfg.overrides), cfg.task_args
    )
    if base.init:
        return base.init

    task = get_task(base.task, **base.task_args)
    return default_policy_source(
        task,
        base.model.name_or_path,
        log=log,
        tiny_shape=base.model.tiny_shape(),
        preset=base.model.tiny_warmstart,
    )


def _task_override(cfg: LearnBenchConfig, overrides: dict) -> dict:
    return {**overrides, **({"task": cfg.task} if cfg.task else {})}


def train_config(cfg: LearnBenchConfig, variant: Variant, seed: int, init: str, run_dir: Path):
    """The ``TrainConfig`` of one run: YAML, ``--set``, the variant, then the bench's fixed
    fields (init, seed, budget, step cap, run directory)."""
    fixed: dict[str, Any] = {
        "init": init,
        "out": str(run_dir),
        "resume": None,
        "seed": seed,
        "steps": cfg.steps_max,
        "max_tokens_generated": cfg.budget_tokens,
        "max_train_seconds": cfg.budget_seconds,
        "max_compute": cfg.budget_compute,
        "progress": cfg.progress,
    }
    variant_overrides = variant.train_overrides(_task_override(cfg, cfg.overrides))
    # the bench's evaluation settings and learning rate, unless --set or the variant names them
    for name in ("eval_every", "eval_size", "lr"):
        if getattr(cfg, name) is not None and name not in variant_overrides:
            fixed[name] = getattr(cfg, name)
    overrides = {**variant_overrides, **fixed}
    tcfg = resolve_config(TrainConfig, cfg.config, overrides, cfg.task_args)
    if tcfg.sampling.max_new_tokens == 0:
        resolve_max_new_tokens(tcfg, get_task(tcfg.task, **tcfg.task_args))
    return tcfg


def _check_same_config(run_dir: Path, tcfg) -> None:
    """A run directory left by an earlier call must have been made with the same settings, or
    skipping / resuming it would mix two experiments."""
    saved = run_dir / "config.yaml"
    if not os.path.lexists(saved):
        return
    choice = run_dir / runio.CREDIT_CHOICE
    if tcfg.credit_method == AUTO and choice.exists():  # the run saved what auto chose
        tcfg = copy.deepcopy(tcfg)
        apply_choice(tcfg, CreditChoice.read(choice))
    old, new = to_dict(load_yaml(saved, follow=False)), to_dict(tcfg)
    old.pop("progress", None), new.pop("progress", None)
    if old != new:
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise ValueError(
            f"{run_dir} holds a run with other settings (differs in {', '.join(diff)}); use a "
            "fresh --out or delete that run directory"
        )


def run_one(
    cfg: LearnBenchConfig, variant: Variant, seed: int, init: str, log=print
) -> dict[str, Any]:
    """Train (or resume, or skip when complete) one (variant, seed) run; returns its result."""
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    # below --out, no folder is a link: a planted one is refused, never written through
    run_dir = make_dirs(cfg.out, Path("runs", dir_name(variant.name), f"seed{seed}"))
    tcfg = train_config(cfg, variant, seed, init, run_dir)
    _check_same_config(run_dir, tcfg)
    done = run_dir / RESULT
    if os.path.lexists(done):
        log(f"{variant.name} seed {seed}: complete, skipped ({run_dir})")
        return read_json_file(done, "a finished run's result", follow=False)
    if (run_dir / "config.yaml").exists():  # an earlier call left this run unfinished
        if runio.latest_checkpoint(run_dir) is not None:
            tcfg.resume = str(run_dir)
        else:
            tcfg.overwrite = True  # nothing to resume from: start it again
    probe = VarianceProbe(cfg, run_dir) if cfg.variance_probes > 0 else None
    log(f"{variant.name} seed {seed}: training in {run_dir}")
    trainer = ProbedTrainer(tcfg, probe, log=log)
    result = trainer.train()
    if probe is not None:
        probe.maybe_measure(trainer, final=True)
    result = {**result, "variant": variant.name, "method": variant.method, "seed": seed}
    write_json(result, done)
    return result


# ---------------------------------------------------------------------------------------------
# aggregation


def run_curve(run_dir: Path) -> dict[str, list[float]]:
    """Held-out accuracy points of one run: budget tokens (policy + extra), policy tokens, extra
    tokens, training wall-clock (sum of ``step_seconds``, evaluation excluded) and accuracy."""
    curve: dict[str, list[float]] = {
        k: [] for k in ("step", "tokens", "policy_tokens", "extra_tokens", "seconds", "accuracy")
    }
    wall = 0.0
    for r in MetricsLog(run_dir / "metrics.jsonl").read():
        wall += float(r.get("step_seconds") or 0.0)
        if r.get("eval_accuracy") is None:
            continue
        policy = float(r.get("tokens_generated") or 0)
        extra = float(r.get("extra_tokens_generated") or 0)
        curve["step"].append(r["step"])
        curve["tokens"].append(policy + extra)
        curve["policy_tokens"].append(policy)
        curve["extra_tokens"].append(extra)
        curve["seconds"].append(wall)
        curve["accuracy"].append(float(r["eval_accuracy"]))
    return curve


def first_reach(curve: dict[str, list[float]], target: float) -> dict[str, float] | None:
    """Tokens, policy tokens and seconds at the first evaluation with accuracy >= target."""
    for i, acc in enumerate(curve["accuracy"]):
        if acc >= target:
            return {k: curve[k][i] for k in ("tokens", "policy_tokens", "seconds", "step")}
    return None


def _target_of(cfg: LearnBenchConfig, curve: dict[str, list]) -> float:
    """The accuracy target of one run: ``--target-acc``, else its own warm start (each seed has
    its own held-out set) + ``--target-delta``."""
    return cfg.target_acc if cfg.target_acc is not None else curve["accuracy"][0] + cfg.target_delta


def _training_mean(curve: dict[str, list]) -> float:
    """Mean held-out accuracy over the evaluations after step 0."""
    after = curve["accuracy"][1:]
    return statistics.fmean(after) if after else float("nan")


def _tokens_to_target(cfg: LearnBenchConfig, curve: dict[str, list]) -> float:
    """Tokens until the run first reached its target; censored at the budget (else at the
    run's own last tokens) when it never did."""
    hit = first_reach(curve, _target_of(cfg, curve))
    censor = cfg.budget_tokens or curve["tokens"][-1]  # no token budget: the run's own tokens
    return float(hit["tokens"]) if hit is not None else float(censor)


def accuracy_at_second(curve: dict[str, list], second: float) -> float:
    """The run's accuracy at training second ``second``, read between the two evaluations that
    bracket it (linear in seconds), so that a run evaluated every few steps is not read at an
    evaluation made long before; the warm start before the first evaluation, the last
    evaluation after the run ends (never extrapolated)."""
    times, accs = curve["seconds"], curve["accuracy"]
    if second <= times[0]:
        return accs[0]
    for t0, a0, t1, a1 in zip(times, accs, times[1:], accs[1:]):
        if t0 <= second <= t1:
            return a1 if t1 == t0 else a0 + (a1 - a0) * (second - t0) / (t1 - t0)
    return accs[-1]


def time_averaged_accuracy(curve: dict[str, list], horizon: float) -> float:
    """Area under accuracy against training seconds over ``[0, horizon]``, divided by
    ``horizon``: each evaluation's accuracy holds until the next one (the warm start from
    second 0; the last evaluation after the run ends)."""
    if not horizon > 0:
        return float("nan")
    area, times, accs = 0.0, curve["seconds"], curve["accuracy"]
    for i, (t, a) in enumerate(zip(times, accs)):
        until = times[i + 1] if i + 1 < len(times) else horizon
        area += a * max(0.0, min(until, horizon) - min(t, horizon))
    return area / horizon


def _seconds_to_target(cfg: LearnBenchConfig, curve: dict[str, list]) -> float:
    """Training seconds until the run first reached its target; censored at its own last
    training second when it never did (a lower bound)."""
    hit = first_reach(curve, _target_of(cfg, curve))
    return float(hit["seconds"]) if hit is not None else float(curve["seconds"][-1])


def _per_second_scores(
    cfg: LearnBenchConfig, per: dict[int, dict[str, list]], ref: dict[int, dict[str, list]]
) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """Per seed evaluated in both: accuracy at the reference run's last training second,
    time-averaged accuracy over the reference run's seconds, and seconds to target."""
    seeds = [s for s, c in per.items() if c["accuracy"] and ref.get(s, {}).get("accuracy")]
    horizon = {s: ref[s]["seconds"][-1] for s in seeds}
    at_ref = {s: accuracy_at_second(per[s], horizon[s]) for s in seeds}
    averaged = {s: time_averaged_accuracy(per[s], horizon[s]) for s in seeds}
    seconds = {s: _seconds_to_target(cfg, per[s]) for s in seeds}
    return at_ref, averaged, seconds


def _per_seed_scores(
    cfg: LearnBenchConfig, per: dict[int, dict[str, list]]
) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """Per seed with an evaluation: final accuracy, training mean and tokens to target."""
    runs = {s: c for s, c in per.items() if c["accuracy"]}
    finals = {s: c["accuracy"][-1] for s, c in runs.items()}
    means = {s: _training_mean(c) for s, c in runs.items()}
    tokens = {s: _tokens_to_target(cfg, c) for s, c in runs.items()}
    return finals, means, tokens


def _grad_variance_summary(run_dirs: dict[int, Path]) -> dict[str, dict[str, float]]:
    """Per probe fraction, the variance probes of every seed (``variance.jsonl``) averaged."""
    variance: dict[str, dict[str, float]] = {}
    for s, run_dir in run_dirs.items():
        for rec in _read_variance(run_dir / VARIANCE):
            variance.setdefault(f"{rec['fraction']:.3f}", {})[str(s)] = rec
    var_summary = {}
    for frac, by_seed in sorted(variance.items()):
        m, sd = mean_std([r["grad_var_trace"] for r in by_seed.values()])
        mm, _ = mean_std([r["grad_mean_sqnorm"] for r in by_seed.values()])
        tok, _ = mean_std([r["budget_tokens_used"] for r in by_seed.values()])
        var_summary[frac] = {
            "grad_var_trace_mean": m,
            "grad_var_trace_std": sd,
            "grad_mean_sqnorm_mean": mm,
            "budget_tokens_used_mean": tok,
            "seeds": len(by_seed),
        }
    return var_summary


def _variant_summary(
    cfg: LearnBenchConfig,
    v: Variant,
    per: dict[int, dict[str, list]],
    reference: str,
    ref_curves: dict[int, dict[str, list]],
    var_summary: dict[str, dict[str, float]],
) -> dict[str, Any]:
    """One variant's row of ``learn.json``'s summary: its seeds' curves ``per`` against the
    reference variant's curves ``ref_curves``, seed by seed."""
    ref_finals, ref_means, ref_tokens = _per_seed_scores(cfg, ref_curves)
    finals, means, tokens = _per_seed_scores(cfg, per)
    at_ref_s, averaged, seconds = _per_second_scores(cfg, per, ref_curves)
    ref_at, ref_avg, ref_sec = _per_second_scores(cfg, ref_curves, ref_curves)
    per_second = {
        "accuracy_at_reference_seconds": at_ref_s,
        "time_averaged_accuracy": averaged,
        "seconds_to_target_censored": seconds,
    }
    ref_per_second = dict(zip(per_second, (ref_at, ref_avg, ref_sec)))
    paired = {s: finals[s] - ref_finals[s] for s in finals if s in ref_finals}
    paired_means = {s: means[s] - ref_means[s] for s in means if s in ref_means}
    paired_tokens = {s: tokens[s] - ref_tokens[s] for s in tokens if s in ref_tokens}
    over_start = {s: means[s] - per[s]["accuracy"][0] for s in means}
    reach = {s: first_reach(c, _target_of(cfg, c)) for s, c in per.items() if c["accuracy"]}
    reached = [r for r in reach.values() if r is not None]
    below = [s for s, c in per.items() if c["accuracy"] and c["accuracy"][-1] < c["accuracy"][0]]
    fm, fs = mean_std(list(finals.values()))
    mm_, ms_ = mean_std(list(means.values()))
    tm, ts = mean_std([r["tokens"] for r in reached])
    sm, _ = mean_std([r["seconds"] for r in reached])
    pol, _ = mean_std([c["policy_tokens"][-1] for c in per.values() if c["policy_tokens"]])
    ext, _ = mean_std([c["extra_tokens"][-1] for c in per.values() if c["extra_tokens"]])
    wall, _ = mean_std([c["seconds"][-1] for c in per.values() if c["seconds"]])
    steps, _ = mean_std([c["step"][-1] for c in per.values() if c["step"]])
    return {
        "variant": v.name,
        "method": v.method,
        "overrides": v.overrides,
        "seeds": sorted(finals),
        "start_accuracy": {str(s): c["accuracy"][0] for s, c in per.items() if c["accuracy"]},
        "final_accuracy": {str(s): a for s, a in finals.items()},
        "final_accuracy_mean": fm,
        "final_accuracy_std": fs,
        "mean_accuracy": {str(s): a for s, a in means.items()},
        "mean_accuracy_mean": mm_,
        "mean_accuracy_std": ms_,
        "mean_accuracy_interval": interval_estimate(list(means.values())),
        "final_accuracy_interval": interval_estimate(list(finals.values())),
        "reference": reference,
        "final_vs_reference": paired_summary(paired),
        "mean_accuracy_vs_reference": paired_summary(paired_means),
        "mean_accuracy_vs_start": paired_summary(over_start),
        "tokens_to_target_vs_reference": paired_summary(paired_tokens),
        "mean_accuracy_improvement_probability": probability_of_improvement(
            list(means.values()), list(ref_means.values())
        ),
        "final_accuracy_improvement_probability": probability_of_improvement(
            list(finals.values()), list(ref_finals.values())
        ),
        "seeds_below_warm_start": below,
        "any_below_warm_start": bool(below),
        "target_reached": f"{len(reached)}/{len(reach)}",
        "tokens_to_target_mean": tm,
        "tokens_to_target_std": ts,
        "seconds_to_target_mean": sm,
        "tokens_to_target": {str(s): (r or {}).get("tokens") for s, r in reach.items()},
        "policy_tokens_mean": pol,
        "extra_generated_tokens_mean": ext,
        "train_seconds_mean": wall,
        "steps_mean": steps,
        "grad_variance": var_summary,
        **_per_second_summary(per_second, ref_per_second),
    }


def _per_second_summary(
    scores: dict[str, dict[int, float]], ref_scores: dict[str, dict[int, float]]
) -> dict[str, Any]:
    """``learn.json``'s per-second fields: per score, its seeds' values, their mean and std,
    and the paired difference to the reference (:func:`paired_summary`)."""
    out: dict[str, Any] = {}
    for name, by_seed in scores.items():
        m, sd = mean_std(list(by_seed.values()))
        ref = ref_scores[name]
        out[name] = {str(s): v for s, v in by_seed.items()}
        out[f"{name}_mean"], out[f"{name}_std"] = m, sd
        out[f"{name}_vs_reference"] = paired_summary(
            {s: v - ref[s] for s, v in by_seed.items() if s in ref}
        )
    return out


def aggregate(cfg: LearnBenchConfig, variants: list[Variant], seeds: list[int]) -> dict[str, Any]:
    """Read every run directory and summarise per variant, each against the first variant."""
    out = Path(cfg.out)
    run_dirs = {
        v.name: {s: out / "runs" / dir_name(v.name) / f"seed{s}" for s in seeds} for v in variants
    }
    curves = {name: {s: run_curve(d) for s, d in dirs.items()} for name, dirs in run_dirs.items()}
    starts = [c["accuracy"][0] for per in curves.values() for c in per.values() if c["accuracy"]]
    warm = statistics.fmean(starts) if starts else float("nan")
    target = cfg.target_acc if cfg.target_acc is not None else warm + cfg.target_delta
    rule = (
        f"{cfg.target_acc:g}"
        if cfg.target_acc is not None
        else f"each seed's warm-start accuracy + {cfg.target_delta:g}"
    )
    reference = variants[0].name
    summary = [
        _variant_summary(
            cfg,
            v,
            curves[v.name],
            reference,
            curves[reference],
            _grad_variance_summary(run_dirs[v.name]),
        )
        for v in variants
    ]
    return {
        "warm_start_accuracy": warm,
        "target_accuracy": target,
        "target_rule": rule,
        "summary": summary,
        "curves": curves,
    }


def paired_summary(diffs: dict[int, float]) -> dict[str, Any]:
    """Per-seed differences to the reference variant (same seed: same warm start, prompt stream
    and held-out set): mean, standard error, 95% t interval and t-test p-value
    (:func:`rredcot.bench.stats.paired_difference`), and how many seeds are >= 0."""
    xs = [d for d in diffs.values() if math.isfinite(d)]
    return {
        "per_seed": {str(s): d for s, d in diffs.items()},
        **paired_difference(xs),
        "seeds_at_or_above": f"{sum(d >= 0 for d in xs)}/{len(xs)}",
    }


def plot_learning(agg: dict[str, Any], out: Path) -> list[str]:
    """The three PNGs of ``learn.md``; returns their file names."""
    tok_curves, wall_curves, var_curves = {}, {}, {}
    for name, per in agg["curves"].items():
        runs = [c for c in per.values() if c["accuracy"]]
        tok_curves[name] = interpolate_runs([(c["tokens"], c["accuracy"]) for c in runs])
        wall_curves[name] = interpolate_runs([(c["seconds"], c["accuracy"]) for c in runs])
    for s in agg["summary"]:
        pts = sorted(s["grad_variance"].items())
        if pts:
            x = torch.tensor([float(p[1]["budget_tokens_used_mean"]) for p in pts]).numpy()
            m = torch.tensor([float(p[1]["grad_var_trace_mean"]) for p in pts]).numpy()
            sd = torch.tensor([float(p[1]["grad_var_trace_std"]) for p in pts]).numpy()
            var_curves[s["variant"]] = (x, m, sd)
    lines = {
        "warm start": agg["warm_start_accuracy"],
        "target (mean)": agg["target_accuracy"],
    }
    files = [
        plot_mean_std(
            tok_curves,
            out / "accuracy_vs_tokens.png",
            xlabel="sampled tokens (policy + credit generations)",
            ylabel="held-out greedy accuracy",
            title="accuracy vs sampled tokens (mean ± std over seeds)",
            hlines=lines,
        ).name,
        plot_mean_std(
            wall_curves,
            out / "accuracy_vs_wallclock.png",
            xlabel="training wall-clock seconds (evaluation excluded)",
            ylabel="held-out greedy accuracy",
            title="accuracy vs wall-clock (mean ± std over seeds)",
            hlines=lines,
        ).name,
    ]
    if var_curves:
        files.append(
            plot_mean_std(
                var_curves,
                out / "grad_variance.png",
                xlabel="sampled tokens at the probe",
                ylabel="tr Cov of a minibatch PG estimate",
                title="policy-gradient variance on a fixed probe batch",
            ).name
        )
    return files


def _fmt_paired(p: dict[str, Any], is_reference: bool, spec: str = ".3f") -> str:
    if is_reference:
        return "(reference)"
    if not math.isfinite(p["mean"]):
        return "–"
    sem = f"{p['sem']:{spec}}" if math.isfinite(p["sem"]) else "–"
    return f"{p['mean']:+{spec}} ± {sem} ({p['seeds_at_or_above']})"


def _fmt_interval(est: dict[str, float]) -> str:
    if not math.isfinite(est["iqm"]):
        return "–"
    return f"{est['iqm']:.3f} [{est['iqm_lo']:.3f}, {est['iqm_hi']:.3f}]"


def _fmt_probability(summary: dict[str, Any], key: str) -> str:
    if summary["variant"] == summary["reference"]:
        return "(reference)"
    p = summary[key]
    if not math.isfinite(p["p"]):
        return "–"
    return f"{p['p']:.2f} [{p['lo']:.2f}, {p['hi']:.2f}]"


def learn_markdown(report: dict[str, Any]) -> str:
    """``learn.md``: the settings, one table row per variant, what the columns mean, the plots."""
    agg = report
    rows = [_learn_row(s) for s in agg["summary"]]
    cfg = agg["config"]
    ref = agg["summary"][0]["reference"] if agg["summary"] else "-"
    lines = [
        "# Learning under a matched token budget",
        "",
        f"Every run starts from `{agg['init']}` with the same prompt stream; budget "
        f"{_budget_words(cfg)}, at most {cfg['steps_max']} steps; seeds "
        f"{', '.join(str(s) for s in agg['seeds'])}. Warm-start greedy accuracy "
        f"{fmt(agg['warm_start_accuracy'])} (mean over seeds; each seed evaluates on its own "
        f"held-out set); target accuracy: {agg['target_rule']}.",
        "",
        markdown_table(_learn_columns(ref), rows),
        "",
        *_learn_notes(ref, cfg["variance_minibatch"]),
        "",
    ]
    lines += [f"![{f}]({f})" for f in agg.get("plots", [])]
    return "\n".join(lines) + "\n"


def _budget_words(cfg: dict[str, Any]) -> str:
    """The budgets of a report's config, in words (the first reached stops a run)."""
    words = []
    if cfg.get("budget_tokens"):
        words.append(
            f"{cfg['budget_tokens']} sampled tokens per run (policy rollouts + tokens generated "
            "by the credit method)"
        )
    if cfg.get("budget_seconds"):
        words.append(f"{cfg['budget_seconds']:g} training seconds per run")
    if cfg.get("budget_compute"):
        words.append(f"{cfg['budget_compute']:.3g} forward-token equivalents per run")
    return ", or ".join(words) + (" (the first reached stops the run)" if len(words) > 1 else "")


def _learn_columns(ref: str) -> list[str]:
    """The table's header; paired columns compare with the reference variant ``ref``."""
    return [
        "method",
        "seeds",
        "final acc",
        f"final − {ref} (paired)",
        "mean acc in training",
        f"mean acc − {ref} (paired)",
        "mean acc − its start",
        "mean acc, IQM [95% CI]",
        f"P(mean acc > {ref})",
        "any seed below warm start",
        "reached target",
        "tokens to target",
        f"tokens to target − {ref} (paired; unreached = budget)",
        "s to target",
        "policy tokens",
        "extra gen. tokens",
        "train s",
        "PG var @ start",
        "PG var @ end",
        f"acc @ {ref}'s last s",
        f"acc @ {ref}'s last s − {ref} (paired)",
        f"time-avg acc over {ref}'s s",
        f"time-avg acc − {ref} (paired)",
        f"s to target − {ref} (paired; unreached = own last s)",
    ]


def _learn_row(s: dict[str, Any]) -> list:
    """One variant's row of the table (:func:`_learn_columns`) from its summary ``s``."""
    var0 = next(iter(sorted(s["grad_variance"].items())), (None, {}))[1]
    var_last = (sorted(s["grad_variance"].items()) or [(None, {})])[-1][1]
    is_reference = s["variant"] == s["reference"]
    return [
        s["variant"],
        len(s["seeds"]),
        fmt_mean_std(s["final_accuracy_mean"], s["final_accuracy_std"]),
        _fmt_paired(s["final_vs_reference"], is_reference),
        fmt_mean_std(s["mean_accuracy_mean"], s["mean_accuracy_std"]),
        _fmt_paired(s["mean_accuracy_vs_reference"], is_reference),
        _fmt_paired(s["mean_accuracy_vs_start"], False) if "mean_accuracy_vs_start" in s else "–",
        _fmt_interval(s["mean_accuracy_interval"]),
        _fmt_probability(s, "mean_accuracy_improvement_probability"),
        fmt(s["any_below_warm_start"]),
        s["target_reached"],
        fmt_mean_std(s["tokens_to_target_mean"], s["tokens_to_target_std"], ".0f"),
        _fmt_paired(s["tokens_to_target_vs_reference"], is_reference, ".0f"),
        fmt(s["seconds_to_target_mean"], ".0f"),
        fmt(s["policy_tokens_mean"], ".0f"),
        fmt(s["extra_generated_tokens_mean"], ".0f"),
        fmt(s["train_seconds_mean"], ".0f"),
        fmt(var0.get("grad_var_trace_mean"), ".3g"),
        fmt(var_last.get("grad_var_trace_mean"), ".3g"),
        *_per_second_cells(s, is_reference),
    ]


def _per_second_cells(s: dict[str, Any], is_reference: bool) -> list:
    """The per-second cells of a row (empty values in a report made before they existed)."""
    if "accuracy_at_reference_seconds_mean" not in s:
        return ["–"] * 5
    return [
        fmt_mean_std(
            s["accuracy_at_reference_seconds_mean"], s["accuracy_at_reference_seconds_std"]
        ),
        _fmt_paired(s["accuracy_at_reference_seconds_vs_reference"], is_reference),
        fmt_mean_std(s["time_averaged_accuracy_mean"], s["time_averaged_accuracy_std"]),
        _fmt_paired(s["time_averaged_accuracy_vs_reference"], is_reference),
        _fmt_paired(s["seconds_to_target_censored_vs_reference"], is_reference, ".0f"),
    ]


def _learn_notes(ref: str, variance_minibatch) -> list[str]:
    """What the table's columns mean."""
    return [
        "- final acc: last held-out greedy accuracy, mean ± std over seeds; tokens / s to target: "
        "mean over the seeds that reached it.",
        "- mean acc in training: mean of each run's held-out accuracies after step 0 (the area "
        "under its learning curve: speed and level, less noisy than one final evaluation); "
        "mean acc − its start: that minus the run's step-0 accuracy, per seed (mean ± standard "
        "error, seeds at or above): whether the method learned at all, where a lead over "
        f"`{ref}` can also come from falling less.",
        f"- paired: per seed (same warm start, prompts and held-out set) minus `{ref}`; mean ± "
        "standard error over seeds, then how many seeds are at or above it (95% t intervals "
        "and p-values in `learn.json`).",
        "- IQM [95% CI]: interquartile mean over seeds with a stratified-bootstrap interval, "
        f"and P(mean acc > {ref}): the probability of improvement with its interval, both from "
        "`rliable`.",
        "- PG var: bootstrap trace of the covariance of a minibatch policy-gradient estimate "
        f"({variance_minibatch} prompt groups per minibatch) on a fixed probe batch, at "
        "the start and the end of the budget (see `bench/learn.py`).",
        f"- per second (equal wall-clock): training seconds are the sum of the steps' "
        "`step_seconds` (rollout, scoring, credit, update; evaluation, checkpoints and start-up "
        f"excluded). acc @ {ref}'s last s: the run's accuracy at the second at which `{ref}`'s "
        "run of the same seed ended, linear between the two evaluations around it (held at its "
        "last evaluation if it ended sooner); time-avg acc (the primary per-second figure): the "
        f"area under accuracy against training seconds over [0, {ref}'s last second] divided by "
        "it, each evaluation's accuracy holding until the next (the warm start from 0); s to "
        "target paired: unreached counts the run's own last second (a lower bound). Seconds are "
        "the machine's own: a loaded machine inflates them.",
    ]


def run_learn_bench(cfg: LearnBenchConfig, log=print) -> dict[str, Any]:
    """Train every (variant, seed), then write ``learn.json``, ``learn.md`` and the PNGs."""
    variants = parse_variants(cfg.methods, allow_auto=True)
    seeds = list(range(cfg.first_seed, cfg.first_seed + cfg.seeds))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    init = base_init(cfg, log)
    results = []
    for seed in seeds:  # seeds outer: a bench stopped early already compares every method
        for variant in variants:
            results.append(run_one(cfg, variant, seed, init, log=log))
    agg = aggregate(cfg, variants, seeds)
    report = {
        "config": dataclasses.asdict(cfg),
        "init": init,
        "seeds": seeds,
        "runs": results,
        **agg,
    }
    report["plots"] = plot_learning(agg, out)
    md = write_report(report, out, "learn", learn_markdown)
    log(md)
    return report


__all__ = [
    "LearnBenchConfig",
    "ProbedTrainer",
    "VarianceProbe",
    "aggregate",
    "bootstrap_trace_cov",
    "first_reach",
    "group_gradients",
    "run_curve",
    "run_learn_bench",
    "run_one",
    "train_config",
]

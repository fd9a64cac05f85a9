"""``rredcot bench overhead``: the full RL step time of each credit method divided by uniform's.

All methods run in ONE process, interleaved step by step: round ``r`` runs one full trainer step
(``Trainer.train_step``: sampling, verification, segmentation, the no-grad forward, credit, the
policy update, the method's own update) of every method, in an order rotated each round so that no
method always goes first. Each method has its own :class:`~rredcot.training.trainer.Trainer` (own policy,
optimiser and credit state), all from the same warm-start and config. By default each policy is
reset to the warm-start weights before each step, so that in round ``r`` every method samples
*the same* completions (same prompts, same seed, same weights): the times then differ only by what
the credit method costs. ``--reset_policy false`` lets each policy train on (its lengths then drift apart).

The first ``--warmup`` rounds are not timed (allocator warm-up, the value head's replay filling).
Per method: the median over timed rounds of ``step_seconds`` and of each phase
(``time/rollout``, ``time/old_logprobs``, ``time/credit``, ``time/update``, ``time/value_update``);
``ratio`` = median step time / uniform's median; ``ratio_paired`` = median over rounds of the
per-round ratio (robust to drift of the machine's speed); ``ratio_own_phases`` = 1 + (the method's
median no-grad forward, credit and value-update phases minus uniform's) / uniform's median step:
with the policies reset, sampling and the policy update do the same work for every method, so on
a machine whose speed swings this isolates what the method itself adds (a model-sized step on
shared CPUs varies by more than the whole cost of the value head). Writes ``overhead.json`` and
``overhead.md``; the target of the value head is ``ratio <= 1.05``.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from pathlib import Path
from typing import Any

import torch

from rredcot.bench.configs import OverheadBenchConfig
from rredcot.bench.learn import LearnBenchConfig, base_init
from rredcot.bench.report import fmt, markdown_table, write_report
from rredcot.bench.variants import Variant, dir_name, parse_variants
from rredcot.config import TrainConfig
from rredcot.config.io import resolve_config
from rredcot.safe_fs import make_dirs
from rredcot.training.trainer import Trainer

PHASES = ("time/rollout", "time/old_logprobs", "time/credit", "time/update", "time/value_update")
VALUE_HEAD_TARGET = 1.05


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trainers(
    cfg: OverheadBenchConfig, variants: list[Variant], init: str, out: Path, log
) -> dict[str, Trainer]:
    """One trainer per variant, all from the warm-start ``init`` and the same config, each for
    ``warmup + steps`` steps in its own run directory under ``out/runs``."""
    trainers: dict[str, Trainer] = {}
    for v in variants:
        overrides = {
            **cfg.overrides,
            **({"task": cfg.task} if cfg.task else {}),
            **v.train_overrides(),
            "init": init,
            # below --out no folder is a link: a planted one is refused, never written through
            "out": str(make_dirs(out, Path("runs", dir_name(v.name)))),
            "resume": None,
            "seed": cfg.seed,
            "steps": cfg.warmup + cfg.steps,
            "max_tokens_generated": 0,
            "progress": False,
        }
        tcfg = resolve_config(TrainConfig, cfg.config, overrides, cfg.task_args)
        trainers[v.name] = Trainer(tcfg, log=log)
    return trainers


def _interleaved_steps(
    cfg: OverheadBenchConfig, trainers: dict[str, Trainer], initial: dict, device, log
) -> list[dict[str, Any]]:
    """Round ``r`` runs step ``r + 1`` of every trainer, in an order rotated by ``r`` (each
    policy reset to ``initial`` first with ``cfg.reset_policy``); one record per step."""
    records: list[dict[str, Any]] = []
    names = list(trainers)
    rounds = cfg.warmup + cfg.steps
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            tr = trainers[name]
            if cfg.reset_policy:
                tr.policy.load_state_dict(initial)
            tr.step = r + 1
            _sync(device)
            rec = tr.train_step(r + 1)
            _sync(device)
            records.append(
                {
                    "round": r,
                    "method": name,
                    "timed": r >= cfg.warmup,
                    "step_seconds": rec["step_seconds"],
                    **{k: rec[k] for k in PHASES},
                    "rollout_tokens": rec.get("rollout/tokens"),
                    "extra_generated_tokens": rec.get("credit/extra_generated_tokens", 0.0),
                    "extra_forward_tokens": rec.get("credit/extra_forward_tokens", 0.0),
                }
            )
        if r == cfg.warmup - 1 or (r >= cfg.warmup and (r - cfg.warmup + 1) % 5 == 0):
            log(f"round {r + 1}/{rounds}")
    return records


def _method_summaries(
    variants: list[Variant], records: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per variant, the medians over its timed steps and its ratios to uniform's."""
    timed = [x for x in records if x["timed"]]
    by_round: dict[int, dict[str, float]] = {}
    for x in timed:
        by_round.setdefault(x["round"], {})[x["method"]] = x["step_seconds"]
    uniform_median = statistics.median(x["step_seconds"] for x in timed if x["method"] == "uniform")
    methods = []
    for v in variants:
        mine = [x for x in timed if x["method"] == v.name]
        median = statistics.median(x["step_seconds"] for x in mine)
        paired = statistics.median(
            by_round[x["round"]][v.name] / by_round[x["round"]]["uniform"] for x in mine
        )
        entry = {
            "method": v.name,
            "base_method": v.method,
            "overrides": v.overrides,
            "steps": len(mine),
            "median_step_seconds": median,
            "ratio": median / uniform_median,
            "ratio_paired": paired,
            "ratio_own_phases": None,  # filled below, once uniform's phases are known
            "median_phase_seconds": {k: statistics.median(x[k] for x in mine) for k in PHASES},
            "mean_rollout_tokens": statistics.fmean(float(x["rollout_tokens"] or 0) for x in mine),
            "mean_extra_generated_tokens": statistics.fmean(
                float(x["extra_generated_tokens"] or 0) for x in mine
            ),
        }
        if v.method == "value_head":
            entry["target"] = VALUE_HEAD_TARGET
            entry["meets_target"] = entry["ratio"] <= VALUE_HEAD_TARGET
        methods.append(entry)
    uniform_entry = next(e for e in methods if e["method"] == "uniform")
    for entry in methods:
        entry["ratio_own_phases"] = own_phase_ratio(entry, uniform_entry)
    return methods


def run_overhead_bench(cfg: OverheadBenchConfig, log=print) -> dict[str, Any]:
    """Interleave full trainer steps of every method; write ``overhead.json`` / ``overhead.md``."""
    variants = parse_variants(cfg.methods)
    if "uniform" not in [v.name for v in variants]:
        variants.insert(0, Variant("uniform", "uniform"))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    init = base_init(
        LearnBenchConfig(
            init=cfg.init,
            config=cfg.config,
            overrides=cfg.overrides,
            task=cfg.task,
            task_args=cfg.task_args,
        ),
        log,
    )
    trainers = _trainers(cfg, variants, init, out, log)
    first = trainers[variants[0].name]
    initial = copy.deepcopy(first.policy.state_dict())
    device = first.device
    log(
        f"overhead bench: {len(variants)} methods x {cfg.warmup + cfg.steps} interleaved steps "
        f"({cfg.warmup} warm-up)"
    )
    records = _interleaved_steps(cfg, trainers, initial, device, log)
    report = {
        "config": dataclasses.asdict(cfg),
        "init": init,
        "device": str(device),
        "train_config": dataclasses.asdict(first.cfg),
        "methods": _method_summaries(variants, records),
        "records": records,
    }
    md = write_report(report, out, "overhead", overhead_markdown)
    log(md)
    return report


OWN_PHASES = ("time/old_logprobs", "time/credit", "time/value_update")


def own_phase_ratio(entry: dict[str, Any], uniform: dict[str, Any]) -> float:
    """1 + (the method's median own phases - uniform's) / uniform's median step (module doc)."""
    mine, base = entry["median_phase_seconds"], uniform["median_phase_seconds"]
    extra = sum(mine.get(k, 0.0) - base.get(k, 0.0) for k in OWN_PHASES)
    return 1.0 + extra / uniform["median_step_seconds"]


def overhead_markdown(report: dict[str, Any]) -> str:
    rows = []
    for m in report["methods"]:
        ph = m["median_phase_seconds"]
        rows.append(
            [
                m["method"],
                m["steps"],
                fmt(m["median_step_seconds"] * 1e3, ".1f"),
                fmt(m["ratio"], ".3f"),
                fmt(m["ratio_paired"], ".3f"),
                fmt(m.get("ratio_own_phases"), ".3f"),
                *(fmt(ph[k] * 1e3, ".1f") for k in PHASES),
                fmt(m.get("meets_target")) if "meets_target" in m else "",
            ]
        )
    cfg = report["config"]
    tc = report["train_config"]
    return (
        "# Step-time overhead of each credit method\n\n"
        f"Full trainer steps interleaved in one process on {report['device']} "
        f"({cfg['steps']} timed rounds after {cfg['warmup']} warm-up; {tc['prompts_per_step']} "
        f"prompts x {tc['sampling']['num_generations']} samples per step; policies "
        f"{'reset to the warm-start before every step' if cfg['reset_policy'] else 'training on'}"
        ").\n\n"
        + markdown_table(
            [
                "method",
                "steps",
                "median step ms",
                "× uniform",
                "× uniform (paired)",
                "× uniform (own phases)",
                "rollout ms",
                "old-logprob ms",
                "credit ms",
                "update ms",
                "value update ms",
                f"≤ {VALUE_HEAD_TARGET}",
            ],
            rows,
        )
        + "\n\n- × uniform: median step time / uniform's median; paired: median over rounds of "
        "the per-round ratio; own phases: 1 + (the method's no-grad forward, credit and "
        "value-update medians − uniform's) / uniform's median step (sampling and the update do "
        "the same work for every method).\n"
    )

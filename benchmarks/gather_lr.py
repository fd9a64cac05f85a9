"""Aggregate learn-bench runs trained at several learning rates, each lr in its own --out
(`<root>/lr<LR>/runs/<variant>/seed<k>`), with rredcot's own bench-learn aggregation.

    python gather_lr.py ROOT tune  SEEDS            # per lr: every variant; then each variant's
                                                    # lr with the best mean accuracy (chosen.txt)
    python gather_lr.py ROOT report SEEDS OUT VARIANT=LR ...   # one report at the chosen rates
    python gather_lr.py spec VARIANT                # its --methods spec (learn_at_lr.sh runs it)

SEEDS: first:count. The run settings (budget, evaluation, task) are read from a run's config.yaml.
"""

import dataclasses
import shutil
import sys
from pathlib import Path

import yaml

from rredcot.bench.configs import LearnBenchConfig
from rredcot.bench.learn import aggregate, learn_markdown, plot_learning
from rredcot.bench.report import write_report
from rredcot.bench.variants import parse_variants

SPECS = {
    "uniform": "uniform",
    "value_head": "value_head",
    "answer_likelihood": "answer_likelihood",
    "oracle_pooled": "oracle:oracle.values=pooled",
    "oracle_group": "oracle:oracle.values=group",
    # every failed trace blamed somewhere: also those cut by the cap (issue 60, ceiling labels v3)
    "oracle_pooled_v3": "oracle:oracle.values=pooled:oracle.capped_unlabelled=last_segment",
    "oracle_mc": "oracle:oracle.values=monte_carlo:oracle.rollouts=16",
    "cl_flow": "continuation_likelihood:lam=0:anchor=none:handover.smoothing=0.5",
    "cl_cheap": "continuation_likelihood:lam=0:anchor=none:handover.smoothing=0.5"
    ":continuation_likelihood.window=1",
    "auto": "auto",
    "cl_flow_off": "continuation_likelihood:lam=0:anchor=none:handover.mode=off",
    "vh_merge": "value_head:segmenter=newline+merge:fraction=0.5",
    "cl_rw_merge": "continuation_likelihood:form=reweight:segmenter=newline+merge:fraction=0.5",
    # the reference baselines (issue 40, rredcot.training.references): the reference solutions trained
    # on in groups with no correct sample, their tokens charged to the budget
    "ref_sft": "uniform:references.mode=sft:references.sft_coef=0.1",
    "ref_sft_c1": "uniform:references.mode=sft:references.sft_coef=1.0",
    "ref_luffy": "uniform:references.mode=luffy",
    "ref_bread": "uniform:references.mode=bread",
    # issue 49: cl_cheap with its probes re-forwarded (the rollout's KV cache off), and the
    # value head taught by cl_cheap's values on one step in four
    "cl_cheap_reforward": "continuation_likelihood:lam=0:anchor=none:handover.smoothing=0.5"
    ":continuation_likelihood.window=1:probe_from_cache=false",
    "vh_teacher4": "value_head:value_head.teacher=continuation_likelihood:lam=0:anchor=none"
    ":handover.smoothing=0.5:continuation_likelihood.window=1:value_head.teacher_every=4",
    # cl_cheap with the tail of each row's credit below 0.01 dropped, so that its update stops
    # at the row's last large advantage (advantage_tail_floor)
    "cl_cheap_cut": "continuation_likelihood:lam=0:anchor=none:handover.smoothing=0.5"
    ":continuation_likelihood.window=1:advantage_tail_floor=0.01",
    # cl_cheap_cut scoring only the groups GRPO credits (mixed: the update forwards what GRPO's
    # does) or every group with a wrong sample (any_wrong: all-correct groups left at zero)
    "cl_cheap_cut_mixed": "continuation_likelihood:lam=0:anchor=none:handover.smoothing=0.5"
    ":continuation_likelihood.window=1:advantage_tail_floor=0.01:continuation_likelihood.scope=mixed",
    "cl_cheap_cut_anywrong": "continuation_likelihood:lam=0:anchor=none:handover.smoothing=0.5"
    ":continuation_likelihood.window=1:advantage_tail_floor=0.01"
    ":continuation_likelihood.scope=any_wrong",
    # cl_cheap_cut updating on an expected quarter of the agreeing groups' credited tokens,
    # drawn by credit norm and reweighted (agreeing_update_fraction: the same expected gradient)
    "cl_cheap_cut_budget25": "continuation_likelihood:lam=0:anchor=none:handover.smoothing=0.5"
    ":continuation_likelihood.window=1:advantage_tail_floor=0.01:agreeing_update_fraction=0.25",
    # the combination: cl_cheap's credit on top of the best reference baseline (ref_sft_c1)
    "cl_cheap_ref_sft_c1": "continuation_likelihood:lam=0:anchor=none:handover.smoothing=0.5"
    ":continuation_likelihood.window=1:references.mode=sft:references.sft_coef=1.0",
}


def run_config(root: Path) -> dict:
    """The train config of one run under ``root`` (every run there shares its settings)."""
    return yaml.safe_load(next(root.glob("lr*/runs/*/seed*/config.yaml")).read_text())


def bench_config(run: dict, methods: str, first: int, n: int, out: Path) -> LearnBenchConfig:
    return LearnBenchConfig(
        methods=methods,
        seeds=n,
        first_seed=first,
        out=str(out),
        budget_tokens=run["max_tokens_generated"],
        eval_every=run["eval_every"],
        eval_size=run["eval_size"],
        steps_max=run["steps"],
        task=run["task"],
        task_args=dict(run["task_args"]),
        overrides={"model.tiny_warmstart": run["model"]["tiny_warmstart"], "threads": "1"},
    )


def report(cfg: LearnBenchConfig, run: dict, out: Path, extra: dict) -> dict:
    variants = parse_variants(cfg.methods, allow_auto=True)
    seeds = list(range(cfg.first_seed, cfg.first_seed + cfg.seeds))
    agg = aggregate(cfg, variants, seeds)
    init = run["init"]
    if Path(init).name.startswith("warmstart-"):  # a cached or shipped preset, not --set init
        init += f" (model.tiny_warmstart={run['model']['tiny_warmstart']})"
    body = {"config": dataclasses.asdict(cfg), "init": init, "seeds": seeds, **extra, **agg}
    body["plots"] = plot_learning(agg, out)
    write_report(body, out, "learn", learn_markdown)
    return agg


def spec(name: str) -> str:
    if name not in SPECS:
        raise SystemExit(f"unknown variant {name!r}; valid: {', '.join(SPECS)}")
    return name if SPECS[name] == name else f"{name}={SPECS[name]}"


def main() -> None:
    if sys.argv[1] == "spec":
        print(spec(sys.argv[2]))
        return
    root, mode, seeds = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    first, n = (int(x) for x in seeds.split(":"))
    run = run_config(root)
    if mode == "tune":
        lines = []
        best: dict[str, tuple[float, str]] = {}
        for lr_dir in sorted(root.glob("lr*"), key=lambda p: float(p.name[2:])):
            names = sorted(
                p.name
                for p in (lr_dir / "runs").iterdir()
                if all((p / f"seed{s}" / "result.json").exists() for s in range(first, first + n))
            )
            if not names:
                continue
            cfg = bench_config(run, ",".join(spec(v) for v in names), first, n, lr_dir)
            agg = report(cfg, run, lr_dir, {"lr": float(lr_dir.name[2:])})
            for row in agg["summary"]:
                m = row["mean_accuracy_mean"]
                lines.append(
                    f"{row['variant']:14s} lr {lr_dir.name[2:]:8s} mean acc {m:.4f} "
                    f"per seed {row['mean_accuracy']} final {row['final_accuracy']}"
                )
                if m > best.get(row["variant"], (-1.0, ""))[0]:
                    best[row["variant"]] = (m, lr_dir.name[2:])
        lines += [f"{v} chosen lr {lr} (mean acc {m:.4f})" for v, (m, lr) in sorted(best.items())]
        (root / "chosen.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    out = Path(sys.argv[4])
    chosen = dict(arg.split("=") for arg in sys.argv[5:])
    for name, lr in chosen.items():
        for s in range(first, first + n):
            src = root / f"lr{lr}" / "runs" / name / f"seed{s}"
            dst = out / "runs" / name / f"seed{s}"
            if not dst.exists():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints", "plots"))
    cfg = bench_config(run, ",".join(spec(v) for v in chosen), first, n, out)
    report(cfg, run, out, {"learning_rates": {k: float(v) for k, v in chosen.items()}})
    print((out / "learn.md").read_text())


if __name__ == "__main__":
    main()

"""Aggregate runs trained at per-variant learning rates (each in its own --out) into one report:
the run directories are copied under one folder and summarised by rredcot's own bench-learn
aggregation (paired differences, rliable intervals), exactly as `rredcot bench learn` would.

    python benchmarks/investigations/headroom_gather_tuned.py OUT METHODS FIRST_SEED SEEDS '{"VARIANT": LR, ...}'
"""

import dataclasses
import json
import sys
from pathlib import Path

from rredcot.bench.configs import LearnBenchConfig
from rredcot.bench.learn import aggregate, learn_markdown, plot_learning
from rredcot.bench.report import write_report
from rredcot.bench.variants import parse_variants

out, methods, first, n, lrs = (
    sys.argv[1],
    sys.argv[2],
    int(sys.argv[3]),
    int(sys.argv[4]),
    sys.argv[5],
)
cfg = LearnBenchConfig(
    methods=methods,
    seeds=n,
    first_seed=first,
    out=out,
    budget_tokens=170000,
    eval_every=4,
    eval_size=128,
    steps_max=40,
    task="arithmetic",
    task_args={"num_steps": "12"},
    overrides={"model.tiny_warmstart": "low", "threads": "1"},
)
variants = parse_variants(cfg.methods)
seeds = list(range(first, first + n))
agg = aggregate(cfg, variants, seeds)
report = {
    "config": dataclasses.asdict(cfg),
    "init": "warmstart-arithmetic-e0d40e0e7c1c (model.tiny_warmstart=low)",
    "learning_rates": json.loads(lrs),
    "seeds": seeds,
    **agg,
}
report["plots"] = plot_learning(agg, Path(out))
print(write_report(report, Path(out), "learn", learn_markdown))

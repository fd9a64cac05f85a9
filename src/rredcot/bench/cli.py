"""``rredcot bench credit | learn | overhead | peer``: the command-line side of the benchmarks.

Task parameters go as ``--task.NAME VALUE`` (``rredcot.cli`` pulls them out before parsing);
``--set key=value`` (repeatable) overrides any ``TrainConfig`` / ``CreditConfig`` field for every
method, e.g. ``--set credit.lam=0.5 --set sampling.num_generations=4``.
"""

from __future__ import annotations

import argparse

METHODS_HELP = (
    "Comma-separated credit methods or named variants name=method:key=value:..., e.g. "
    "'uniform,value_head,vh_collapse=value_head:lam=0:separate_answer=true:handover=off:value_shared_prefixes=false'."
)


def _common(p: argparse.ArgumentParser, methods_default: str) -> None:
    p.add_argument("--methods", default=methods_default, help=METHODS_HELP)
    p.add_argument(
        "--task",
        dest="task_name",
        default=None,
        help="Task name (default: the checkpoint's or config's task, else arithmetic).",
    )
    p.add_argument(
        "--set",
        dest="set_pairs",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Config override for every method (repeatable), e.g. --set credit.lam=0.5.",
    )


def add_bench_parser(sub) -> None:
    """Register ``bench`` with its ``credit``, ``learn`` and ``overhead`` subcommands."""
    bench = sub.add_parser(
        "bench",
        help="Benchmarks: credit quality, learning under a token budget, step-time overhead.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.set_defaults(bench_help=bench.format_help)
    bsub = bench.add_subparsers(dest="bench_command")

    from rredcot.bench.configs import CreditBenchConfig

    d = CreditBenchConfig(checkpoint="")
    p = bsub.add_parser(
        "credit",
        help="Credit quality on a frozen policy against Monte Carlo ground truth.",
        description="Writes credit.json, credit.md and example HTML pages under --out.",
    )
    p.add_argument(
        "--checkpoint", required=True, help="Policy: model, checkpoint or run directory."
    )
    _common(p, d.methods)
    p.add_argument("--segmenter", default=d.segmenters, help="Comma-separated segmenters.")
    p.add_argument("--prompts", type=int, default=d.prompts, help="Held-out prompts N.")
    p.add_argument("--samples", type=int, default=d.samples, help="Completions per prompt G.")
    p.add_argument("--mc-k", type=int, default=d.mc_k, help="Ground-truth rollouts per boundary.")
    p.add_argument(
        "--lam", type=float, default=d.lam, help="Lambda of every comparison (0: A_k = r_k)."
    )
    p.add_argument("--out", default=d.out, help="Output directory.")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--value-fit-batches",
        type=int,
        default=d.value_fit_batches,
        help="Fresh batches the value head is fitted on before scoring (0: untrained).",
    )
    p.add_argument(
        "--value-fit-prompts", type=int, default=d.value_fit_prompts, help="Prompts per fit batch."
    )
    p.add_argument(
        "--run", default=None, help="Load learned methods (value head) from this training run."
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="Completion length (default: 64)."
    )
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument(
        "--blame-threshold",
        type=float,
        default=d.blame_threshold,
        help="correct_acc: a segment below this advantage counts as blamed.",
    )
    p.add_argument(
        "--chunk-prompts", type=int, default=d.chunk_prompts, help="Prompts per forward chunk."
    )
    p.add_argument("--examples", type=int, default=d.examples, help="Traces per example page.")
    p.add_argument("--device", default=d.device)

    from rredcot.bench.configs import LearnBenchConfig

    d = LearnBenchConfig()
    p = bsub.add_parser(
        "learn",
        help="Every method from one warm-start, same prompts, same token budget, several seeds.",
        description="Writes learn.json, learn.md and PNG curves under --out; resumable.",
    )
    _common(p, d.methods)
    p.add_argument("--seeds", type=int, default=d.seeds, help="Seeds per method.")
    p.add_argument("--first-seed", type=int, default=d.first_seed)
    p.add_argument(
        "--budget-tokens",
        type=int,
        default=d.budget_tokens,
        help="Sampled tokens per run (policy rollouts + credit-method generations).",
    )
    p.add_argument("--init", default=None, help="Warm-start checkpoint (default: built/cached).")
    p.add_argument("--out", default=d.out, help="Output directory (run directories inside).")
    p.add_argument("--steps-max", type=int, default=d.steps_max, help="Step cap per run.")
    p.add_argument("--eval-every", type=int, default=None, help="Steps between evaluations.")
    p.add_argument("--eval-size", type=int, default=None, help="Held-out prompts per evaluation.")
    p.add_argument(
        "--target-acc", type=float, default=None, help="Target accuracy (default: warm + delta)."
    )
    p.add_argument("--target-delta", type=float, default=d.target_delta)
    p.add_argument("--config", default=None, help="YAML TrainConfig every run starts from.")
    p.add_argument(
        "--variance-probes",
        type=int,
        default=d.variance_probes,
        help="Budget points where the PG variance is measured (0: off).",
    )
    p.add_argument("--variance-prompts", type=int, default=d.variance_prompts)
    p.add_argument("--variance-minibatch", type=int, default=d.variance_minibatch)
    p.add_argument("--variance-bootstrap", type=int, default=d.variance_bootstrap)
    p.add_argument("--progress", action="store_true", help="Progress bars.")

    from rredcot.bench.configs import OverheadBenchConfig

    d = OverheadBenchConfig()
    p = bsub.add_parser(
        "overhead",
        help="Full step time of each method / uniform's, interleaved in one process.",
        description="Writes overhead.json and overhead.md under --out.",
    )
    _common(p, d.methods)
    p.add_argument("--steps", type=int, default=d.steps, help="Timed rounds.")
    p.add_argument("--warmup", type=int, default=d.warmup, help="Untimed rounds first.")
    p.add_argument("--init", default=None, help="Warm-start checkpoint (default: built/cached).")
    p.add_argument("--out", default=d.out)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--config", default=None, help="YAML TrainConfig every method starts from.")
    p.add_argument(
        "--no-reset",
        dest="reset_policy",
        action="store_false",
        help="Let each policy train on (default: reset to the warm-start before every step).",
    )

    from rredcot.bench.configs import PeerBenchConfig

    d = PeerBenchConfig()
    p = bsub.add_parser(
        "peer",
        help="rredcot's uniform trainer against TRL's GRPOTrainer: same model, task, batch, length.",
        description="Alternating processes; seconds per step, completions per second, peak "
        "memory and the time split of each. Writes peer.json and peer.md under --out.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="Model (directory, .gguf, shipped alias such as smollm2-135m-instruct, 'tiny'); "
        "default: the task's default (the tiny warm-start on arithmetic).",
    )
    p.add_argument("--task", dest="task_name", default=d.task, help="Task name.")
    p.add_argument("--prompts", type=int, default=d.prompts, help="Prompts per step.")
    p.add_argument("--generations", type=int, default=d.generations, help="Completions per prompt.")
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="Completion length (default: the task's)."
    )
    p.add_argument("--steps", type=int, default=d.steps, help="Timed steps per process.")
    p.add_argument("--warmup", type=int, default=d.warmup, help="Untimed steps first.")
    p.add_argument("--repeats", type=int, default=d.repeats, help="Processes per trainer.")
    p.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        help="torch threads of both trainers (0: each trainer's own default).",
    )
    p.add_argument("--lr", type=float, default=d.lr, help="Learning rate of both.")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--trl-set",
        dest="trl_pairs",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="GRPOConfig override for TRL (repeatable; JSON values), e.g. --trl-set bf16=true.",
    )
    p.add_argument("--out", default=d.out)


def run_bench(args: argparse.Namespace, task_args: dict) -> int:
    from rredcot.bench.variants import parse_set

    command = getattr(args, "bench_command", None)
    if command is None:
        print(args.bench_help())
        return 2
    overrides = parse_set(getattr(args, "set_pairs", []))
    if command == "credit":
        from rredcot.bench.credit import CreditBenchConfig, run_credit_bench

        bad = [k for k in overrides if not k.startswith("credit.")]
        if bad:
            raise ValueError(
                f"bench credit: --set only takes credit.* keys (the policy is frozen); got {bad}"
            )
        cfg = CreditBenchConfig(
            checkpoint=args.checkpoint,
            methods=args.methods,
            segmenters=args.segmenter,
            task=args.task_name,
            task_args=task_args,
            prompts=args.prompts,
            samples=args.samples,
            mc_k=args.mc_k,
            lam=args.lam,
            out=args.out,
            seed=args.seed,
            value_fit_batches=args.value_fit_batches,
            value_fit_prompts=args.value_fit_prompts,
            run=args.run,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            blame_threshold=args.blame_threshold,
            chunk_prompts=args.chunk_prompts,
            examples=args.examples,
            overrides=overrides,
            device=args.device,
        )
        run_credit_bench(cfg)
        return 0
    if command == "learn":
        from rredcot.bench.learn import LearnBenchConfig, run_learn_bench

        cfg = LearnBenchConfig(
            methods=args.methods,
            seeds=args.seeds,
            first_seed=args.first_seed,
            budget_tokens=args.budget_tokens,
            init=args.init,
            out=args.out,
            steps_max=args.steps_max,
            eval_every=args.eval_every,
            eval_size=args.eval_size,
            target_acc=args.target_acc,
            target_delta=args.target_delta,
            config=args.config,
            overrides=overrides,
            task=args.task_name,
            task_args=task_args,
            variance_probes=args.variance_probes,
            variance_prompts=args.variance_prompts,
            variance_minibatch=args.variance_minibatch,
            variance_bootstrap=args.variance_bootstrap,
            progress=args.progress,
        )
        run_learn_bench(cfg)
        return 0
    if command == "peer":
        from rredcot.bench.peer import PeerBenchConfig, parse_trl_overrides, run_peer_bench

        cfg = PeerBenchConfig(
            model=args.model,
            task=args.task_name,
            task_args=task_args,
            prompts=args.prompts,
            generations=args.generations,
            max_new_tokens=args.max_new_tokens,
            steps=args.steps,
            warmup=args.warmup,
            repeats=args.repeats,
            threads=args.threads,
            lr=args.lr,
            seed=args.seed,
            trl_overrides=parse_trl_overrides(args.trl_pairs),
            out=args.out,
        )
        run_peer_bench(cfg)
        return 0
    from rredcot.bench.overhead import OverheadBenchConfig, run_overhead_bench

    cfg = OverheadBenchConfig(
        methods=args.methods,
        steps=args.steps,
        warmup=args.warmup,
        init=args.init,
        out=args.out,
        seed=args.seed,
        reset_policy=args.reset_policy,
        config=args.config,
        overrides=overrides,
        task=args.task_name,
        task_args=task_args,
    )
    run_overhead_bench(cfg)
    return 0

"""``rredcot bench peer``: rredcot's uniform-credit trainer against TRL's ``GRPOTrainer``, side by
side on the same model, task, batch and completion length.

Each trainer runs in its own process (so that each has its own peak memory), and the processes
alternate: repetition ``r`` runs rredcot then TRL for even ``r`` and TRL then rredcot for odd ``r``,
so that a drift of the machine's speed hits both alike. Every process loads the model, builds its
trainer, runs ``--warmup`` untimed steps and ``--steps`` timed ones, and reports per step:

- ``step_seconds``: wall time of one step, end to end (rredcot: ``Trainer.train_step``; TRL: the
  time between consecutive ``on_step_end`` callbacks, which includes its data loading and
  logging);
- the split: ``generation`` (rredcot ``time/rollout``: sampling, decoding, verification and
  segmentation; TRL ``_generate``: tokenising, sampling, decoding), ``scoring`` (rredcot the
  no-grad old-log-prob forward and the credit; TRL the rest of
  ``_generate_and_score_completions``: reward functions, advantages and any old-log-prob or
  reference pass), ``update`` (the rest: loss forward, backward, optimiser step);
- completion tokens generated;

and once: peak resident memory (``ru_maxrss``) and the resident memory after imports and after
the trainer was built.

Both trainers sample ``prompts x generations`` completions per step at temperature 1 with top-p 1
and top-k off, up to ``max_new_tokens`` tokens (stopping at EOS), and make one optimiser step per
batch with no KL term, in float32. TRL runs with ``bf16=False`` and ``gradient_checkpointing=False``
(its defaults are True; they would change the numerics or trade speed for memory), ``beta=0``,
``num_iterations=1`` and ``steps_per_generation=1``; ``--trl-set key=value`` overrides any
``GRPOConfig`` field. ``--threads`` fixes torch's intra-op threads of both; 0 leaves each
trainer's own default (rredcot: the cores idle when it starts; TRL: torch's, every core).
``cpu_seconds`` is the process's CPU time per step: on a crowded machine the wall time says
what share each process got, the CPU time what a step cost.

Writes ``peer.json`` (every step of every process) and ``peer.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rredcot.bench.configs import PeerBenchConfig
from rredcot.bench.report import fmt, markdown_table, write_report
from rredcot.config import TrainConfig
from rredcot.config.io import resolve_config
from rredcot.errors import require_extra
from rredcot.tasks import get_task

TRAINERS = ("rredcot", "trl")
PHASES = ("generation", "scoring", "update")


# ---------------------------------------------------------------------------------------------
# memory


def _rss_bytes() -> int:
    """Current resident set size (Linux ``/proc``; 0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _peak_rss_bytes(*seen: int) -> int:
    """The process's peak resident set size; at least every RSS ``seen`` before (the kernel's
    split RSS counters are approximate, so ``ru_maxrss`` can lag a later ``VmRSS`` reading)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
    return max(peak, _rss_bytes(), *seen)


# ---------------------------------------------------------------------------------------------
# the two workers (each runs in its own process). Each imports what its trainer needs when it
# starts, not at this module's top: the parent runs no model, and a worker's resident memory after
# its imports is one of the figures, so neither trainer's process carries the other's libraries.


def _resolve(cfg: PeerBenchConfig, log) -> tuple[Any, str, int]:
    """(task, model directory, completion length) shared by both trainers."""
    # lazy: a worker imports only its own trainer's libraries (its RSS after imports is measured)
    from rredcot.models import resolve_model_dir
    from rredcot.training.sft import default_policy_source  # lazy: as above

    task = get_task(cfg.task, **cfg.task_args)
    model_dir = resolve_model_dir(default_policy_source(task, cfg.model, log=log), log=log)
    length = cfg.max_new_tokens or task.suggested_max_new_tokens() or 64
    return task, model_dir, length


def run_rredcot(cfg: PeerBenchConfig, log=print) -> dict[str, Any]:
    """rredcot's trainer, uniform credit, ``warmup + steps`` steps; times per step."""
    from rredcot.training.trainer import Trainer  # lazy: a worker imports only its own trainer

    rss_import = _rss_bytes()
    task, model_dir, length = _resolve(cfg, log)
    with tempfile.TemporaryDirectory(prefix="rredcot-peer-") as tmp:
        tcfg = resolve_config(
            TrainConfig,
            None,
            {
                "task": cfg.task,
                "init": model_dir,
                "credit_method": "uniform",
                "prompts_per_step": cfg.prompts,
                "sampling.num_generations": cfg.generations,
                "sampling.max_new_tokens": length,
                "lr": cfg.lr,
                "threads": cfg.threads,
                "seed": cfg.seed,
                "steps": cfg.warmup + cfg.steps,
                "kl_coef": 0.0,
                "eval_size": 1,
                "progress": False,
                "out": tmp,
            },
            cfg.task_args,
        )
        trainer = Trainer(tcfg, log=lambda *_: None)
        rss_setup = _rss_bytes()
        steps = []
        for step in range(1, cfg.warmup + cfg.steps + 1):
            trainer.step = step
            t0, c0 = time.perf_counter(), time.process_time()
            rec = trainer.train_step(step)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            scoring = rec.get("time/old_logprobs", 0.0) + rec.get("time/credit", 0.0)
            generation = rec.get("time/rollout", 0.0)
            steps.append(
                {
                    "step": step,
                    "timed": step > cfg.warmup,
                    "step_seconds": wall,
                    "cpu_seconds": cpu,
                    "generation": generation,
                    "scoring": scoring,
                    "update": wall - generation - scoring,
                    "completion_tokens": rec.get("rollout/tokens", 0.0),
                    "reward_mean": rec.get("reward_mean"),
                }
            )
    return _child_result("rredcot", model_dir, length, rss_import, rss_setup, steps)


def _child_result(
    trainer: str, model_dir: str, length: int, rss_import: int, rss_setup: int, steps: list
) -> dict[str, Any]:
    """What one timed child process reports to the parent."""
    return {
        "trainer": trainer,
        "threads": _threads(),
        "model": model_dir,
        "max_new_tokens": length,
        "rss_after_import": rss_import,
        "rss_after_setup": rss_setup,
        "peak_rss": _peak_rss_bytes(rss_import, rss_setup),
        "steps": steps,
    }


def _threads() -> int:
    import torch  # in the worker only (see above)

    return torch.get_num_threads()


def _require_trl() -> None:
    """The peer bench runs TRL's trainer: say which extra brings it."""
    require_extra("trl", "trl", "rredcot bench peer (TRL's GRPOTrainer)")
    require_extra("datasets", "trl", "rredcot bench peer (TRL's GRPOTrainer)")


def _trl_dataset(task, tokenizer, n: int, seed: int):
    _require_trl()
    from datasets import Dataset

    chat = bool(getattr(tokenizer, "chat_template", None))
    rows = []
    for p in task.train_problems(n, seed=seed):
        if chat:
            messages = [{"role": "user", "content": p.prompt}]
            if isinstance(p.meta, dict) and p.meta.get("system"):
                messages.insert(0, {"role": "system", "content": p.meta["system"]})
            rows.append({"prompt": messages, "answer": p.answer})
        else:
            rows.append({"prompt": p.prompt, "answer": p.answer})
    return Dataset.from_list(rows)


def _timed_grpo_trainer(grpo_trainer: type) -> type:
    """A subclass of TRL's ``GRPOTrainer`` that adds up, on the class, the seconds spent in
    ``_generate`` and in ``_generate_and_score_completions`` and the completion tokens scored."""

    class TimedGRPOTrainer(grpo_trainer):
        gen_seconds = 0.0
        gas_seconds = 0.0
        tokens = 0.0
        rewards: list = []

        def _generate(self, prompts):
            t0 = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                TimedGRPOTrainer.gen_seconds += time.perf_counter() - t0

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            TimedGRPOTrainer.gas_seconds += time.perf_counter() - t0
            TimedGRPOTrainer.tokens += float(out["completion_mask"].sum())
            return out

    return TimedGRPOTrainer


def _step_timer(trainer_callback: type, timed: type, warmup: int, steps: list[dict[str, Any]]):
    """A ``TrainerCallback`` that appends one record per optimiser step to ``steps``: the wall
    and CPU time since the last step, split into phases by ``timed``'s counters."""

    class StepTimer(trainer_callback):
        def __init__(self) -> None:
            self.last = self.last_cpu = None
            self.seen = (0.0, 0.0, 0.0)

        def on_train_begin(self, args, state, control, **kwargs):
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            now, cpu = time.perf_counter(), time.process_time()
            gen, gas, tok = timed.gen_seconds, timed.gas_seconds, timed.tokens
            wall = now - self.last
            d_gen, d_gas, d_tok = gen - self.seen[0], gas - self.seen[1], tok - self.seen[2]
            steps.append(
                {
                    "step": state.global_step,
                    "timed": state.global_step > warmup,
                    "step_seconds": wall,
                    "cpu_seconds": cpu - self.last_cpu,
                    "generation": d_gen,
                    "scoring": d_gas - d_gen,
                    "update": wall - d_gas,
                    "completion_tokens": d_tok,
                }
            )
            self.seen, self.last, self.last_cpu = (gen, gas, tok), now, cpu

    return StepTimer()


def _grpo_args(
    grpo_config: type, cfg: PeerBenchConfig, output_dir: str, length: int, use_cpu: bool
) -> Any:
    """TRL's ``GRPOConfig`` for the same batch, length, sampling and update as rredcot's trainer
    (the module docstring lists the settings), then ``cfg.trl_overrides``."""
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        use_cpu=use_cpu,
        report_to="none",
        bf16=False,
        per_device_train_batch_size=cfg.prompts * cfg.generations,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=cfg.generations,
        max_completion_length=length,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        epsilon_high=0.28,
        learning_rate=cfg.lr,
        max_steps=cfg.warmup + cfg.steps,
        save_strategy="no",
        seed=cfg.seed,
        disable_tqdm=True,
    )
    # off, under transformers' current name where it has it (the old one warns there)
    checkpointing = "activation_checkpointing"
    if checkpointing not in {f.name for f in dataclasses.fields(grpo_config)}:
        checkpointing = "gradient_checkpointing"
    kwargs[checkpointing] = False
    kwargs.update(cfg.trl_overrides)
    return grpo_config(**kwargs)


def run_trl(cfg: PeerBenchConfig, log=print) -> dict[str, Any]:
    """TRL's ``GRPOTrainer`` with the same model, prompts, batch and length; times per step."""
    import torch  # a worker's own imports (see above); TRL below is the optional extra `trl`
    from transformers import AutoTokenizer, TrainerCallback

    _require_trl()
    from trl import GRPOConfig, GRPOTrainer

    from rredcot.integrations.trl import task_reward  # lazy: as run_rredcot's Trainer

    rss_import = _rss_bytes()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    task, model_dir, length = _resolve(cfg, log)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = _trl_dataset(task, tokenizer, cfg.prompts * (cfg.warmup + cfg.steps), cfg.seed)
    timed = _timed_grpo_trainer(GRPOTrainer)
    steps: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="trl-peer-") as tmp:
        trainer = timed(
            model=model_dir,
            reward_funcs=task_reward(task),
            args=_grpo_args(GRPOConfig, cfg, tmp, length, use_cpu=not torch.cuda.is_available()),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[_step_timer(TrainerCallback, timed, cfg.warmup, steps)],
        )
        rss_setup = _rss_bytes()
        trainer.train()
    return _child_result("trl", model_dir, length, rss_import, rss_setup, steps)


# ---------------------------------------------------------------------------------------------
# the parent: alternate processes, aggregate


def _worker_command(which: str, cfg: PeerBenchConfig, out: Path) -> list[str]:
    spec = json.dumps(dataclasses.asdict(cfg))
    return [
        sys.executable,
        "-m",
        "rredcot.bench.peer",
        "--worker",
        which,
        "--spec",
        spec,
        "--out",
        str(out),
    ]


def run_peer_bench(cfg: PeerBenchConfig, log=print) -> dict[str, Any]:
    """Alternate rredcot and TRL processes ``cfg.repeats`` times; write ``peer.json``/``peer.md``."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    # resolve (and build or dequantise, once) the model before any timed process starts
    _, model_dir, length = _resolve(cfg, log)
    log(
        f"peer bench: {cfg.prompts} prompts x {cfg.generations} completions, {length} new tokens, "
        f"{cfg.warmup} + {cfg.steps} steps, {cfg.repeats} alternating repetitions; model {model_dir}"
    )
    runs: list[dict[str, Any]] = []
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for r in range(cfg.repeats):
        order = TRAINERS if r % 2 == 0 else TRAINERS[::-1]
        for which in order:
            with tempfile.TemporaryDirectory(prefix="peer-") as tmp:
                result_file = Path(tmp) / "result.json"
                t0 = time.perf_counter()
                proc = subprocess.run(
                    _worker_command(which, cfg, result_file),
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=cfg.timeout,
                )
                if proc.returncode != 0 or not result_file.exists():
                    raise RuntimeError(
                        f"the {which} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
                    )
                result = json.loads(result_file.read_text())
            result["repeat"] = r
            result["process_seconds"] = time.perf_counter() - t0
            runs.append(result)
            timed = [s["step_seconds"] for s in result["steps"] if s["timed"]]
            log(
                f"repeat {r + 1}/{cfg.repeats} {which}: median {statistics.median(timed):.3f} s/step, "
                f"peak RSS {result['peak_rss'] / 2**30:.2f} GiB"
            )
    report = {
        "config": dataclasses.asdict(cfg),
        "model": model_dir,
        "max_new_tokens": length,
        "completions_per_step": cfg.prompts * cfg.generations,
        "summary": summarise(runs, cfg.prompts * cfg.generations),
        "runs": runs,
    }
    md = write_report(report, out, "peer", peer_markdown)
    log(md)
    return report


def summarise(runs: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """Per trainer: medians over every timed step of every repetition; and the ratios."""
    out: dict[str, Any] = {}
    for which in TRAINERS:
        mine = [r for r in runs if r["trainer"] == which]
        timed = [s for r in mine for s in r["steps"] if s["timed"]]
        if not timed:
            continue
        median = statistics.median(s["step_seconds"] for s in timed)
        per_repeat = [
            statistics.median(s["step_seconds"] for s in r["steps"] if s["timed"]) for r in mine
        ]
        cpu = [s["cpu_seconds"] for s in timed if "cpu_seconds" in s]
        per_repeat_cpu = [
            statistics.median(s["cpu_seconds"] for s in r["steps"] if s["timed"])
            for r in mine
            if all("cpu_seconds" in s for s in r["steps"])
        ]
        phases = {k: statistics.median(s[k] for s in timed) for k in PHASES}
        total = sum(statistics.fmean(s[k] for s in timed) for k in PHASES)
        out[which] = {
            "threads": mine[0]["threads"],
            "timed_steps": len(timed),
            "median_step_seconds": median,
            "per_repeat_median_step_seconds": per_repeat,
            "completions_per_second": batch / median,
            "median_cpu_seconds": statistics.median(cpu) if cpu else None,
            "per_repeat_median_cpu_seconds": per_repeat_cpu,
            "median_phase_seconds": phases,
            "phase_share": {
                k: statistics.fmean(s[k] for s in timed) / total if total else None for k in PHASES
            },
            "mean_completion_tokens": statistics.fmean(s["completion_tokens"] for s in timed)
            / batch,
            "peak_rss_gib": max(r["peak_rss"] for r in mine) / 2**30,
            "rss_after_setup_gib": max(r["rss_after_setup"] for r in mine) / 2**30,
            "rss_after_import_gib": max(r["rss_after_import"] for r in mine) / 2**30,
        }
    if all(k in out for k in TRAINERS):
        a, b = out["rredcot"], out["trl"]
        out["ratio_rredcot_over_trl"] = {
            "completions_per_second": a["completions_per_second"] / b["completions_per_second"],
            "completions_per_second_paired": statistics.median(
                y / x
                for x, y in zip(
                    a["per_repeat_median_step_seconds"], b["per_repeat_median_step_seconds"]
                )
            ),
            "peak_rss": a["peak_rss_gib"] / b["peak_rss_gib"],
        }
        if a["median_cpu_seconds"] and b["median_cpu_seconds"]:
            out["ratio_rredcot_over_trl"]["completions_per_cpu_second"] = (
                b["median_cpu_seconds"] / a["median_cpu_seconds"]
            )
    return out


def peer_markdown(report: dict[str, Any]) -> str:
    s, cfg = report["summary"], report["config"]
    rows = []
    for which in TRAINERS:
        if which not in s:
            continue
        m = s[which]
        ph, share = m["median_phase_seconds"], m["phase_share"]
        rows.append(
            [
                which,
                m["threads"],
                m["timed_steps"],
                fmt(m["median_step_seconds"], ".3f"),
                fmt(m["completions_per_second"], ".2f"),
                fmt(m.get("median_cpu_seconds"), ".3f"),
                *(f"{fmt(ph[k], '.3f')} ({fmt(100 * share[k], '.0f')}%)" for k in PHASES),
                fmt(m["mean_completion_tokens"], ".1f"),
                fmt(m["peak_rss_gib"], ".2f"),
                fmt(m["rss_after_setup_gib"], ".2f"),
            ]
        )
    ratio = s.get("ratio_rredcot_over_trl")
    lines = [
        "# rredcot's trainer against TRL's GRPOTrainer",
        "",
        f"Model `{report['model']}`, task `{cfg['task']}`, {cfg['prompts']} prompts x "
        f"{cfg['generations']} completions per step, up to {report['max_new_tokens']} new tokens, "
        f"one update per batch, no KL; {cfg['repeats']} alternating repetitions (one process "
        f"each) of {cfg['warmup']} warm-up + {cfg['steps']} timed steps; threads "
        f"{cfg['threads'] or 'each trainer default'}.",
        "",
        markdown_table(
            [
                "trainer",
                "threads",
                "timed steps",
                "s / step (median)",
                "completions / s",
                "CPU s / step",
                "generation s",
                "scoring s",
                "update s",
                "tokens / completion",
                "peak RSS GiB",
                "RSS after setup GiB",
            ],
            rows,
        ),
        "",
    ]
    if ratio:
        lines += [
            f"rredcot / TRL completions per second: **{ratio['completions_per_second']:.2f}** "
            f"(median of per-repetition ratios {ratio['completions_per_second_paired']:.2f}); "
            f"peak memory ratio {ratio['peak_rss']:.2f}."
            + (
                f" CPU seconds per step, TRL / rredcot: "
                f"**{ratio['completions_per_cpu_second']:.2f}** (the cost of a step whatever "
                "share of a crowded machine each process got; threads that spin-wait count)."
                if ratio.get("completions_per_cpu_second")
                else ""
            ),
            "",
        ]
    lines += [
        "- generation: rredcot's rollout (sampling, decoding, verification, segmentation); TRL's "
        "`_generate` (tokenising, sampling, decoding).",
        "- scoring: rredcot's no-grad old-log-prob forward and credit; TRL's rewards, advantages "
        "and any extra forward in `_generate_and_score_completions`.",
        "- update: the rest of the step (loss forward, backward, optimiser step; TRL: also its "
        "per-step logging and data loading). Medians per phase; shares of the mean step.",
        "- peak RSS: the process's resident-memory high-water mark (imports included); RSS after "
        "setup: once the trainer is built (safetensors weights are memory-mapped, so much of the "
        "model is paged in only when first used).",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# worker entry point: python -m rredcot.bench.peer --worker rredcot|trl --spec JSON --out FILE


def _worker_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rredcot.bench.peer")
    p.add_argument("--worker", choices=TRAINERS, required=True)
    p.add_argument("--spec", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    cfg = PeerBenchConfig(**json.loads(args.spec))
    result = (run_rredcot if args.worker == "rredcot" else run_trl)(cfg, log=lambda *_: None)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker_main())

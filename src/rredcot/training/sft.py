"""Supervised warm-start: train a model on a task's gold traces until it sits at the edge of
competence (docs/method.md, the RL step), then save a checkpoint that ``rredcot train --init`` accepts.
The model is the tiny character Llama, or any causal LM named by ``--init`` (a short warm-up of a
pretrained model on the answer format, on data disjoint from the RL task's).

With ``early_answer_prob > 0`` some gold traces are cut after k steps and followed straight by the
final answer line, so the model learns to answer from a partial chain; the answer-likelihood
estimator needs a model that can judge its own partial work (docs/method.md, failure modes).

Under ``accelerate launch`` or ``torchrun`` the processes split each step's batch (every process
draws the same ``batch_size`` problems and trains on its share), the loss is the mean over every
process's completion tokens, so the update is one process's on the whole batch, the held-out
set is split for evaluation, and process 0 writes ``--out``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate import Accelerator
from tqdm.auto import tqdm

from rredcot.config import SFTConfig
from rredcot.config.io import brief, save_yaml, to_dict
from rredcot.errors import UserError
from rredcot.machine import resolve_device
from rredcot.methods.processes import Collective
from rredcot.models import (
    DEFAULT_REAL_MODEL,
    SHIPPED_MODELS,
    TINY_MODEL,
    build_char_tokenizer,
    build_tiny_llama,
    cache_root,
    count_parameters,
    load_named_policy,
    shipped_model_available,
)
from rredcot.sampling.rollout import prompt_special_tokens, render_prompt
from rredcot.tasks import get_task
from rredcot.tasks.base import Task
from rredcot.training.evaluation import greedy_accuracy_over_processes
from rredcot.training.seeding import seed_everything


def _training_text(task: Task, problem, rng: random.Random, early_answer_prob: float) -> str:
    if early_answer_prob > 0 and rng.random() < early_answer_prob:
        steps = len(task.gold_steps(problem) or [])
        if steps > 1:
            cut = task.truncated_gold(problem, rng.randrange(1, steps))
            if cut is not None:
                return cut
    gold = task.gold_completion(problem)
    if gold is None:
        raise ValueError(
            f"task {task.name!r} has no gold traces, so it cannot be used for warm-start"
        )
    return gold


def _encode_batch(tokenizer, prompts: list[str], completions: list[str], device):
    """Right-padded ``prompt + completion + eos`` ids and a loss mask on the completion."""
    special = prompt_special_tokens(tokenizer)
    rows, masks = [], []
    for prompt, completion in zip(prompts, completions):
        p = tokenizer(prompt, add_special_tokens=special)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + c)
        masks.append([0] * len(p) + [1] * len(c))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids, dtype=torch.float)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
    return ids.to(device), attn.to(device), loss_mask.to(device)


def _check_out(out: Path) -> None:
    """``--out`` is replaced as a whole at the end: refuse a file, or a directory that holds
    anything but an earlier warm-start (``warmstart.json``)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory; pick another --out")
    if out.is_dir() and any(out.iterdir()) and not (out / "warmstart.json").exists():
        raise UserError(
            f"--out {out} holds files that are not a warm-start checkpoint, and `rredcot sft` "
            "replaces its --out entirely; pick a new or empty directory"
        )
    parent = out.parent
    if parent.exists() and not parent.is_dir():
        raise UserError(f"--out {out}: {parent} is a file, not a directory")


def _batch_loss(
    model, tokenizer, task: Task, problems: list, rng, early_answer_prob, collective: Collective
) -> tuple[torch.Tensor, float]:
    """The cross-entropy over the completion tokens of a batch of gold traces of ``problems``
    (some cut early, with ``early_answer_prob``): this process's share of the rows, divided by
    every process's completion tokens and scaled by the number of processes (whose gradients
    are averaged), so the gradient is the whole batch's token mean. Returns ``(loss to
    backpropagate, the whole batch's mean loss)``. Every process draws the same texts."""
    prompts = [render_prompt(p, tokenizer) for p in problems]
    completions = [_training_text(task, p, rng, early_answer_prob) for p in problems]
    world, rank = collective.world, collective.rank
    mine = slice(rank * len(problems) // world, (rank + 1) * len(problems) // world)
    ids, attn, loss_mask = _encode_batch(
        tokenizer, prompts[mine], completions[mine], collective.device
    )
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    token_loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).view(ids.shape[0], -1)
    mask = loss_mask[:, 1:]
    total = (token_loss * mask).sum()
    if world == 1:
        loss = total / mask.sum()
        return loss, float(loss.detach())
    summed, tokens = collective.sum([float(total.detach()), float(mask.sum())])
    return total * world / tokens, summed / tokens


def _stops(cfg: SFTConfig, accuracy: float, step: int, out_of_time: bool, log) -> bool:
    """Whether training stops after an evaluation at ``accuracy``: in the band, over it, or out
    of time (the last two say so); with ``stop_at_step``, at that step and nowhere else."""
    if cfg.stop_at_step:
        if step >= cfg.stop_at_step:
            return True
    elif cfg.target_accuracy <= accuracy <= cfg.max_accuracy:
        return True
    elif accuracy > cfg.max_accuracy:
        log(f"warm-start overshot the band: {accuracy:.1%} > {cfg.max_accuracy:.0%} at step {step}")
        return True
    if out_of_time:
        log(
            f"warm-start stopped by max_seconds at {accuracy:.1%} (target {cfg.target_accuracy:.0%})"
        )
        return True
    return False


@dataclass
class _Trained:
    """Where warm-start training stopped."""

    step: int
    accuracy: float  # at the last evaluation
    in_band: bool
    history: list[dict[str, float]]
    start: float  # time.perf_counter() when training began


def _train_to_band(
    cfg: SFTConfig, model, tokenizer, task: Task, log, accelerator: Accelerator
) -> tuple[_Trained, Any]:
    """Train on gold traces, evaluating every ``eval_every`` steps, until the greedy accuracy is
    in ``[target_accuracy, max_accuracy]``, over it, out of time or out of steps. Returns where
    it stopped and the trained model (unwrapped)."""
    train = task.train_problems(20_000, seed=cfg.seed)
    evalset = task.eval_problems(cfg.eval_size, seed=cfg.seed)
    if not train or not evalset:
        raise ValueError(f"task {cfg.task!r} produced no problems")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.resolved_lr, weight_decay=0.01)
    warmup = min(100, cfg.max_steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup))
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    collective = Collective(accelerator)
    rng = random.Random(cfg.seed)  # the same draws on every process
    done = _Trained(0, 0.0, False, [], time.perf_counter())
    bar = None
    if cfg.progress and accelerator.is_main_process:
        bar = tqdm(total=cfg.max_steps, desc="warm-start", unit="step", dynamic_ncols=True)
    for step in range(1, cfg.max_steps + 1):
        done.step = step
        model.train()
        problems = [train[rng.randrange(len(train))] for _ in range(cfg.batch_size)]
        loss, mean_loss = _batch_loss(
            model, tokenizer, task, problems, rng, cfg.early_answer_prob, collective
        )
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{mean_loss:.3f}", acc=f"{done.accuracy:.2f}")
        out_of_time = cfg.max_seconds > 0 and time.perf_counter() - done.start > cfg.max_seconds
        # process 0's clock decides for every process
        out_of_time = collective.sum([float(out_of_time) * (collective.rank == 0)])[0] > 0
        last = step in (cfg.max_steps, cfg.stop_at_step)
        if step % cfg.eval_every == 0 or out_of_time or last:
            done.accuracy = greedy_accuracy_over_processes(
                accelerator.unwrap_model(model),
                tokenizer,
                task,
                evalset,
                cfg.max_new_tokens,
                collective,
            )
            done.history.append({"step": step, "loss": mean_loss, "eval_accuracy": done.accuracy})
            if _stops(cfg, done.accuracy, step, out_of_time, log):
                done.in_band = cfg.target_accuracy <= done.accuracy <= cfg.max_accuracy
                break
    if bar is not None:
        bar.close()
    return done, accelerator.unwrap_model(model)


def _check_fits(cfg: SFTConfig, task: Task, tokenizer, positions: int) -> None:
    """Refuse, before any training, a task whose prompts and gold traces (or prompts and
    ``max_new_tokens``) are longer than the model's ``positions``: a few problems tell."""
    problems = task.train_problems(4, seed=cfg.seed)
    longest = 0
    for problem in problems:
        prompt = len(tokenizer(render_prompt(problem, tokenizer))["input_ids"])
        gold = task.gold_completion(problem) or ""
        longest = max(longest, prompt + max(len(tokenizer(gold)["input_ids"]), cfg.max_new_tokens))
    if longest > positions:
        raise UserError(
            f"task {cfg.task!r} with {brief(cfg.task_args, 80) if cfg.task_args else 'its defaults'}: a prompt and its trace "
            f"take {longest} tokens, more than the model's {positions} positions; lower the "
            "task's size (e.g. --task.num_steps) or give a model that fits (--init / "
            "--model.name_or_path)"
        )


def run_sft(cfg: SFTConfig, log=print) -> dict[str, Any]:
    """Train, stop at the edge of competence, save model + tokenizer + ``warmstart.json``."""
    _check_out(Path(cfg.out))  # before minutes of training, not after
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    task = get_task(cfg.task, **cfg.task_args)
    accelerator = _processes(cfg)
    if cfg.batch_size < accelerator.num_processes:
        raise UserError(
            f"--batch_size {cfg.batch_size} is split over {accelerator.num_processes} processes: "
            f"give at least {accelerator.num_processes} (a row each), or launch fewer processes"
        )
    if not accelerator.is_main_process:
        log = _quiet
    model, tokenizer = _starting_model(cfg, log, accelerator.device)
    _check_fits(cfg, task, tokenizer, model.config.max_position_embeddings)
    done, model = _train_to_band(cfg, model, tokenizer, task, log, accelerator)
    out = Path(cfg.out)
    if not accelerator.is_main_process:  # process 0 writes --out
        accelerator.wait_for_everyone()
        return json.loads((out / "warmstart.json").read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    # a fresh folder of our own beside --out: never one that is there already (``ws.tmp`` may be
    # the user's), so nothing but --out itself is replaced
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        _save_warmstart(cfg, model, tokenizer, done, tmp, out, accelerator.num_processes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        accelerator.wait_for_everyone()
    info = json.loads((out / "warmstart.json").read_text())
    log(
        f"warm-start: {info['parameters'] / 1e6:.2f}M parameters, {done.step} steps, "
        f"{info['seconds']:.0f}s, greedy accuracy {done.accuracy:.1%} -> {out}"
    )
    return info


def _quiet(*_: Any) -> None:
    """The log of every process but process 0."""


class _OneProcess:
    """What warm-up training needs of an ``Accelerator``, on one process: nothing is wrapped,
    and no process-wide accelerate state is set (a later ``rredcot train`` in the same process
    chooses its own device)."""

    num_processes, process_index, is_main_process = 1, 0, True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def prepare(self, *objects: Any) -> tuple[Any, ...]:
        return objects

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def unwrap_model(self, model):
        return model

    def wait_for_everyone(self) -> None:
        pass


def _processes(cfg: SFTConfig):
    """An ``Accelerator`` under ``accelerate launch`` / ``torchrun`` with several processes, else
    :class:`_OneProcess`. The tiny model trains on the CPU; a model named by ``--init`` on a
    GPU where one is visible."""
    cpu = not cfg.init or resolve_device("auto").type == "cpu"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return Accelerator(cpu=cpu)
    return _OneProcess(torch.device("cpu") if cpu else resolve_device("auto"))


def _starting_model(cfg: SFTConfig, log, device: torch.device) -> tuple[Any, Any]:
    """The model to train and its tokenizer: ``cfg.init`` loaded on ``device`` (a GPU where one
    is visible), or the tiny character Llama built from ``cfg``'s shape on the CPU."""
    if cfg.init:
        model, tokenizer = load_named_policy("--init", cfg.init, device=device)
        log(f"warm-up of {cfg.init} on {device} at lr {cfg.resolved_lr:g}")
        return model.train(), tokenizer
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(
        tokenizer,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        seed=cfg.seed,
    )
    return model, tokenizer


def _save_warmstart(
    cfg: SFTConfig, model, tokenizer, done, tmp: Path, out: Path, processes: int = 1
) -> None:
    """Write the warm-start into ``tmp``, then put it at ``out`` (an earlier warm-start there,
    which ``_check_out`` allowed, is replaced)."""
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {
        "task": cfg.task,
        "task_args": cfg.task_args,
        "init": cfg.init or TINY_MODEL,
        "lr": cfg.resolved_lr,
        "steps": done.step,
        "seconds": time.perf_counter() - done.start,
        "eval_accuracy": done.accuracy,
        "in_band": done.in_band,
        "parameters": count_parameters(model),
        "processes": processes,
        "early_answer_prob": cfg.early_answer_prob,
        "history": done.history,
        "built_with": build_environment(),
    }
    (tmp / "warmstart.json").write_text(json.dumps(info, indent=2))
    save_yaml(cfg, tmp / "sft_config.yaml")
    _check_out(out)  # still a warm-start (or nothing) after the minutes of training
    if out.is_symlink():
        out.unlink()  # a link is replaced, its target never emptied
    elif out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def build_environment() -> dict[str, str]:
    """What a build's floats depend on beyond its config: the same settings rebuilt with other
    library versions or on another CPU can stop at another step and accuracy."""
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


WARMSTART_PRESETS: dict[str, dict[str, Any]] = {
    "edge": {},
    # most groups all wrong: GRPO learns nothing from them (the headroom testbed, issue 26).
    # A fixed step count, not an accuracy band: builds of the same settings on other CPUs differ
    # in float rounding, and a band let one build stop at 31% and others at 16% and 26.6%, each
    # a testbed with other headroom. The 12-step chains' build ships (SHIPPED_WARMSTARTS), so
    # every machine trains from the same weights (benchmarks/results/headroom/).
    "low": {"stop_at_step": 450, "eval_every": 25},
}
"""Named warm-starts of the tiny model (``--model.tiny_warmstart``): ``SFTConfig`` overrides
on top of the task's own ``warmstart_settings``. ``edge``: the task's edge of competence;
``low``: 450 supervised steps, short of competence, so that most groups' rewards are all 0."""


def warmstart_preset(name: str) -> dict[str, Any]:
    """The ``SFTConfig`` overrides of preset ``name`` (a clear error names the valid ones)."""
    if name not in WARMSTART_PRESETS:
        raise ValueError(
            f"unknown warm-start preset {name!r}; valid: {', '.join(WARMSTART_PRESETS)}"
        )
    return dict(WARMSTART_PRESETS[name])


def warmstart_dir_name(cfg: SFTConfig) -> str:
    """The directory a warm-start of ``cfg`` is cached (or shipped) under: the task's name and a
    digest of every setting that changes the weights (not where it is written, its progress bar
    or its thread count)."""
    volatile = ("out", "progress", "threads")
    settings = {k: v for k, v in to_dict(cfg).items() if k not in volatile}
    if not cfg.init:  # added later: the tiny model's builds keep their names
        del settings["init"]
        settings["lr"] = cfg.resolved_lr  # an empty lr is the rate they were built at
    if not cfg.stop_at_step:  # added later: at its default, earlier builds keep their names
        del settings["stop_at_step"]
    key = json.dumps(settings, sort_keys=True)
    return f"warmstart-{cfg.task}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


SHIPPED_WARMSTARTS = Path(__file__).parents[1] / "warmstarts"
"""Warm-starts that ship with the package, each under the name its settings would be cached
under: the default task's (4-step arithmetic, the README's first command) and the 12-step
chains' ``low`` (the headroom testbed). Builds of the same settings on other CPUs differ in float
rounding, so a seed fixes a run on every machine only from shipped weights."""


def default_warmstart(task: Task, log=print, preset: str = "edge", **overrides: Any) -> Path:
    """The warm-start checkpoint for ``task``'s default settings (its ``warmstart_settings``,
    then ``preset``, then ``overrides``): the shipped one when the package has these settings'
    build (``SHIPPED_WARMSTARTS``), else reused when cached, trained and cached when not. The
    default preset on a task without settings of its own keeps the cache key of earlier
    versions."""
    overrides = {**task.warmstart_settings, **warmstart_preset(preset), **overrides}
    suggested = task.suggested_max_new_tokens()
    if suggested is not None and "max_new_tokens" not in overrides:
        overrides["max_new_tokens"] = suggested
    cfg = SFTConfig(task=task.name, task_args=dataclasses.asdict(task.params), **overrides)
    name = warmstart_dir_name(cfg)
    shipped = SHIPPED_WARMSTARTS / name
    if (shipped / "warmstart.json").exists():
        log(f"using the shipped warm-start {shipped}")
        return shipped
    out = cache_root() / name
    if (out / "warmstart.json").exists():
        log(f"reusing warm-start {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"building the warm-start checkpoint {out} (cached for later runs)")
    cfg.out = str(out)
    run_sft(cfg, log=log)
    return out


def default_policy_source(
    task,
    name_or_path: str | None = None,
    log=print,
    tiny_shape: dict | None = None,
    preset: str = "edge",
) -> str:
    """What to load when the user names `name_or_path` (or nothing) for `task`.

    - `tiny` (`TINY_MODEL`): the built-in character-level Llama warm-started on `task` (built
      once and cached; see `default_warmstart`);
    - any other name: itself;
    - nothing, on a task whose ``tiny_model_default`` is set (the built-in `arithmetic` and
      `graph_paths`): the tiny model's warm-start;
    - nothing, on any other task: the shipped `smollm2-135m-instruct` when it is installed, else
      a `ValueError` saying which `--model.name_or_path` to pass and how to install the shipped
      model. The character model only makes sense on arithmetic: a silent warm-start of it on
      GSM8K would take hours and learn nothing useful.

    ``tiny_shape`` (``hidden_size``, ``num_layers``, ``num_heads``: ``--model.tiny_*``) sizes
    the tiny model of a warm-start that has to be built (each shape is cached on its own);
    ``preset`` (``--model.tiny_warmstart``) names how far it is trained (:data:`WARMSTART_PRESETS`).
    """
    if name_or_path and str(name_or_path).strip().lower() != TINY_MODEL:
        return str(name_or_path)
    task_name = getattr(task, "name", str(task))
    if name_or_path or getattr(task, "tiny_model_default", False):
        return str(default_warmstart(task, log=log, preset=preset, **(tiny_shape or {})))
    if shipped_model_available(DEFAULT_REAL_MODEL):
        log(
            f"no model named for task {task_name!r}: using the shipped {DEFAULT_REAL_MODEL} "
            "(pass --model.name_or_path to choose another)"
        )
        return DEFAULT_REAL_MODEL
    info = SHIPPED_MODELS[DEFAULT_REAL_MODEL]
    raise ValueError(
        f"task {task_name!r} needs a pretrained model: pass --model.name_or_path (a directory, "
        f"a .gguf file or a hub id), or `{info.install}` to use {DEFAULT_REAL_MODEL} "
        f"(--model.name_or_path {TINY_MODEL} trains the built-in character model)"
    )

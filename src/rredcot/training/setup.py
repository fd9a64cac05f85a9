"""Everything ``rredcot train`` is built from, before its first step: the device and threads, the
policy (and its LoRA adapter), the frozen KL reference, the segmenter, the training and
evaluation prompts that fit the context, the credit method (with ``--credit auto``, built by the
trainer once step 1's batch has chosen it), the optimiser and learning-rate schedule.
:func:`build_train_parts` returns them as one :class:`TrainParts`; the RL loop (``rredcot.training.trainer``)
only reads them.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator

from rredcot.algebra.loss import lr_lambda
from rredcot.algebra.normalization import get_normalizer
from rredcot.config import MODEL_DEFAULTS, TrainConfig
from rredcot.errors import UserError, require_extra
from rredcot.machine import resolve_device
from rredcot.methods.auto import AUTO, check_method_name, measured_rows, model_kind
from rredcot.methods.base import CreditContext, CreditMethod, build_credit
from rredcot.models import load_named_policy, set_activation_checkpointing
from rredcot.sampling.memory import (
    ModelShape,
    check_run_fits,
    generation_rows,
    resolve_micro_batch_tokens,
)
from rredcot.sampling.rollout import (
    context_limit,
    prompt_special_tokens,
    render_prompt,
    resolve_decoder,
)
from rredcot.segment import Segmenter, segmenter_from_config
from rredcot.tasks import get_task
from rredcot.tasks.base import Problem, Task, get_task_class, make_params, read_task_data
from rredcot.training.runio import capture_rng_state
from rredcot.training.seeding import seed_everything
from rredcot.training.sft import default_policy_source

DEFAULT_MAX_NEW_TOKENS = 64


# ---------------------------------------------------------------------------------------------
# processes, devices, threads


def is_main_process() -> bool:
    """Rank 0 of an ``accelerate launch`` / ``torchrun`` job (or a plain single process)."""
    return int(os.environ.get("RANK", "0")) == 0


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def idle_cores(window: float = 0.25) -> float | None:
    """How many CPU cores sat idle over the last ``window`` seconds (Linux ``/proc/stat``), or
    None where that cannot be read. Unlike the load average, which lags by a minute and counts
    the jobs that just finished, this is what is free now."""

    def times() -> tuple[float, float]:
        with open("/proc/stat") as fh:
            fields = [float(x) for x in fh.readline().split()[1:]]
        return sum(fields[3:5]), sum(fields[:8])  # idle + iowait, everything but guest time

    try:
        idle0, total0 = times()
        time.sleep(window)
        idle1, total1 = times()
    except (OSError, ValueError, IndexError):
        return None
    busy = total1 - total0
    return usable_cores() * (idle1 - idle0) / busy if busy > 0 else None


def choose_threads(requested: int, device: torch.device) -> int | None:
    """Torch's CPU thread count: ``requested`` if given; on the CPU otherwise the cores that are
    idle right now (at least 1), since threads beyond the free cores only contend with other
    jobs; None (torch's default) on accelerators or where idleness cannot be read."""
    if requested:
        return requested
    if device.type != "cpu":
        return None
    free = idle_cores()
    if free is None:
        return None
    return max(1, min(usable_cores(), round(free)))


def check_device(cfg: TrainConfig) -> torch.device:
    """The run's device (:func:`resolve_device`), and a dtype it cannot train in refused: float16
    on the CPU samples inf/nan probabilities within a step or two."""
    device = resolve_device(cfg.device)
    if device.type == "cpu" and cfg.model.dtype == "float16":
        raise UserError(
            "model.dtype=float16 does not train on the CPU (its probabilities overflow to inf or "
            "nan within a step or two); use --model.dtype float32 or bfloat16, or a GPU"
        )
    return device


def check_names(cfg: TrainConfig) -> None:
    """Check every name and value of ``cfg`` that needs no model (the credit method, the task
    and its parameters, the segmenter, the advantage normalisation, a process-reward method's
    value source, the rows ``auto`` reads) so that a typo fails in a moment, before a run
    directory is claimed or a model is built or loaded; each error lists the valid names."""
    check_method_name(cfg.credit_method)
    if cfg.credit_method == AUTO:
        measured_rows()  # the rows auto reads: a bad file is refused before the model loads
    make_params(get_task_class(cfg.task).Params, cfg.task_args, owner=f"task {cfg.task!r}")
    segmenter_from_config(cfg.credit)
    if cfg.credit.normalization != "auto":
        get_normalizer(cfg.credit.normalization)
    if cfg.credit_method == "process_reward":
        cfg.credit.process_reward.require_source()


def resolve_max_new_tokens(cfg: TrainConfig, task: Task) -> None:
    """Fill ``sampling.max_new_tokens = 0`` (auto) from the task's suggestion, in place."""
    if cfg.sampling.max_new_tokens == 0:
        cfg.sampling.max_new_tokens = task.suggested_max_new_tokens() or DEFAULT_MAX_NEW_TOKENS


def resolve_model_defaults(cfg: TrainConfig, tokenizer, log=print) -> None:
    """Fill the fields left empty that default by the policy's kind (``MODEL_DEFAULTS``), in
    place, and say which values were used."""
    kind = model_kind(len(tokenizer))
    filled = []
    for name, value in MODEL_DEFAULTS[kind].items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)
            filled.append(f"{name} {value:g}")
    if filled:
        words = "the built-in character model" if kind == "character" else "a language model"
        log(f"defaults for {words}: {', '.join(filled)} (set them to override)")


# ---------------------------------------------------------------------------------------------
# the policy and the prompts


def load_train_policy(cfg: TrainConfig, task: Task, log=print) -> tuple[Any, Any, str]:
    """The policy to train, its tokenizer and where it came from: ``--init``, else the model's
    default source for the task (the tiny model's warm-start on arithmetic, the shipped real
    model elsewhere); with a LoRA adapter when ``model.lora_r > 0``."""
    read_task_data(task)  # a bad data file is refused before a model is built or loaded
    if cfg.init:
        source = cfg.init
    else:
        source = default_policy_source(
            task,
            cfg.model.name_or_path,
            log=log,
            tiny_shape=cfg.model.tiny_shape(),
            preset=cfg.model.tiny_warmstart,
        )
    dtype = getattr(torch, cfg.model.dtype)
    attn = cfg.model.attn_implementation or ("eager" if cfg.credit_method == "attention" else None)
    flag = "--init" if cfg.init else "--model.name_or_path"
    policy, tokenizer = load_named_policy(flag, source, dtype=dtype, attn_implementation=attn)
    if cfg.model.gradient_checkpointing:
        set_activation_checkpointing(policy, True)
    if cfg.model.lora_r > 0:
        peft = require_extra("peft", "lora", "model.lora_r > 0")
        policy = peft.get_peft_model(
            policy,
            peft.LoraConfig(
                r=cfg.model.lora_r,
                lora_alpha=cfg.model.lora_alpha,
                target_modules=cfg.model.lora_target_modules.split(","),
                task_type="CAUSAL_LM",
            ),
        )
    return policy, tokenizer, source


def prompts_that_fit(
    problems: list[Problem], policy, tokenizer, max_new_tokens: int, name: str, log=print
) -> list[Problem]:
    """``problems`` without the prompts that leave no room for ``max_new_tokens`` in the
    policy's context (all of them where the context is unbounded); ``name`` (``train_pool`` or
    ``eval_set``) says which set in the messages. Nothing left is a ``ValueError``."""
    limit = context_limit(policy)
    if limit is None:
        return problems
    budget = limit - max_new_tokens
    special = prompt_special_tokens(tokenizer)

    def fits(problem: Problem) -> bool:
        text = render_prompt(problem, tokenizer)
        return len(tokenizer(text, add_special_tokens=special)["input_ids"]) <= budget

    kept = [p for p in problems if fits(p)]
    if not kept:
        raise ValueError(
            f"every {'training' if name == 'train_pool' else 'evaluation'} prompt is longer "
            f"than the context allows ({limit} positions minus sampling.max_new_tokens="
            f"{max_new_tokens}); shorten the prompts or lower sampling.max_new_tokens"
        )
    if len(kept) < len(problems):
        log(f"skipping {len(problems) - len(kept)} {name} prompts longer than {budget} tokens")
    return kept


# ---------------------------------------------------------------------------------------------
# the parts of a run


@dataclass(frozen=True)
class TrainParts:
    """What one ``rredcot train`` process trains with (:func:`build_train_parts`)."""

    accelerator: Accelerator
    device: torch.device
    rank: int  # this process's index among ``world`` (``accelerate launch``; 0 of 1 otherwise)
    world: int
    task: Task
    source: str  # where the policy was loaded from
    policy: Any  # the plain policy: sampling, credit, evaluation, checkpoints
    model: Any  # the same policy as ``accelerator.prepare`` wraps it (DDP): the loss forward
    tokenizer: Any
    decoder: str  # the sampling loop that runs: "fast" or "hf" (rollout.resolve_decoder)
    reference: Any | None  # a frozen copy of the initial policy (None when kl_coef == 0)
    segmenter: Segmenter
    method: CreditMethod | None  # None with --credit auto: step 1's batch chooses it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train_pool: list[Problem]  # the prompts the steps draw from (prompts that fit)
    eval_set: list[Problem]  # the greedy-accuracy prompts (prompts that fit)
    # --credit auto: the generators' states where a named method is built, so that the method
    # built after the choice is the one a named run builds (runio.capture_rng_state)
    method_rng: dict[str, Any] | None = None
    micro_batch_tokens: int = 0  # tokens a forward takes at a time (rredcot.sampling.memory)
    generation_rows: int = 0  # rows sampled at a time (rredcot.sampling.memory.generation_rows)


def build_train_parts(cfg: TrainConfig, log=print) -> TrainParts:
    """Build a run's parts from its config, in a fixed order (the seed is set before the task,
    the policy and the credit method, so a seeded run is the same run). Fills
    ``sampling.max_new_tokens = 0`` from the task, in ``cfg``."""
    accelerator = Accelerator(cpu=resolve_device(cfg.device).type == "cpu")
    device = accelerator.device
    threads = choose_threads(cfg.threads, device)
    if threads:
        torch.set_num_threads(threads)
        log(f"torch threads: {threads}" + ("" if cfg.threads else " (auto: the idle cores)"))
    seed_everything(cfg.seed)

    task = get_task(cfg.task, **cfg.task_args)
    resolve_max_new_tokens(cfg, task)
    cfg.refuse_sizes_beyond_memory()  # with the task's length, before the model loads
    policy, tokenizer, source = load_train_policy(cfg, task, log=log)
    resolve_model_defaults(cfg, tokenizer, log)
    policy.to(device)
    decoder = _sampling_decoder(cfg, policy, log)
    reference = None
    if cfg.kl_coef > 0:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    c = cfg.credit
    segmenter = segmenter_from_config(c, task.answer_line_pattern)
    train_pool, eval_set = _prompt_sets(cfg, task, policy, tokenizer, log)
    micro_batch_tokens = resolve_micro_batch_tokens(cfg.micro_batch_tokens, policy, device, log)
    longest = _longest_prompt(train_pool, tokenizer)
    check_run_fits(cfg, policy, device, micro_batch_tokens, longest)
    length = longest + cfg.sampling.max_new_tokens
    max_rows = generation_rows(ModelShape.of(policy), micro_batch_tokens, length)
    method, method_rng = None, None
    if cfg.credit_method == AUTO:  # chosen from step 1's own batch (Trainer.choose_credit)
        method_rng = capture_rng_state()
    else:
        method = build_method(cfg, task, policy, tokenizer, segmenter, device, micro_batch_tokens)
    model, optimizer, scheduler = _optimiser(cfg, policy, accelerator)
    if cfg.sampling.num_generations == 1:
        log(
            "warning: sampling.num_generations=1: each prompt's group is one sample, so its "
            "mean reward is the sample's own and every uniform (GRPO) advantage is 0: the run "
            "learns nothing from group baselines; use 2 or more (default 8)"
        )
    return TrainParts(
        accelerator=accelerator,
        device=device,
        rank=accelerator.process_index,
        world=accelerator.num_processes,
        task=task,
        source=source,
        policy=policy,
        model=model,
        tokenizer=tokenizer,
        decoder=decoder,
        reference=reference,
        segmenter=segmenter,
        method=method,
        optimizer=optimizer,
        scheduler=scheduler,
        train_pool=train_pool,
        eval_set=eval_set,
        method_rng=method_rng,
        micro_batch_tokens=micro_batch_tokens,
        generation_rows=max_rows,
    )


def build_method(
    cfg: TrainConfig, task: Task, policy, tokenizer, segmenter, device, micro_batch_tokens=0
):
    """The run's credit method (``cfg.credit_method``, never ``auto``) from its credit config."""
    return build_credit(
        cfg.credit_method,
        cfg.credit,
        CreditContext(
            policy=policy,
            tokenizer=tokenizer,
            task=task,
            segmenter=segmenter,
            sampling=cfg.sampling,
            device=device,
            micro_batch_tokens=micro_batch_tokens,
        ),
    )


def _sampling_decoder(cfg: TrainConfig, policy, log) -> str:
    """The sampling loop the run uses (``sampling.decoder``; logged); a tree needs the fast one."""
    decoder, why = resolve_decoder(
        policy, cfg.sampling.decoder, cfg.sampling.use_model_generation_config
    )
    log(f"sampling decoder: {decoder} ({why})")
    if cfg.sampling.tree.enabled and decoder != "fast":
        raise UserError(
            f"sampling.tree needs rredcot's fast decoder (it forks its KV cache), but {why}: "
            "use a llama / qwen2 model with sampling.decoder auto, or turn sampling.tree off"
        )
    return decoder


def _optimiser(cfg: TrainConfig, policy, accelerator: Accelerator):
    """``(model, optimizer, scheduler)``: AdamW over the policy's trainable parameters, both
    prepared by ``accelerator``, and the LR schedule counted in optimiser steps."""
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    model, optimizer = accelerator.prepare(policy, optimizer)
    per_step = cfg.epochs_per_batch * cfg.minibatches  # optimiser steps per RL step
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps * per_step, cfg.steps * per_step)
    )
    return model, optimizer, scheduler


def _longest_prompt(problems: list[Problem], tokenizer, sample: int = 256) -> int:
    """Tokens of the longest rendered prompt among the first ``sample`` of ``problems``."""
    special = prompt_special_tokens(tokenizer)
    return max(
        len(tokenizer(render_prompt(p, tokenizer), add_special_tokens=special)["input_ids"])
        for p in problems[:sample]
    )


def _prompt_sets(
    cfg: TrainConfig, task: Task, policy, tokenizer, log
) -> tuple[list[Problem], list[Problem]]:
    """``(train_pool, eval_set)``: the task's problems for ``cfg.seed``, those that fit the
    context with ``sampling.max_new_tokens`` new tokens. A context that cannot hold
    ``max_new_tokens`` at all is refused before any problem is made (a task sized past the
    model, ``--task.num_steps 100000``, took minutes to build its pool first)."""
    limit = context_limit(policy)
    if limit is not None and cfg.sampling.max_new_tokens >= limit:
        raise ValueError(
            f"sampling.max_new_tokens={cfg.sampling.max_new_tokens} (the task's answer length "
            f"where not given) leaves no room for a prompt in the policy's {limit} positions; "
            "lower it, size the task down (e.g. --task.num_steps) or use a model with a longer "
            "context"
        )
    train_pool = task.train_problems(max(4096, cfg.prompts_per_step * 8), seed=cfg.seed)
    eval_set = task.eval_problems(cfg.eval_size, seed=cfg.seed)
    if not train_pool:
        raise ValueError(f"task {cfg.task!r} produced no training problems; check its data")
    max_new = cfg.sampling.max_new_tokens
    train_pool = prompts_that_fit(train_pool, policy, tokenizer, max_new, "train_pool", log)
    eval_set = prompts_that_fit(eval_set, policy, tokenizer, max_new, "eval_set", log)
    return train_pool, eval_set

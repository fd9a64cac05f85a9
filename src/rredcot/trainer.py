"""The RL loop of docs/method.md (the RL step), read top to bottom:

sample G completions per prompt -> verify -> segment -> one no-grad forward (old log-probs and
hidden states) -> credit method -> token advantages -> clipped policy-gradient loss (+ KL to a
frozen reference) over several epochs and minibatches -> the credit method's own update (the
value head trains on the outcomes only after their credit was computed).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from rredcot import credit as credit_algebra
from rredcot import runio
from rredcot.batch import RolloutBatch
from rredcot.config import (
    TrainConfig,
    read_yaml_file,
    resume_config,
    to_dict,
    write_text_atomic,
)
from rredcot.errors import UserError
from rredcot.loss import lr_lambda, policy_loss
from rredcot.methods.base import CreditContext, build_credit
from rredcot.rollout import (
    build_rollout_batch,
    context_limit,
    fill_forward,
    greedy_accuracy,
    policy_forward,
    prompt_special_tokens,
    render_prompt,
    resolve_decoder,
    segment_batch,
    train_mode_without_dropout,
)
from rredcot.seeding import seed_everything, step_seed
from rredcot.segment import get_segmenter
from rredcot.sft import default_policy_source
from rredcot.tasks import get_task


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


def resolve_device(name: str) -> torch.device:
    """The torch device of ``--device``; a device this machine does not have is a ``UserError``
    (training on the CPU instead would be a silent surprise)."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise UserError(f"--device {name!r} is not a device; use auto, cpu, cuda or mps") from err
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(
                f"--device {name}: no CUDA GPU is visible on this machine "
                "(torch.cuda.is_available() is False); use --device cpu or auto"
            )
        if device.index is not None and device.index >= count:
            raise UserError(f"--device {name}: this machine has {count} CUDA GPU(s); use cuda:0")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {name}: MPS is not available here; use --device cpu or auto")
    return device


DEFAULT_MAX_NEW_TOKENS = 64


def resolve_max_new_tokens(cfg: TrainConfig, task) -> None:
    """Fill ``sampling.max_new_tokens = 0`` (auto) from the task's suggestion, in place."""
    if cfg.sampling.max_new_tokens == 0:
        cfg.sampling.max_new_tokens = task.suggested_max_new_tokens() or DEFAULT_MAX_NEW_TOKENS


# ---------------------------------------------------------------------------------------------
# the trainer


class Trainer:
    """``rredcot train``: one object that owns the policy, the credit method and the run dir."""

    def __init__(self, cfg: TrainConfig, *, log=print) -> None:
        self.cfg = cfg
        self.log = log
        self.run_dir = Path(cfg.out)
        resolve_device(cfg.device)  # refuse a device the machine lacks before anything else
        self._lock: runio.RunLock | None = None
        if _is_main_process():  # one writer per run directory, and no silent reuse of a run
            self._lock = runio.claim_run_dir(
                self.run_dir, resume=bool(cfg.resume), overwrite=cfg.overwrite
            )
        try:
            # a resume that cannot work is refused before minutes of loading
            self._resume_from = self._resume_checkpoint() if cfg.resume else None
            self._setup()
        except BaseException:
            self.release()
            raise
        if cfg.sampling.num_generations == 1:
            self.log(
                "warning: sampling.num_generations=1: each prompt's group is one sample, so its "
                "mean reward is the sample's own and every uniform (GRPO) advantage is 0: the run "
                "learns nothing from group baselines; use 2 or more (default 8)"
            )

    def release(self) -> None:
        """Give up the run directory's lock (at the end of ``train``; idempotent)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _setup(self) -> None:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=resolve_device(cfg.device).type == "cpu")
        self.device = self.accelerator.device
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        threads = choose_threads(cfg.threads, self.device)
        if threads:
            torch.set_num_threads(threads)
            self.log(
                f"torch threads: {threads}" + ("" if cfg.threads else " (auto: the idle cores)")
            )
        seed_everything(cfg.seed)

        self.task = get_task(cfg.task, **cfg.task_args)
        resolve_max_new_tokens(cfg, self.task)
        self.policy, self.tokenizer = self._load_policy()
        self.policy.to(self.device)
        self.decoder, why = resolve_decoder(
            self.policy, cfg.sampling.decoder, cfg.sampling.use_model_generation_config
        )
        self.log(f"sampling decoder: {self.decoder} ({why})")
        self.reference = None
        if cfg.kl_coef > 0:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        c = cfg.credit
        self.segmenter = get_segmenter(
            c.segmenter,
            min_chars=c.min_chars,
            max_segments=c.max_segments or None,
            separate_answer=c.separate_answer,
        )
        self.method = build_credit(
            cfg.credit_method,
            c,
            CreditContext(
                policy=self.policy,
                tokenizer=self.tokenizer,
                task=self.task,
                segmenter=self.segmenter,
                sampling=cfg.sampling,
                device=self.device,
            ),
        )
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
        # Under `accelerate launch` the loss forward runs through the DDP-wrapped `self.model`;
        # sampling, credit, evaluation and checkpoints use the plain `self.policy`.
        self.model, self.optimizer = self.accelerator.prepare(self.policy, self.optimizer)
        optim_steps = cfg.steps * cfg.epochs_per_batch * cfg.minibatches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lr_lambda(
                cfg.lr_schedule,
                cfg.warmup_steps * cfg.epochs_per_batch * cfg.minibatches,
                optim_steps,
            ),
        )
        self.train_pool = self.task.train_problems(
            max(4096, cfg.prompts_per_step * 8), seed=cfg.seed
        )
        self.eval_set = self.task.eval_problems(cfg.eval_size, seed=cfg.seed)
        if not self.train_pool:
            raise ValueError(f"task {cfg.task!r} produced no training problems; check its data")
        self._check_prompt_lengths()
        self.metrics = runio.MetricsLog(self.run_dir / "metrics.jsonl")
        self.step = 0
        self.samples_seen = 0
        self.tokens_generated = 0
        self.extra_tokens_generated = 0  # generated by the credit method (Monte Carlo)
        self.skipped_total = 0
        self.sink = _MetricSink(cfg.report_to, self.run_dir)

    # -- set-up ---------------------------------------------------------------------------
    def _load_policy(self):
        from rredcot.models import load_policy

        cfg = self.cfg
        if cfg.init:
            source = cfg.init
        else:  # the tiny model's warm-start on arithmetic, the shipped real model elsewhere
            source = default_policy_source(
                self.task, cfg.model.name_or_path, log=self.log, tiny_shape=cfg.model.tiny_shape()
            )
        dtype = getattr(torch, cfg.model.dtype)
        attn = cfg.model.attn_implementation or (
            "eager" if cfg.credit_method == "attention" else None
        )
        flag = "--init" if cfg.init else "--model.name_or_path"
        local = Path(source).expanduser()
        if local.is_dir() and not (local / "config.json").exists():
            raise UserError(
                f"{flag} {source}: no model there (no config.json); pass a directory written by "
                "`rredcot sft` or save_pretrained, or a hub model id"
            )
        if local.is_file():
            raise UserError(f"{flag} {source} is a file; pass a model directory or a hub model id")
        from safetensors import SafetensorError

        try:
            policy, tokenizer = load_policy(source, dtype=dtype, attn_implementation=attn)
        except (OSError, SafetensorError) as err:  # unreadable or cut model files: the user's
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise UserError(f"{flag} {source}: the model does not load ({first})") from err
        if cfg.model.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        if cfg.model.lora_r > 0:
            try:
                from peft import LoraConfig, get_peft_model
            except ImportError as err:
                raise ImportError(
                    "model.lora_r > 0 needs peft: pip install 'rredcot[lora]'"
                ) from err
            policy = get_peft_model(
                policy,
                LoraConfig(
                    r=cfg.model.lora_r,
                    lora_alpha=cfg.model.lora_alpha,
                    target_modules=cfg.model.lora_target_modules.split(","),
                    task_type="CAUSAL_LM",
                ),
            )
        self.source = source
        return policy, tokenizer

    def _check_prompt_lengths(self) -> None:
        """Drop training and evaluation prompts that leave no room for ``max_new_tokens``."""
        limit = context_limit(self.policy)
        if limit is None:
            return
        budget = limit - self.cfg.sampling.max_new_tokens
        special = prompt_special_tokens(self.tokenizer)

        def fits(problem) -> bool:
            text = render_prompt(problem, self.tokenizer)
            return len(self.tokenizer(text, add_special_tokens=special)["input_ids"]) <= budget

        for name in ("train_pool", "eval_set"):
            problems = getattr(self, name)
            kept = [p for p in problems if fits(p)]
            if not kept:
                raise ValueError(
                    f"every {'training' if name == 'train_pool' else 'evaluation'} prompt is longer "
                    f"than the context allows ({limit} positions minus sampling.max_new_tokens="
                    f"{self.cfg.sampling.max_new_tokens}); shorten the prompts or lower "
                    "sampling.max_new_tokens"
                )
            if len(kept) < len(problems):
                self.log(
                    f"skipping {len(problems) - len(kept)} {name} prompts longer than {budget} tokens"
                )
            setattr(self, name, kept)

    # -- the prompt stream: a function of (seed, step), so every method sees the same prompts --
    def prompts_for_step(self, step: int):
        rng = random.Random(step_seed(self.cfg.seed, step, salt=17))
        return [
            self.train_pool[rng.randrange(len(self.train_pool))]
            for _ in range(self.cfg.prompts_per_step)
        ]

    # -- sampling -----------------------------------------------------------------------------
    def rollout(self, problems, forward: bool = True) -> tuple[RolloutBatch, dict[str, float]]:
        """Sample, verify and segment G completions per problem with the current policy (the
        caller seeds); with ``forward`` also fill the old log-probs and hidden states."""
        s = self.cfg.sampling
        self.policy.eval()
        batch, stats = build_rollout_batch(
            self.policy,
            self.tokenizer,
            self.task,
            problems,
            self.segmenter,
            num_generations=s.num_generations,
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            use_model_generation_config=s.use_model_generation_config,
            decoder=self.decoder,
        )
        if forward:
            batch = self._fill_forward(batch)
        return batch, stats

    def _fill_forward(self, batch: RolloutBatch) -> RolloutBatch:
        """The separate no-grad scoring pass (off-policy updates, evaluation probes)."""
        layers = self.method.hidden_layers if self.method.needs_hidden_states else None
        batch = fill_forward(
            self.policy,
            batch,
            hidden_layers=layers,
            temperature=self.cfg.sampling.temperature,
            shared_prompt=self.cfg.shared_prompt_forward,
            with_entropy=self.segmenter.uses_entropy,
        )
        if self.segmenter.uses_entropy:
            batch = segment_batch(batch, self.tokenizer, self.segmenter, batch.entropies)
        return batch

    # -- one RL step ------------------------------------------------------------------------
    def single_pass(self) -> bool:
        """Whether the loss forward is the step's only policy forward: an on-policy update (one
        epoch, one minibatch, no accumulation), where the old log-probs are the new ones
        detached and the hidden states and entropies the credit reads come from the same pass."""
        c = self.cfg
        return (
            c.single_forward
            and c.epochs_per_batch == 1
            and c.minibatches == 1
            and c.grad_accumulation == 1
        )

    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor | None:
        if self.reference is None:
            return None
        with torch.no_grad():
            return policy_forward(
                self.reference,
                batch.input_ids,
                batch.attention_mask,
                batch.prompt_len,
                temperature=self.cfg.sampling.temperature,
                shared_prompt=self.cfg.shared_prompt_forward,
            ).logprobs

    def train_step(self, step: int) -> dict[str, Any]:
        """One RL step, top to bottom: rollout -> forward -> credit -> loss and update -> the
        credit method's own update -> the step's record."""
        clock = _StepClock()
        problems = self.prompts_for_step(step)[self.rank :: self.world]
        seed_everything(step_seed(self.cfg.seed, step, salt=self.rank))
        batch, stats = self.rollout(problems, forward=False)  # sample, verify, segment
        if batch.size == 0:
            raise RuntimeError(
                f"step {step}: the verifier rejected every sample (errors or non-finite rewards); "
                "fix the task's verify() so that it returns a finite reward for model output"
            )
        clock.lap("rollout")
        ref_logprobs = self._reference_logprobs(batch)  # the KL reference's own forward
        clock.lap("reference")

        # The forward the credit reads: on-policy, the loss forward itself (run first only for
        # methods that read it: hidden states, entropy cuts); otherwise a no-grad scoring pass.
        loss_forward = None
        if not self.single_pass():
            batch = self._fill_forward(batch)
            clock.lap("old_logprobs")
        elif self.method.needs_hidden_states or self.segmenter.uses_entropy:
            batch, loss_forward = self._loss_forward(batch)
            clock.lap("update")

        credit_out = self.method.compute(batch)
        clock.lap("credit")

        if self.single_pass() and loss_forward is None:
            batch, loss_forward = self._loss_forward(batch)
        advantages = credit_out.advantages.detach()
        update_stats = self._optimise(batch, advantages, ref_logprobs, loss_forward)
        clock.lap("update")

        value_stats = self.method.update(batch)
        clock.lap("value_update")
        return self._record(
            step, batch, stats, credit_out, update_stats, value_stats, clock, loss_forward is None
        )

    def _record(
        self, step, batch, stats, credit_out, update_stats, value_stats, clock, scoring_pass
    ) -> dict[str, Any]:
        """Count the step into the run's totals and return its metrics record."""
        B = batch.size
        self.samples_seen += B
        self.tokens_generated += int(stats["rollout/tokens"])
        self.extra_tokens_generated += int(credit_out.cost.extra_generated_tokens)
        self.skipped_total += int(stats["rollout/skipped_samples"])
        stats["rollout/mean_segments"] = sum(len(b) - 1 for b in batch.boundaries) / B
        mask = batch.response_mask
        advantages = credit_out.advantages.detach()
        return {
            "step": step,
            "samples_seen": self.samples_seen,
            "tokens_generated": self.tokens_generated,
            "extra_tokens_generated": self.extra_tokens_generated,
            "reward_mean": float(batch.rewards.mean()),
            "reward_std": float(batch.rewards.std()) if B > 1 else 0.0,
            **update_stats,
            "advantage_abs_mean": float(credit_algebra.masked_mean(advantages.abs(), mask))
            if mask.any()
            else 0.0,
            "zero_variance_groups": _zero_variance_groups(batch.rewards, batch.group_ids),
            "skipped_samples_total": self.skipped_total,
            "lr": self.scheduler.get_last_lr()[0],
            **stats,
            **credit_out.metrics,
            **value_stats,
            "forward/scoring_pass": 1.0 if scoring_pass else 0.0,
            **{f"time/{name}": seconds for name, seconds in clock.laps.items()},
            "step_seconds": clock.total,
        }

    def _loss_forward(self, batch: RolloutBatch) -> tuple[RolloutBatch, Any]:
        """The single pass: the loss forward over the whole batch (with grad). Returns the batch
        with its detached log-probs, hidden states (and entropy segments) for the credit method,
        and the forward itself, whose graph the loss uses."""
        train_mode_without_dropout(self.model)
        layers = self.method.hidden_layers if self.method.needs_hidden_states else None
        fwd = policy_forward(
            self.model,
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_len,
            with_entropy=True,
            hidden_layers=layers,
            temperature=self.cfg.sampling.temperature,
            shared_prompt=self.cfg.shared_prompt_forward,
        )
        hidden = None if fwd.hidden_states is None else fwd.hidden_states.detach()
        batch = batch.replace(old_logprobs=fwd.logprobs.detach(), hidden_states=hidden)
        if self.segmenter.uses_entropy:
            batch = segment_batch(batch, self.tokenizer, self.segmenter, fwd.entropy.detach())
        return batch, fwd

    def _optimise(
        self, batch: RolloutBatch, advantages: torch.Tensor, ref_logprobs, loss_forward=None
    ) -> dict[str, float]:
        """Epochs x minibatches of optimiser steps; returns each metric's mean over the steps.
        With ``loss_forward`` (the single pass, :meth:`single_pass`) the one minibatch is the
        whole batch in its own order and its graph is that forward's."""
        cfg = self.cfg
        train_mode_without_dropout(self.model)
        gen = torch.Generator().manual_seed(step_seed(cfg.seed, self.step, salt=29))
        steps: list[dict[str, float]] = []
        for _ in range(cfg.epochs_per_batch):
            order = torch.randperm(batch.size, generator=gen)
            if loss_forward is not None:
                order = torch.arange(batch.size)  # the forward already ran in batch order
            for rows in order.chunk(cfg.minibatches):
                steps.append(
                    self._minibatch_step(batch, rows, advantages, ref_logprobs, loss_forward)
                )
        return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]} if steps else {}

    def _minibatch_step(
        self, batch: RolloutBatch, rows: torch.Tensor, advantages, ref_logprobs, loss_forward
    ) -> dict[str, float]:
        """One optimiser step on ``rows``, accumulated over ``grad_accumulation`` micro-batches
        (gradients are synchronised across processes on the last one only)."""
        cfg = self.cfg
        rows = rows.to(self.device)
        num_tokens = float(batch.response_mask[rows].sum())
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {"policy_loss": 0.0, "entropy": 0.0}
        micros = rows.chunk(cfg.grad_accumulation)
        for i, micro in enumerate(micros):
            last = i == len(micros) - 1
            with contextlib.nullcontext() if last else self.accelerator.no_sync(self.model):
                fwd = loss_forward
                if fwd is None:
                    fwd = policy_forward(
                        self.model,
                        batch.input_ids[micro],
                        batch.attention_mask[micro],
                        batch.prompt_len,
                        with_entropy=True,
                        temperature=cfg.sampling.temperature,
                        shared_prompt=cfg.shared_prompt_forward,
                    )
                rmask = batch.response_mask[micro]
                loss, stats = policy_loss(
                    fwd.logprobs,
                    batch.old_logprobs[micro],
                    advantages[micro],
                    rmask,
                    num_rows=len(rows),
                    num_tokens=num_tokens,
                    **cfg.loss_settings(),
                    ref_logprobs=None if ref_logprobs is None else ref_logprobs[micro],
                    kl_coef=cfg.kl_coef,
                )
                self.accelerator.backward(loss)
            share = float(rmask.sum()) / max(num_tokens, 1.0)  # this micro-batch's token share
            totals["policy_loss"] += loss.item()
            totals["entropy"] += float((fwd.entropy.detach() * rmask).sum()) / max(num_tokens, 1.0)
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v * share
        params = [p for p in self.policy.parameters() if p.requires_grad]
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        totals["grad_norm"] = float(self.accelerator.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        self.scheduler.step()
        return totals

    def _pretrain_credit(self) -> None:
        """Fit a learned estimator (the value head) on the warm-start policy's own samples before
        RL, so that its credit is informed from the first step (docs/method.md, value sources)."""
        pretrain = getattr(self.method, "pretrain", None)
        if pretrain is None:
            raise ValueError(
                f"credit.value_pretrain_steps > 0, but credit method {self.cfg.credit_method!r} "
                "learns nothing; set it to 0"
            )
        cfg = self.cfg
        counter = iter(range(1, 1 << 30))

        def sample_batch() -> RolloutBatch:
            i = next(counter)
            # Negative "steps": a prompt and sampling stream disjoint from the RL steps'.
            problems = self.prompts_for_step(-i)[self.rank :: self.world]
            seed_everything(step_seed(cfg.seed, -i, salt=self.rank))
            batch, stats = self.rollout(problems)
            # Samples drawn for the credit method, not the policy: paid from the token budget.
            self.extra_tokens_generated += int(stats["rollout/tokens"])
            return batch

        stats = pretrain(sample_batch, cfg.credit.value_pretrain_steps)
        self.log(
            "value pretraining: "
            + ", ".join(f"{k.split('/')[-1]}={v:.3f}" for k, v in stats.items())
        )
        if self.accelerator.is_main_process:
            write_text_atomic(self.run_dir / "value_pretrain.json", json.dumps(stats, indent=2))

    # -- evaluation, checkpoints, the loop ----------------------------------------------------
    def evaluate(self) -> float:
        return greedy_accuracy(
            self.policy,
            self.tokenizer,
            self.task,
            self.eval_set,
            self.cfg.sampling.max_new_tokens,
            decoder=self.decoder,
        )

    def save(self) -> Path:
        state = {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "tokens_generated": self.tokens_generated,
            "extra_tokens_generated": self.extra_tokens_generated,
            "skipped_total": self.skipped_total,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "credit_method": self.method.state_dict(),
            "rng": runio.capture_rng_state(),
        }
        return runio.save_checkpoint(
            self.run_dir,
            self.step,
            self.policy,
            self.tokenizer,
            state,
            keep=self.cfg.keep_checkpoints,
        )

    def restore(self, ckpt: Path) -> None:
        from rredcot.models import load_policy

        state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=False)
        policy, _ = load_policy(str(ckpt / "policy"), dtype=getattr(torch, self.cfg.model.dtype))
        self.policy.load_state_dict(policy.state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.method.load_state_dict(state["credit_method"])
        runio.restore_rng_state(state["rng"])
        self.step = state["step"]
        self.samples_seen = state["samples_seen"]
        self.tokens_generated = state["tokens_generated"]
        self.extra_tokens_generated = state.get("extra_tokens_generated", 0)
        self.skipped_total = state["skipped_total"]
        self.metrics.truncate_after(self.step)

    def budget_spent(self) -> bool:
        """Whether ``max_tokens_generated`` is reached (policy rollouts + credit generations,
        summed over processes)."""
        budget = self.cfg.max_tokens_generated
        if budget <= 0:
            return False
        used = torch.tensor(float(self.tokens_generated + self.extra_tokens_generated))
        if self.world > 1:
            used = self.accelerator.reduce(used.to(self.device), reduction="sum")
        return float(used) >= budget

    def train(self) -> dict[str, Any]:
        """Run (or, with ``cfg.resume``, resume) the loop; returns start/final accuracy. The run
        directory's lock is released when it returns or raises."""
        try:
            return self._train()
        finally:
            self.release()

    def _write_config(self) -> None:
        """``config.yaml``, written atomically, and only when it changes (a resume with more
        steps); ``out``/``resume``/``overwrite`` say how a run was started, not what it is."""
        path = self.run_dir / runio.CONFIG
        record = to_dict(self.cfg)
        record.update(resume=None, overwrite=False)
        if self.cfg.resume and path.exists():
            record["out"] = (read_yaml_file(path) or {}).get("out", record["out"])
        text = yaml.safe_dump(record, sort_keys=False)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            write_text_atomic(path, text)

    def _resume_checkpoint(self) -> Path | None:
        """The newest valid checkpoint to resume from, saying which newer ones were skipped and
        why; a resume that would restart over recorded steps is refused."""
        main = _is_main_process()
        ckpt, skipped = runio.find_checkpoint(self.run_dir)
        for path, reason in skipped if main else []:
            self.log(f"skipping checkpoint {path.name}: {reason}")
        if ckpt is not None:
            if skipped and main:
                self.log(f"resuming from the older checkpoint {ckpt.name} instead")
            return ckpt
        if self.cfg.resume:
            metrics = runio.MetricsLog(self.run_dir / runio.METRICS).read()
            recorded = [r["step"] for r in metrics if r.get("step", 0) > 0]
            if recorded or skipped:
                why = "; ".join(f"{p.name}: {r}" for p, r in skipped) or "none found"
                raise UserError(
                    f"--resume {self.run_dir}: no valid checkpoint left ({why}) but "
                    f"{runio.METRICS} records steps up to {max(recorded, default=0)}; resuming "
                    "would restart over that history. Start the run again with --overwrite, or "
                    "pick another --out"
                )
            if main:
                self.log(f"{self.run_dir}: no checkpoint and no step recorded yet: from step 0")
        return None

    def _train(self) -> dict[str, Any]:
        cfg = self.cfg
        main = self.accelerator.is_main_process
        ckpt = self._resume_from  # chosen (and verified) before the policy was loaded
        if main:
            self._write_config()
        if ckpt is not None:
            self.restore(ckpt)
            self.log(f"resumed from {ckpt} at step {self.step}")
            if self.step >= cfg.steps:
                self.log(f"the run is at step {self.step} already (steps={cfg.steps})")
        elif main:
            self.metrics.truncate_after(-1)
        if self.step == 0 and cfg.credit.value_pretrain_steps > 0:
            self._pretrain_credit()
        if self.step == 0 and main:
            acc0 = self.evaluate()
            self.metrics.append(
                {
                    "step": 0,
                    "samples_seen": 0,
                    "tokens_generated": 0,
                    "extra_tokens_generated": 0,
                    "eval_accuracy": acc0,
                }
            )
            self.sink.log({"eval_accuracy": acc0}, 0)
        records = self.metrics.read()
        start_acc = next((r["eval_accuracy"] for r in records if r.get("step") == 0), None)
        last_acc = next(
            (r["eval_accuracy"] for r in reversed(records) if r.get("eval_accuracy") is not None),
            start_acc,
        )
        bar = _progress(cfg.progress and main, total=cfg.steps, initial=self.step)
        while self.step < cfg.steps and not self.budget_spent():
            self.step += 1
            record = self.train_step(self.step)
            last = self.step == cfg.steps or self.budget_spent()
            if main and ((cfg.eval_every and self.step % cfg.eval_every == 0) or last):
                last_acc = self.evaluate()
                record["eval_accuracy"] = last_acc
            if main:
                self.metrics.append(record)
                self.sink.log(record, self.step)
            if self.step % cfg.checkpoint_every == 0 or last:
                if main:
                    self.save()
                self.accelerator.wait_for_everyone()
            if bar is not None:
                bar.set_postfix(reward=f"{record['reward_mean']:.2f}", acc=f"{last_acc or 0:.2f}")
                bar.update(1)
        if bar is not None:
            bar.close()
        self.sink.close()
        if main:
            try:
                from rredcot.plots import plot_run

                plot_run(self.run_dir)
            except Exception as err:  # noqa: BLE001 - plots are a convenience, never fatal
                self.log(f"plotting skipped: {err}")
        return {
            "start_accuracy": start_acc,
            "final_accuracy": last_acc,
            "steps": self.step,
            "tokens_generated": self.tokens_generated,
            "extra_tokens_generated": self.extra_tokens_generated,
            "stopped_by_budget": self.budget_spent(),
            "run_dir": str(self.run_dir),
        }


class _StepClock:
    """Seconds of a step by phase: each :meth:`lap` adds the time since the last one."""

    PHASES = ("rollout", "reference", "old_logprobs", "credit", "update", "value_update")

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.laps = dict.fromkeys(self.PHASES, 0.0)

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] += now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start


def _zero_variance_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of prompt groups whose G rewards are all equal (no GRPO signal)."""
    groups = group_ids.unique()
    zero = sum(int(rewards[group_ids == g].std(unbiased=False) == 0) for g in groups)
    return zero / max(len(groups), 1)


def _progress(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="rl", unit="step", dynamic_ncols=True)


class _MetricSink:
    """Optional TensorBoard / Weights & Biases logging; metrics.jsonl is always written."""

    def __init__(self, kind: str, run_dir: Path) -> None:
        self.kind = kind
        self.writer = None
        if kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError(
                    "report_to=tensorboard needs tensorboard: pip install tensorboard"
                ) from err
            self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        elif kind == "wandb":
            try:
                import wandb
            except ImportError as err:
                raise ImportError("report_to=wandb needs wandb: pip install wandb") from err
            self.writer = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "rredcot"), dir=str(run_dir)
            )

    def log(self, record: dict[str, Any], step: int) -> None:
        if self.writer is None:
            return
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.kind == "tensorboard":
            for k, v in numeric.items():
                self.writer.add_scalar(k, v, step)
        else:
            self.writer.log(numeric, step=step)

    def close(self) -> None:
        if self.writer is not None:
            (self.writer.close if self.kind == "tensorboard" else self.writer.finish)()


def _is_main_process() -> bool:
    """Rank 0 of an ``accelerate launch`` / ``torchrun`` job (or a plain single process)."""
    return int(os.environ.get("RANK", "0")) == 0


def train(cfg: TrainConfig, log=print, given: set[str] | None = None) -> dict[str, Any]:
    """Run (or resume) training and return start/final accuracy.

    With ``cfg.resume`` the run's own ``config.yaml`` is the config and only the fields named in
    ``given`` (dotted names set on the command line or in ``--config``; by default the fields where
    ``cfg`` differs from the defaults) apply over it; a change to a field outside
    ``config.RESUMABLE_FIELDS`` is refused, every one named (``config.resume_config``)."""
    if cfg.resume:
        cfg = resume_config(cfg, given)
    return Trainer(cfg, log=log).train()


__all__ = ["Trainer", "train", "policy_loss"]

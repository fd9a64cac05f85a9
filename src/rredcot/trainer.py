"""The RL loop of DESIGN.md section 5, read top to bottom:

sample G completions per prompt -> verify -> segment -> one no-grad forward (old log-probs and
hidden states) -> credit method -> token advantages -> clipped policy-gradient loss (+ KL to a
frozen reference) over several epochs and minibatches -> the credit method's own update (the
value head trains on the outcomes only after their credit was computed).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rredcot import credit as credit_algebra
from rredcot import runio
from rredcot.config import TrainConfig, save_yaml
from rredcot.methods.base import CreditContext, RolloutBatch, build_credit
from rredcot.rollout import (
    build_rollout_batch,
    context_limit,
    fill_forward,
    greedy_accuracy,
    policy_forward,
    prompt_special_tokens,
    render_prompt,
    train_mode_without_dropout,
)
from rredcot.segment import get_segmenter
from rredcot.tasks import get_task


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    return torch.device(name)


DEFAULT_MAX_NEW_TOKENS = 64


def resolve_max_new_tokens(cfg: TrainConfig, task) -> None:
    """Fill ``sampling.max_new_tokens = 0`` (auto) from the task's suggestion, in place."""
    if cfg.sampling.max_new_tokens == 0:
        cfg.sampling.max_new_tokens = task.suggested_max_new_tokens() or DEFAULT_MAX_NEW_TOKENS


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A seed for one step's randomness, so that a resumed run samples what the original did."""
    return (seed * 1_000_003 + step * 9_973 + salt) % 2**31


# ---------------------------------------------------------------------------------------------
# the loss


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    loss_agg: str,
    num_rows: int,
    num_tokens: float,
    max_len: int,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss (PPO ratio, ε-low/ε-high) with an optional k3 KL penalty.

    Args:
        logprobs, old_logprobs, advantages, response_mask: ``(b, T)`` for a micro-batch.
        num_rows, num_tokens: rows and valid tokens of the whole minibatch, so that micro-batches
            accumulate to the minibatch's aggregate.
        max_len: ``T_max`` of Dr. GRPO's constant normaliser.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped  # the clipped branch won: this token's gradient is cut
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None and kl_coef > 0:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
    mask = response_mask
    if loss_agg == "token_mean":
        loss = (per_token * mask).sum() / max(num_tokens, 1.0)
    elif loss_agg == "seq_mean":
        lengths = mask.sum(-1).clamp_min(1.0)
        loss = ((per_token * mask).sum(-1) / lengths).sum() / max(num_rows, 1)
    elif loss_agg == "dr_grpo":
        loss = (per_token * mask).sum() / (max(num_rows, 1) * max_len)
    else:
        raise ValueError(f"loss_agg={loss_agg!r}: use token_mean, seq_mean or dr_grpo")
    with torch.no_grad():
        n = mask.sum().clamp_min(1.0)
        stats = {
            "clip_fraction": float((was_clipped.float() * mask).sum() / n),
            "kl": float((kl * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
        }
    return loss, stats


def lr_lambda(schedule: str, warmup: int, total: int):
    def fn(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        progress = min(max(progress, 0.0), 1.0)
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return fn


# ---------------------------------------------------------------------------------------------
# the trainer


class Trainer:
    """``rredcot train``: one object that owns the policy, the credit method and the run dir."""

    def __init__(self, cfg: TrainConfig, *, log=print) -> None:
        self.cfg = cfg
        self.log = log
        self.run_dir = Path(cfg.out)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=resolve_device(cfg.device).type == "cpu")
        self.device = self.accelerator.device
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        seed_everything(cfg.seed)

        self.task = get_task(cfg.task, **cfg.task_args)
        resolve_max_new_tokens(cfg, self.task)
        self.policy, self.tokenizer = self._load_policy()
        if not cfg.threads and self.device.type == "cpu" and _num_params(self.policy) < 20_000_000:
            torch.set_num_threads(1)  # tiny models: more threads only add contention
        self.policy.to(self.device)
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
        from rredcot.models import default_policy_source, load_policy

        cfg = self.cfg
        if cfg.init:
            source = cfg.init
        else:  # the tiny model's warm-start on arithmetic, the shipped real model elsewhere
            source = default_policy_source(self.task, cfg.model.name_or_path, log=self.log)
        dtype = getattr(torch, cfg.model.dtype)
        attn = cfg.model.attn_implementation or (
            "eager" if cfg.credit_method == "attention" else None
        )
        policy, tokenizer = load_policy(source, dtype=dtype, attn_implementation=attn)
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
        )
        if forward:
            self._fill_forward(batch)
        return batch, stats

    def _fill_forward(self, batch: RolloutBatch) -> None:
        layers = self.method.hidden_layers if self.method.needs_hidden_states else None
        fill_forward(
            self.policy, batch, hidden_layers=layers, temperature=self.cfg.sampling.temperature
        )

    # -- one RL step ------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.perf_counter()
        problems = self.prompts_for_step(step)[self.rank :: self.world]
        seed_everything(step_seed(cfg.seed, step, salt=self.rank))
        batch, stats = self.rollout(problems, forward=False)
        if batch.size == 0:
            raise RuntimeError(
                f"step {step}: the verifier rejected every sample (errors or non-finite rewards); "
                "fix the task's verify() so that it returns a finite reward for model output"
            )
        t_rollout = time.perf_counter()
        self._fill_forward(batch)
        ref_logprobs = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logprobs = policy_forward(
                    self.reference,
                    batch.input_ids,
                    batch.attention_mask,
                    batch.prompt_len,
                    temperature=cfg.sampling.temperature,
                ).logprobs
        t_old = time.perf_counter()
        credit_out = self.method.compute(batch)
        t_credit = time.perf_counter()
        advantages = credit_out.advantages.detach()
        update_stats = self._optimise(batch, advantages, ref_logprobs)
        t_update = time.perf_counter()
        value_stats = self.method.update(batch)
        t_end = time.perf_counter()

        B = batch.size
        self.samples_seen += B
        self.tokens_generated += int(stats["rollout/tokens"])
        self.extra_tokens_generated += int(
            credit_out.metrics.get("credit/extra_generated_tokens", 0)
        )
        self.skipped_total += int(stats["rollout/skipped_samples"])
        mask = batch.response_mask
        zero_var_groups = _zero_variance_groups(batch.rewards, batch.group_ids)
        record = {
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
            "zero_variance_groups": zero_var_groups,
            "skipped_samples_total": self.skipped_total,
            "lr": self.scheduler.get_last_lr()[0],
            **stats,
            **credit_out.metrics,
            **value_stats,
            "time/rollout": t_rollout - t0,
            "time/old_logprobs": t_old - t_rollout,
            "time/credit": t_credit - t_old,
            "time/update": t_update - t_credit,
            "time/value_update": t_end - t_update,
            "step_seconds": t_end - t0,
        }
        return record

    def _optimise(
        self, batch: RolloutBatch, advantages: torch.Tensor, ref_logprobs
    ) -> dict[str, float]:
        cfg = self.cfg
        train_mode_without_dropout(self.model)
        B = batch.size
        T_max = cfg.sampling.max_new_tokens
        gen = torch.Generator().manual_seed(step_seed(cfg.seed, self.step, salt=29))
        sums: dict[str, float] = {}
        count = 0
        for _ in range(cfg.epochs_per_batch):
            order = torch.randperm(B, generator=gen)
            for mb in order.chunk(cfg.minibatches):
                mb = mb.to(self.device)
                num_tokens = float(batch.response_mask[mb].sum())
                self.optimizer.zero_grad(set_to_none=True)
                loss_total, entropy_sum, micro_stats = 0.0, 0.0, {}
                micros = mb.chunk(cfg.grad_accumulation)
                for i, micro in enumerate(micros):
                    sync = i == len(micros) - 1
                    ctx = contextlib.nullcontext() if sync else self.accelerator.no_sync(self.model)
                    with ctx:
                        fwd = policy_forward(
                            self.model,
                            batch.input_ids[micro],
                            batch.attention_mask[micro],
                            batch.prompt_len,
                            with_entropy=True,
                            temperature=cfg.sampling.temperature,
                        )
                        rmask = batch.response_mask[micro]
                        loss, st = policy_loss(
                            fwd.logprobs,
                            batch.old_logprobs[micro],
                            advantages[micro],
                            rmask,
                            clip_eps_low=cfg.clip_eps_low,
                            clip_eps_high=cfg.clip_eps_high,
                            loss_agg=cfg.loss_agg,
                            num_rows=len(mb),
                            num_tokens=num_tokens,
                            max_len=T_max,
                            ref_logprobs=None if ref_logprobs is None else ref_logprobs[micro],
                            kl_coef=cfg.kl_coef,
                        )
                        self.accelerator.backward(loss)
                        loss_total += loss.item()
                        entropy_sum += float((fwd.entropy.detach() * rmask).sum())
                        for k, v in st.items():
                            micro_stats[k] = micro_stats.get(k, 0.0) + v * float(rmask.sum()) / max(
                                num_tokens, 1.0
                            )
                params = [p for p in self.policy.parameters() if p.requires_grad]
                max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
                grad_norm = float(self.accelerator.clip_grad_norm_(params, max_norm))
                self.optimizer.step()
                self.scheduler.step()
                entries = {
                    "policy_loss": loss_total,
                    "entropy": entropy_sum / max(num_tokens, 1.0),
                    "grad_norm": grad_norm,
                    **micro_stats,
                }
                for k, v in entries.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        return {k: v / max(count, 1) for k, v in sums.items()}

    def _pretrain_credit(self) -> None:
        """Fit a learned estimator (the value head) on the warm-start policy's own samples before
        RL, so that its credit is informed from the first step (DESIGN.md section 7)."""
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
            (self.run_dir / "value_pretrain.json").write_text(json.dumps(stats, indent=2))

    # -- evaluation, checkpoints, the loop ----------------------------------------------------
    def evaluate(self) -> float:
        return greedy_accuracy(
            self.policy, self.tokenizer, self.task, self.eval_set, self.cfg.sampling.max_new_tokens
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
        cfg = self.cfg
        main = self.accelerator.is_main_process
        if main:
            save_yaml(cfg, self.run_dir / "config.yaml")
        ckpt = runio.latest_checkpoint(self.run_dir)
        if ckpt is not None:
            self.restore(ckpt)
            self.log(f"resumed from {ckpt} at step {self.step}")
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


def _num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


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


def train(cfg: TrainConfig, log=print) -> dict[str, Any]:
    """Run (or resume) training and return start/final accuracy."""
    if cfg.resume:
        resumed = Path(cfg.resume)
        saved = resumed / "config.yaml"
        if not saved.exists():
            raise FileNotFoundError(
                f"--resume {resumed}: no config.yaml there; is it a run directory?"
            )
        from rredcot.config import load_yaml

        steps = cfg.steps
        cfg = load_yaml(saved)
        cfg.out = str(resumed)
        cfg.resume = str(resumed)
        cfg.steps = max(cfg.steps, steps) if steps != TrainConfig.steps else cfg.steps
    return Trainer(cfg, log=log).train()


__all__ = ["Trainer", "train", "policy_loss"]

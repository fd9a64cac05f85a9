"""The RL loop of docs/method.md (the RL step), read top to bottom:

sample G completions per prompt -> verify -> segment -> one no-grad forward (old log-probs and
hidden states) -> credit method -> token advantages -> clipped policy-gradient loss (+ KL to a
frozen reference) over several epochs and minibatches -> the credit method's own update (the
value head trains on the outcomes only after their credit was computed) -> the step's metrics
record and, every ``checkpoint_every`` steps, a checkpoint.

What the loop runs with is built before it by ``rredcot.training.setup`` (policy, reference, credit
method, optimiser, schedule, prompts); what a checkpoint holds is ``rredcot.training.checkpoint``'s; the
run directory (lock, ``config.yaml``, ``metrics.jsonl``, the TensorBoard / W&B sink) is
``rredcot.training.runio``'s; the accuracy on held-out problems is ``rredcot.training.evaluation``'s.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from rredcot.algebra.loss import LossSettings, policy_loss
from rredcot.algebra.normalization import masked_mean, zero_variance_groups
from rredcot.config import TrainConfig
from rredcot.config.io import resume_config
from rredcot.methods.auto import (
    AUTO,
    CreditChoice,
    apply_choice,
    choose_credit,
    outcome_counts,
    outcome_figures,
    policy_figures,
)
from rredcot.methods.processes import Collective, credit_over_processes, every_process_rows
from rredcot.safe_fs import write_text_atomic
from rredcot.sampling.batch import RolloutBatch
from rredcot.sampling.forward import (
    fill_forward,
    policy_forward,
    scoring_forward,
    train_mode_without_dropout,
)
from rredcot.sampling.memory import (
    ForwardPlan,
    forward_plan,
    micro_batches,
)
from rredcot.sampling.rollout import sample_groups, segment_batch
from rredcot.training import references, runio
from rredcot.training.checkpoint import (
    COUNTERS,
    restore_training_checkpoint,
    save_training_checkpoint,
)
from rredcot.training.evaluation import greedy_accuracy_over_processes
from rredcot.training.plots import plot_run
from rredcot.training.row_policies import forwarded_columns, update_rows
from rredcot.training.seeding import seed_everything, step_seed
from rredcot.training.setup import (
    build_method,
    build_train_parts,
    check_device,
    check_names,
    is_main_process,
)


@dataclass(frozen=True)
class _StepShares:
    """What the processes of one optimiser step agree on before the first backward: the loss of
    each is normalised by every process's rows and tokens (what one process holding the union
    of their rows would use) and scaled by ``scale`` (the number of processes: their gradients
    are averaged, so each contributes its share of the sum), and each runs ``passes``
    policy-gradient passes."""

    num_rows: int  # the minibatch's rows, over every process
    num_tokens: float  # their response tokens
    passes: int  # the most micro-batch passes of any process
    sft_rows: int  # references.mode sft: the step's reference rows, over every process
    sft_tokens: float  # their tokens
    scale: float  # the number of processes


# the update's per-token means, logged over every process's forwarded tokens
TOKEN_MEANS = ("entropy", "clip_fraction", "kl", "ratio_mean")
SCORING_PASS = ForwardPlan(scoring_pass=True, loss_forward_first=False, loss_forward_after=False)
"""The plan of a batch scored outside a step (:meth:`Trainer.rollout` with ``forward``)."""


@dataclass
class _StepWork:
    """One step's own state, made fresh by :meth:`Trainer.train_step` and passed down its stages
    (never read by the next step)."""

    trained_tokens: float = 0.0  # forwarded with grad: policy rows, sft rows (compute/step)
    reference_mode: references.ReferenceMode | None = None  # references.mode, its strategy
    sft_rows: references.ReferenceRows | None = None  # references.mode sft: the step's references
    own_rows: torch.Tensor | None = None  # (B,) the step's own samples, where references join
    reference_generated: int = 0  # references.mode: tokens charged to the budget this step
    reference_trained: int = 0  # references.mode: reference tokens trained on this step


class Trainer:
    """``rredcot train``: the RL loop over the parts of one run (``train_setup.TrainParts``)
    and its run directory."""

    def __init__(self, cfg: TrainConfig, *, log=print) -> None:
        self.cfg = cfg
        self.log = log
        self.run_dir = Path(cfg.out)
        check_device(cfg)  # a device the machine lacks (or its dtype) before anything else
        check_names(cfg)  # a typo fails before the run directory or a model is touched
        references.check_run(cfg)  # references.mode on a task without reference solutions
        main = is_main_process()
        self._lock: runio.RunLock | None = None
        if main:  # one writer per run directory, and no silent reuse of a run
            self._lock = runio.claim_run_dir(
                self.run_dir, resume=bool(cfg.resume), overwrite=cfg.overwrite
            )
        try:
            # a resume that cannot work is refused before minutes of loading
            self._resume_from = (
                runio.resume_checkpoint(self.run_dir, log=log, main=main) if cfg.resume else None
            )
            start = 0 if self._resume_from is None else runio.step_of(self._resume_from)
            saves = planned_saves(cfg, start)
            runio.check_checkpoint_names(self.run_dir, saves, fresh=not cfg.resume)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if cfg.resume and cfg.credit_method == AUTO:  # a resume never decides again
                self._apply_saved_choice()
            parts = build_train_parts(cfg, log=log)
            self.sink = runio.MetricSink(cfg.report_to, self.run_dir)
        except BaseException:
            self.release()
            raise
        self.accelerator, self.device = parts.accelerator, parts.device
        self.collective = Collective(parts.accelerator)
        self.rank, self.world = parts.rank, parts.world
        self.task, self.source = parts.task, parts.source
        self.policy, self.model, self.tokenizer = parts.policy, parts.model, parts.tokenizer
        self.decoder = parts.decoder
        self.reference, self.segmenter, self.method = parts.reference, parts.segmenter, parts.method
        self.credit_choice: CreditChoice | None = None  # --credit auto's, once step 1 chose
        self._method_rng = parts.method_rng
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self.train_pool, self.eval_set = parts.train_pool, parts.eval_set
        self.micro_batch_tokens = parts.micro_batch_tokens
        self.generation_rows = parts.generation_rows
        self.metrics = runio.MetricsLog(self.run_dir / runio.METRICS)
        # the run's totals (checkpoint.COUNTERS)
        self.step = 0
        self.samples_seen = 0
        self.tokens_generated = 0
        # generated by the credit method: Monte Carlo, value pretraining
        self.extra_tokens_generated = 0
        self.skipped_total = 0
        self.train_seconds = 0.0  # the steps' step_seconds summed (max_train_seconds)
        self.compute_used = 0.0  # forward-token equivalents (max_compute; step_compute)
        self.reference_tokens_trained = 0  # also charged in extra_tokens_generated
        self.last_step = _StepWork()  # the last step's own state, kept for inspection only

    def release(self) -> None:
        """Give up the run directory's lock (at the end of ``train``; idempotent)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -- the loop -----------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Run (or, with ``cfg.resume``, resume) the loop; returns start/final accuracy. The run
        directory's lock is released when it returns or raises."""
        try:
            return self._train()
        finally:
            self.release()

    def _train(self) -> dict[str, Any]:
        cfg = self.cfg
        main = self.accelerator.is_main_process
        ckpt = self._resume_from  # chosen (and verified) before the policy was loaded
        if main:
            runio.write_run_config(self.run_dir, cfg)
        if ckpt is not None:
            self.restore(ckpt)
            self.log(f"resumed from {ckpt} at step {self.step}")
            if self.step >= cfg.steps:
                self.log(f"the run is at step {self.step} already (steps={cfg.steps})")
        elif main:
            self.metrics.continue_after(-1, log=self.log)
            runio.start_checkpoint_index(self.run_dir, fresh=not cfg.resume)
        if self.step == 0 and cfg.credit.value_head.pretrain_steps > 0:
            if self.method is None:
                self.log("value pretraining skipped: --credit auto chooses at step 1")
            else:
                self._pretrain_credit()
        acc0 = self.evaluate() if self.step == 0 else None  # every process solves its share
        if self.step == 0 and main:
            self.metrics.append(
                {
                    "step": 0,
                    "samples_seen": 0,
                    "tokens_generated": 0,
                    "extra_tokens_generated": self.extra_tokens_generated,
                    "eval_accuracy": acc0,
                }
            )
            self.sink.log({"eval_accuracy": acc0}, 0)
        records = self.metrics.read()
        # a step-0 record may lack the accuracy (its metrics lost: a deleted or garbled log)
        start_acc = next((r.get("eval_accuracy") for r in records if r.get("step") == 0), None)
        last_acc = next(
            (r["eval_accuracy"] for r in reversed(records) if r.get("eval_accuracy") is not None),
            start_acc,
        )
        bar = _progress(cfg.progress and main, total=cfg.steps, initial=self.step)
        while self.step < cfg.steps and not self.budget_spent():
            self.step += 1
            record = self.train_step(self.step)
            last = self.step == cfg.steps or self.budget_spent()
            if (cfg.eval_every and self.step % cfg.eval_every == 0) or last:
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

    # -- one RL step --------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, Any]:
        """One RL step, top to bottom: rollout -> forward -> credit -> the update's rows -> loss
        and update -> the credit method's own update -> the step's record."""
        clock, work = _StepClock(), _StepWork()
        problems = self.prompts_for_step(step)[self.rank :: self.world]
        with self.precision():  # model.autocast: sampling, forwards, credit and update
            # seed, sample, verify, segment (the decoder's cache kept for the credit's probes)
            batch, stats = self.rollout(
                problems,
                forward=False,
                keep_cache=self.probes_from_cache(),
                seed=step_seed(self.cfg.seed, step, salt=self.rank),
            )
            if batch.size == 0:
                raise RuntimeError(
                    f"step {step}: the verifier rejected every sample (errors or non-finite "
                    "rewards); fix the task's verify() so that it returns a finite reward for "
                    "model output"
                )
            if self.method is None:  # --credit auto: chosen from this batch, no extra sampling
                self.choose_credit(batch, problems)
            batch = self._with_references(batch, stats, work)
            clock.lap("rollout")
            ref_logprobs = self._reference_logprobs(batch)  # the KL reference's own forward
            clock.lap("reference")

            plan = forward_plan(  # which policy forwards: memory.ForwardPlan
                batch.size,
                batch.input_ids.shape[1],
                self.micro_batch_tokens,
                single_pass=self.single_pass(),
                reads_forward=self.reads_forward(),
            )
            batch, loss_forward = self._credit_forward(batch, plan, clock)

            credit_rows = self.method.rows(batch)
            # the decoder's cache is read by the credit's probes only, before the update
            batch = _without_probe_cache(batch)
            # every process's rows: group and batch statistics, the estimate and the method's
            # update are the same on every process (rredcot.methods.processes)
            credit_rows, mine = every_process_rows(credit_rows, self.collective)
            estimate = self.method.estimate(credit_rows)
            credit_out = credit_over_processes(
                self.method,
                credit_rows,
                estimate,
                batch.segment_ids,
                batch.response_mask,
                mine,
                self.collective,
            )
            clock.lap("credit")

            advantages, columns, row_stats = self._update_rows(
                batch, credit_out.advantages.detach(), ref_logprobs
            )
            if plan.loss_forward_after:  # the one loss forward: the credited rows and columns
                batch, loss_forward = self._credited_loss_forward(batch, columns)
            update_stats = self._optimise(
                batch, advantages, columns, ref_logprobs, loss_forward, work
            )
            update_stats.update(row_stats)
            clock.lap("update")
        value_stats = self.method.update(credit_rows, estimate)
        clock.lap("value_update")
        self.last_step = work
        return self._record(
            step, batch, stats, credit_out, update_stats, value_stats, clock, plan, work
        )

    def precision(self):
        """The step's compute precision (``model.autocast``): a bfloat16 ``torch.autocast``, or
        nothing. Evaluation and the credit method's own update run outside it."""
        if self.cfg.model.autocast == "off":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def reads_forward(self) -> bool:
        """Whether the credit reads a policy forward of the batch: the hidden states the
        method reads, or the entropies the segmenter cuts at."""
        return self.method.needs_hidden_states or self.segmenter.uses_entropy

    def _update_rows(self, batch: RolloutBatch, advantages: torch.Tensor, ref_logprobs):
        """The update's row policies on the token advantages ``(B, T)``: the tree's shared-token
        weight, then ``rredcot.training.row_policies.update_rows`` (the tail floor, the agreeing
        groups' draw over every process's rows, seeded by the step) and the response columns the
        update forwards of each row (``row_policies.forwarded_columns``: cut after a row's last
        non-zero advantage under ``skip_zero_advantage_rows`` where no KL term is formed).
        Returns the advantages, the columns ``(B,)`` and the share of the agreeing rows the draw
        kept (``update/agreeing_rows_kept``)."""
        cfg = self.cfg
        advantages = shared_token_weighted(advantages, batch, cfg.sampling.tree.shared_token_weight)
        advantages, counts = update_rows(
            advantages,
            batch.response_mask,
            batch.rewards,
            batch.group_ids,
            tail_floor=cfg.advantage_tail_floor,
            agreeing_fraction=cfg.agreeing_update_fraction,
            gather=self._gathered_rows,
            generator=torch.Generator().manual_seed(step_seed(cfg.seed, self.step, salt=31)),
        )
        kl_term = ref_logprobs is not None and cfg.kl_coef > 0
        cut = cfg.skip_zero_advantage_rows and not kl_term
        columns = forwarded_columns(advantages, batch.response_mask, cut=cut)
        if not counts:
            return advantages, columns, {}
        counts = {k: float(v) for k, v in counts.items()}
        counts.update(self._summed_metrics(counts, ("kept", "credited")))
        return (
            advantages,
            columns,
            {"update/agreeing_rows_kept": counts["kept"] / max(counts["credited"], 1.0)},
        )

    def _gathered_rows(self, columns: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
        """``(start, every)``: per-row tensors ``(B,)`` of every process concatenated in process
        order (on the CPU), and where this process's rows start in them."""
        sizes = self.collective.sizes(len(columns[0]))
        every = [self.collective.gather_rows(c, sizes=sizes).cpu() for c in columns]
        return sum(sizes[: self.rank]), every

    def choose_credit(self, batch: RolloutBatch, problems) -> None:
        """``--credit auto``: choose the credit method from step 1's own batch (every process's
        figures summed, so all choose alike; ``rredcot.methods.auto``), build it as a named run
        builds it (from the generators' states there), and record the choice: logged,
        ``credit_choice.json``, and ``config.yaml`` holds the chosen method (a resume reads it)."""
        missing = sum(self.task.gold_completion(p) is None for p in problems)
        counts = outcome_counts(batch.rewards.cpu(), batch.group_ids.cpu())
        *summed, missing = self.collective.sum([*counts, float(missing)])
        figures = {**outcome_figures(summed), **policy_figures(self.policy, self.tokenizer)}
        choice = choose_credit(figures, has_references=missing == 0)
        apply_choice(self.cfg, choice)
        here = runio.capture_rng_state()
        runio.restore_rng_state(self._method_rng)
        try:
            self.method = build_method(
                self.cfg,
                self.task,
                self.policy,
                self.tokenizer,
                self.segmenter,
                self.device,
                self.micro_batch_tokens,
            )
        finally:
            runio.restore_rng_state(here)
        self.credit_choice = choice
        self.log(f"credit auto: {choice.method}, because {choice.reason}")
        if self.accelerator.is_main_process:
            write_text_atomic(
                self.run_dir / runio.CREDIT_CHOICE,
                json.dumps(choice.to_json(), indent=2) + "\n",
            )
            runio.write_run_config(self.run_dir, self.cfg)

    def _apply_saved_choice(self) -> None:
        """A resumed ``--credit auto`` run continues with what it chose at step 1."""
        saved = self.run_dir / runio.CREDIT_CHOICE
        if not saved.is_file():
            raise ValueError(
                f"{self.run_dir} has no {runio.CREDIT_CHOICE}: a --credit auto run writes it at "
                "step 1; resume it with its own config (rredcot train --resume RUN_DIR)"
            )
        choice = CreditChoice.read(saved)  # checked: a method and plain settings, no code
        apply_choice(self.cfg, choice)
        self.log(f"credit auto: {choice.method}, as chosen at step 1 ({saved})")

    def prompts_for_step(self, step: int):
        """The step's prompts: a function of (seed, step), so every method sees the same ones."""
        rng = random.Random(step_seed(self.cfg.seed, step, salt=17))
        return [
            self.train_pool[rng.randrange(len(self.train_pool))]
            for _ in range(self.cfg.prompts_per_step)
        ]

    def probes_from_cache(self) -> bool:
        """Whether a step's rollout keeps the fast decoder's cache for the credit's probes
        (``probe_from_cache`` and a method that probes prefixes; the rollout keeps one only where
        the fast loop samples the batch at once, :func:`rredcot.sampling.rollout.sample_keeping_cache`).
        The credit reads it before the step's update, the policy it sampled with."""
        return self.cfg.probe_from_cache and bool(getattr(self.method, "probes_prefixes", False))

    def rollout(
        self,
        problems,
        forward: bool = True,
        keep_cache: bool = False,
        seed: int | None = None,
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """Sample, verify and segment G completions per problem with the current policy, every
        generator seeded by ``seed`` first (``seeding.seed_everything``; None: the caller
        seeds); with ``forward`` also fill the old log-probs and hidden states; ``keep_cache``:
        the batch carries the decoder's cache (``batch.probe_cache``)."""
        if seed is not None:
            seed_everything(seed)
        self.policy.eval()
        batch, stats = sample_groups(
            self.policy,
            self.tokenizer,
            self.task,
            problems,
            self.segmenter,
            self.cfg.sampling,
            self.decoder,
            max_rows=self.generation_rows,
            keep_cache=keep_cache,
        )
        if forward:
            batch, _ = self._credit_forward(batch, SCORING_PASS)
        return batch, stats

    def _with_references(
        self, batch: RolloutBatch, stats: dict[str, float], work: _StepWork
    ) -> RolloutBatch:
        """``references.mode``: this step's references (its strategy's
        ``references.ReferenceMode.step``, the strategy kept for the step's sft term), and the
        step's own rows; their tokens are charged to the budget and counted in ``stats``."""
        cfg = self.cfg
        parts = references.ReferenceParts(
            self.task, self.tokenizer, self.segmenter, self.policy, cfg.sampling, self.decoder
        )
        work.reference_mode = references.reference_mode(cfg.references, parts)
        step = work.reference_mode.step(batch, self.reference_tokens_trained)
        work.sft_rows, work.own_rows = step.sft_rows, step.own_rows
        work.reference_generated, work.reference_trained = step.generated, step.trained
        stats.update(step.stats)
        return step.batch

    def _reference_sft_step(
        self, batch: RolloutBatch, shares: _StepShares, work: _StepWork
    ) -> dict[str, float]:
        """The references' supervised term (references.mode sft: ``sft_coef`` times the NLL of
        this step's references, ``references.Sft.supervised_loss``, of their policy forward)
        back-propagated into the gradient of the optimiser step being formed, aggregated over
        every process's references (``shares``). A process with none, while another has some,
        runs a stand-in pass of zero weight (one token of its first row), so that every process
        runs the same passes."""
        refs = work.sft_rows
        if shares.sft_rows == 0:
            return {}
        cfg = self.cfg
        if refs is not None and refs.size:
            ids, attention, P = refs.input_ids, refs.attention_mask, refs.prompt_len
            mask = refs.response_mask
        else:
            P, mask = batch.prompt_len, None
            ids, attention = batch.input_ids[:1, : P + 1], batch.attention_mask[:1, : P + 1]
        fwd = policy_forward(
            self.model,
            ids,
            attention,
            P,
            temperature=cfg.sampling.temperature,
            shared_prompt=cfg.shared_prompt_forward,
        )
        work.trained_tokens += float(attention.sum())
        loss, metrics = work.reference_mode.supervised_loss(
            fwd.logprobs,
            mask,
            num_rows=shares.sft_rows,
            num_tokens=shares.sft_tokens,
            scale=shares.scale,
            loss_agg=cfg.loss_agg,
            max_len=cfg.sampling.max_new_tokens,
        )
        self.accelerator.backward(loss)
        return metrics

    def _credit_forward(
        self, batch: RolloutBatch, plan: ForwardPlan, clock: _StepClock | None = None
    ) -> tuple[RolloutBatch, Any]:
        """The policy forward the credit reads, as ``plan`` says: the loss forward whose graph
        the update keeps (:meth:`_loss_forward`), or the no-grad scoring pass
        (``sampling.forward.fill_forward``), or none (the loss forward runs after the credit);
        then an entropy segmenter's cuts, at the entropies that forward computed. Returns the
        batch and the loss forward (None unless it ran); ``clock`` times the forward's phase."""
        loss_forward = None
        if plan.loss_forward_first:  # the credit reads the loss forward's hidden states
            batch, loss_forward = self._loss_forward(batch)
            phase = "update"
        elif plan.scoring_pass:  # no-grad: the old log-probs and what the credit reads
            batch = fill_forward(
                self.policy,
                batch,
                hidden_layers=self.hidden_layers(),
                temperature=self.cfg.sampling.temperature,
                shared_prompt=self.cfg.shared_prompt_forward,
                with_entropy=self.segmenter.uses_entropy,
                micro_batch_tokens=self.micro_batch_tokens,
            )
            phase = "old_logprobs"
        else:
            return batch, None
        if self.segmenter.uses_entropy:  # the entropy cuts, after the forward that has them
            batch = segment_batch(batch, self.tokenizer, self.segmenter, batch.entropies)
        if clock is not None:
            clock.lap(phase)
        return batch, loss_forward

    def hidden_layers(self) -> tuple[int, ...] | None:
        """The layers whose hidden states the credit method reads of the policy's forward (None:
        it reads none)."""
        return self.method.hidden_layers if self.method.needs_hidden_states else None

    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor | None:
        if self.reference is None:
            return None
        return scoring_forward(
            self.reference,
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_len,
            micro_batch_tokens=self.micro_batch_tokens,
            temperature=self.cfg.sampling.temperature,
            shared_prompt=self.cfg.shared_prompt_forward,
        ).logprobs

    def _micro_batches(
        self, batch: RolloutBatch, rows: torch.Tensor | None = None, columns=None
    ) -> list[torch.Tensor]:
        """``rows`` (default: all) in consecutive micro-batches of at most
        ``micro_batch_tokens`` tokens (``rredcot.sampling.memory.micro_batches``); ``columns``
        ``(len(rows),)``: the response columns each row is forwarded with (default: all)."""
        rows = torch.arange(batch.size) if rows is None else rows
        if columns is None:
            return micro_batches(rows, batch.input_ids.shape[1], self.micro_batch_tokens)
        return micro_batches(rows, batch.prompt_len + columns, self.micro_batch_tokens)

    @property
    def loss_settings(self) -> LossSettings:
        """The policy loss's settings, from the run's configuration."""
        return LossSettings(**self.cfg.loss_settings())

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

    def _loss_forward(
        self, batch: RolloutBatch, rows: torch.Tensor | None = None, columns: int | None = None
    ) -> tuple[RolloutBatch, Any]:
        """The single pass: the loss forward (with grad) over the whole batch, or over ``rows``
        and their first ``columns`` response columns once the credit is known
        (:meth:`_credited_loss_forward`; nothing is forwarded where no row has a gradient).
        Returns the batch with its detached log-probs (zero where nothing was forwarded), and,
        of a whole batch's forward, its hidden states and entropies (and entropy segments) for
        the credit method; and the forward itself (None where nothing was forwarded), whose
        graph the loss uses."""
        train_mode_without_dropout(self.model)
        rows = torch.arange(batch.size) if rows is None else rows
        columns = batch.response_len if columns is None else columns
        whole = len(rows) == batch.size and columns == batch.response_len
        width = batch.prompt_len + columns
        fwd = None
        if whole or (len(rows) and columns):  # nothing to forward where no row has a gradient
            fwd = policy_forward(
                self.model,
                batch.input_ids if whole else batch.input_ids[rows, :width],
                batch.attention_mask if whole else batch.attention_mask[rows, :width],
                batch.prompt_len,
                with_entropy=True,
                hidden_layers=self.hidden_layers(),
                temperature=self.cfg.sampling.temperature,
                shared_prompt=self.cfg.shared_prompt_forward,
            )
        if whole:
            hidden = None if fwd.hidden_states is None else fwd.hidden_states.detach()
            batch = batch.replace(
                old_logprobs=fwd.logprobs.detach(),
                hidden_states=hidden,
                entropies=fwd.entropy.detach(),
            )
            return batch, fwd
        dtype = torch.float32 if fwd is None else fwd.logprobs.dtype
        old = torch.zeros_like(batch.response_mask, dtype=dtype)
        if fwd is not None:
            old[rows, :columns] = fwd.logprobs.detach()
        return batch.replace(old_logprobs=old), fwd

    def _credited_loss_forward(self, batch: RolloutBatch, columns: torch.Tensor):
        """The single pass run after the credit: the loss forward over the rows with a gradient,
        up to the last of their ``columns`` (``(B,)``, :meth:`_update_rows`). Every process runs
        it: one with nothing to update forwards one token of its first row, of zero weight."""
        rows = torch.arange(batch.size)
        credited, width = rows[columns > 0], int(columns.max()) if len(rows) else 0
        if self.world > 1 and not len(credited):
            credited, width = rows[:1], 1
        return self._loss_forward(batch, credited, width)

    def _optimise(
        self,
        batch: RolloutBatch,
        advantages: torch.Tensor,
        columns: torch.Tensor,
        ref_logprobs,
        loss_forward,
        work: _StepWork,
    ) -> dict[str, float]:
        """Epochs x minibatches of optimiser steps; returns each metric's mean over the steps.
        With ``loss_forward`` (the single pass, :meth:`single_pass`) the one minibatch is the
        whole batch in its own order and its graph is that forward's. ``columns`` ``(B,)``: the
        response columns the update forwards of each row (:meth:`_update_rows`)."""
        cfg = self.cfg
        train_mode_without_dropout(self.model)
        gen = torch.Generator().manual_seed(step_seed(cfg.seed, self.step, salt=29))
        steps: list[dict[str, float]] = []
        for _ in range(cfg.epochs_per_batch):
            order = torch.randperm(batch.size, generator=gen)
            if self.single_pass():  # one minibatch: batch order keeps a prompt's rows together
                order = torch.arange(batch.size)
            for rows in order.chunk(cfg.minibatches):
                steps.append(
                    self._minibatch_step(
                        batch, rows, advantages, columns, ref_logprobs, loss_forward, work
                    )
                )
        return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]} if steps else {}

    def _plan_micros(self, batch: RolloutBatch, rows, columns, loss_forward):
        """``(live rows, micro-batches)``: the rows with a gradient and, per micro-batch, its rows,
        the response columns it forwards and its weight (``grad_accumulation`` chunks, each split
        to fit ``micro_batch_tokens``; one chunk per ``loss_forward`` already run; weight 0 for
        a ``loss_forward`` that stood in for a process with no row to update). ``columns``
        ``(B,)``: the response columns of every row of the batch."""
        if loss_forward is not None and loss_forward.logprobs.shape[0] == len(rows):
            live = rows
            columns = torch.full((len(rows),), loss_forward.logprobs.shape[1], device=self.device)
        else:
            columns = columns[rows.cpu()].to(rows.device)
            live, columns = rows[columns > 0], columns[columns > 0]
        micros = []  # (rows, response columns, weight)
        chunks = torch.arange(len(live)).chunk(self.cfg.grad_accumulation) if len(live) else ()
        for chunk in chunks:
            chunk = chunk.to(self.device)
            parts = [chunk] if loss_forward is not None else None
            if parts is None:
                parts = self._micro_batches(batch, chunk, columns[chunk])
            micros += [(live[part], int(columns[part].max()), 1.0) for part in parts]
        if not micros and loss_forward is not None:  # a stand-in's forward (several processes)
            micros = [(rows[:1], loss_forward.logprobs.shape[1], 0.0)]
        return live, micros

    def _minibatch_step(
        self,
        batch: RolloutBatch,
        rows: torch.Tensor,
        advantages,
        columns,
        ref_logprobs,
        loss_forward,
        work,
    ) -> dict[str, float]:
        """One optimiser step on ``rows``, accumulated over ``grad_accumulation`` micro-batches
        and the sft references' pass (gradients are synchronised across processes on the last
        pass only). Only the rows and ``columns`` with a gradient are forwarded
        (:meth:`_update_rows`); a ``loss_forward`` ran before (over every row, before the
        credit was known, or over the credited ones). Under several processes every process
        runs as many passes as the busiest one (stand-ins of zero weight) and the loss uses the
        rows and tokens of every process (:meth:`_step_shares`): the averaged gradient is one
        process's over the union of their rows."""
        cfg = self.cfg
        rows = rows.to(self.device)
        live, micros = self._plan_micros(batch, rows, columns, loss_forward)
        live_tokens = sum(float(batch.response_mask[m, :c].sum()) for m, c, w in micros if w)
        shares = self._step_shares(batch, rows, micros, work)
        if len(micros) < shares.passes:  # another process forwards more: stand-ins here
            if loss_forward is not None:
                raise RuntimeError("the single pass ran on one process and not on another")
            micros += [(rows[:1], 1, 0.0)] * (shares.passes - len(micros))
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {
            "policy_loss": 0.0,
            "entropy": 0.0,
            "update/rows_forwarded": len(live) / max(len(rows), 1),
            "update/tokens_forwarded": live_tokens
            / max(float(batch.response_mask[rows].sum()), 1.0),
        }
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if not micros:  # every row's gradient is zero: the optimiser still takes its step
            for p in params:
                p.grad = torch.zeros_like(p)
            totals.update({"clip_fraction": 0.0, "kl": 0.0, "ratio_mean": 1.0})
        for i, (micro, cols, weight) in enumerate(micros):
            last = i == len(micros) - 1 and not shares.sft_rows
            with contextlib.nullcontext() if last else self.accelerator.no_sync(self.model):
                loss, stats, entropy = self._policy_pass(
                    batch, micro, cols, advantages, ref_logprobs, loss_forward, shares
                )
                work.trained_tokens += float(
                    batch.attention_mask[micro, : batch.prompt_len + cols].sum()
                )
                self.accelerator.backward(loss * (weight * shares.scale))
            rmask = batch.response_mask[micro, :cols]
            share = weight * float(rmask.sum()) / max(live_tokens, 1.0)  # its token share
            totals["policy_loss"] += loss.item() * weight
            totals["entropy"] += weight * float((entropy * rmask).sum()) / max(live_tokens, 1.0)
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v * share
        totals.update(self._reference_sft_step(batch, shares, work))
        totals.update(self._summed_metrics(totals, ("policy_loss", "references/sft_nll")))
        totals.update(self._token_means(totals, live_tokens))
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        totals["grad_norm"] = float(self.accelerator.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        self.scheduler.step()
        return totals

    def _policy_pass(self, batch, micro, cols, advantages, ref_logprobs, loss_forward, shares):
        """``(loss, stats, entropy (b, cols))`` of one micro-batch: ``micro``'s rows forwarded
        with their first ``cols`` response columns (or ``loss_forward``, run before), the loss
        aggregated with the normalisers of ``shares`` (every process's rows and tokens)."""
        cfg = self.cfg
        width = batch.prompt_len + cols
        fwd = loss_forward
        if fwd is None:
            fwd = policy_forward(
                self.model,
                batch.input_ids[micro, :width],
                batch.attention_mask[micro, :width],
                batch.prompt_len,
                with_entropy=True,
                temperature=cfg.sampling.temperature,
                shared_prompt=cfg.shared_prompt_forward,
            )
        # no scoring pass ran (an on-policy update in micro-batches): old = new, detached
        on_policy = batch.old_logprobs is None
        loss, stats = policy_loss(
            fwd.logprobs,
            fwd.logprobs.detach() if on_policy else batch.old_logprobs[micro, :cols],
            advantages[micro, :cols],
            batch.response_mask[micro, :cols],
            self.loss_settings,
            num_rows=shares.num_rows,
            num_tokens=shares.num_tokens,
            row_tokens=batch.response_mask[micro].sum(-1),
            ref_logprobs=None if ref_logprobs is None else ref_logprobs[micro, :cols],
            off_policy=None if batch.off_policy is None else batch.off_policy[micro],
        )
        return loss, stats, fwd.entropy.detach()

    def _step_shares(
        self, batch: RolloutBatch, rows: torch.Tensor, micros, work: _StepWork
    ) -> _StepShares:
        """What every process's losses of one optimiser step are normalised by, agreed before
        the first backward (:class:`_StepShares`): the minibatch's rows and response tokens and
        the sft references' over every process, and the most passes any process runs."""
        refs = work.sft_rows
        local = [
            float(len(rows)),
            float(batch.response_mask[rows].sum()),
            float(len(micros)),
            float(0 if refs is None else refs.size),
            float(0 if refs is None else refs.tokens),
        ]
        if self.world == 1:
            every = torch.tensor([local], dtype=torch.float64)
        else:
            mine = torch.tensor([local], dtype=torch.float64, device=self.device)
            every = self.accelerator.gather(mine).cpu()
        total = every.sum(dim=0)
        return _StepShares(
            num_rows=int(total[0]),
            num_tokens=float(total[1]),
            passes=int(every[:, 2].max()),
            sft_rows=int(total[3]),
            sft_tokens=float(total[4]),
            scale=float(self.world),
        )

    def _summed_metrics(self, totals: dict[str, float], keys) -> dict[str, float]:
        """``keys`` of ``totals`` (those present) summed over the processes: each process
        computed its share of the global loss or NLL."""
        keys = [k for k in keys if k in totals]
        if self.world == 1 or not keys:
            return {}
        return dict(zip(keys, self.collective.sum([totals[k] for k in keys])))

    def _count(self, **counts: float) -> dict[str, float]:
        """Add a step's ``counts`` (every process's summed) to the run's totals of the same
        names, and return those sums: the totals are the run's, the same on every process (and
        in its checkpoint)."""
        summed = dict(zip(counts, self.collective.sum([float(v) for v in counts.values()])))
        for name, total in summed.items():
            before = getattr(self, name)
            setattr(self, name, before + (total if isinstance(before, float) else round(total)))
        return summed

    def _token_means(self, totals: dict[str, float], tokens: float) -> dict[str, float]:
        """The update's per-token means (:data:`TOKEN_MEANS`) over every process's forwarded
        tokens: each process averaged over its own ``tokens``."""
        keys = [k for k in TOKEN_MEANS if k in totals]
        if self.world == 1 or not keys:
            return {}
        every_tokens, *sums = self.collective.sum([tokens] + [totals[k] * tokens for k in keys])
        if every_tokens == 0:
            return {}
        return {k: total / every_tokens for k, total in zip(keys, sums)}

    def _reward_figures(self, rewards: torch.Tensor, batch: RolloutBatch) -> dict[str, float]:
        """``reward_mean`` and ``reward_std`` of the step's own samples ``rewards (B',)``, and
        ``zero_variance_groups`` of the batch's groups, over every process's rows and groups."""
        zero_variance = zero_variance_groups(batch.rewards, batch.group_ids)
        if self.world > 1:
            groups = float(len(batch.group_ids.unique()))
            flat, groups = self.collective.sum([zero_variance * groups, groups])
            zero_variance = flat / max(groups, 1.0)
            _, (rewards,) = self._gathered_rows([rewards])
        return {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "zero_variance_groups": zero_variance,
        }

    def _record(
        self, step, batch, stats, credit_out, update_stats, value_stats, clock, plan, work
    ) -> dict[str, Any]:
        """Count the step into the run's totals and return its metrics record."""
        B = batch.size
        rewards = batch.rewards  # the policy's own samples' (reference rows, branches left out)
        if work.own_rows is not None:
            rewards = rewards[work.own_rows]
        sampled = batch.attention_mask
        if batch.off_policy is not None:  # luffy's reference rows were given, not sampled
            sampled = sampled[~batch.off_policy.to(sampled.device)]
        compute = step_compute(
            sampled_tokens=float(sampled.sum()),
            generated_tokens=float(stats["rollout/tokens"]),
            scoring_passes=int(plan.scoring_pass) + int(self.reference is not None),
            scored_tokens=float(batch.attention_mask.sum()),
            trained_tokens=work.trained_tokens,
            credit_forward_tokens=float(credit_out.cost.extra_forward_tokens),
            credit_backward_tokens=float(credit_out.cost.extra_backward_tokens),
            credit_generated_tokens=float(credit_out.cost.extra_generated_tokens),
        )
        summed = self._count(
            samples_seen=rewards.numel(),
            tokens_generated=int(stats["rollout/tokens"]),
            extra_tokens_generated=int(credit_out.cost.extra_generated_tokens)
            + work.reference_generated,
            reference_tokens_trained=work.reference_trained,
            skipped_total=int(stats["rollout/skipped_samples"]),
            compute_used=compute,
        )
        if "reference_tokens_trained" in stats:  # the run's total, not this process's share
            stats["reference_tokens_trained"] = self.reference_tokens_trained
        self.train_seconds += clock.total
        stats["rollout/mean_segments"] = sum(len(b) - 1 for b in batch.boundaries) / B
        mask = batch.response_mask
        advantages = credit_out.advantages.detach()
        advantage_abs_mean = float(masked_mean(advantages.abs(), mask)) if mask.any() else 0.0
        return {
            "step": step,
            "samples_seen": self.samples_seen,
            "tokens_generated": self.tokens_generated,
            "extra_tokens_generated": self.extra_tokens_generated,
            **self._reward_figures(rewards, batch),
            **update_stats,
            "advantage_abs_mean": advantage_abs_mean,
            "skipped_samples_total": self.skipped_total,
            "lr": self.scheduler.get_last_lr()[0],
            **stats,
            **credit_out.metrics,
            **value_stats,
            "forward/scoring_pass": 1.0 if plan.scoring_pass else 0.0,
            **{f"time/{name}": seconds for name, seconds in clock.laps.items()},
            "step_seconds": clock.total,
            "time/train_seconds": self.train_seconds,
            "compute/step": summed["compute_used"],
            "compute/used": self.compute_used,
        }

    # -- before the first step ----------------------------------------------------------------
    def _pretrain_credit(self) -> None:
        """Fit a learned estimator (the value head) on the warm-start policy's own samples before
        RL, so that its credit is informed from the first step (docs/method.md, value sources)."""
        if not self.method.learns:
            raise ValueError(
                "credit.value_head.pretrain_steps > 0, but credit method "
                f"{self.cfg.credit_method!r} learns nothing; set it to 0"
            )
        cfg = self.cfg
        counter = iter(range(1, 1 << 30))
        sampled = [0]  # tokens this process sampled for the fit

        def sample_batch() -> RolloutBatch:
            i = next(counter)
            # Negative "steps": a prompt and sampling stream disjoint from the RL steps'.
            problems = self.prompts_for_step(-i)[self.rank :: self.world]
            batch, stats = self.rollout(problems, seed=step_seed(cfg.seed, -i, salt=self.rank))
            sampled[0] += int(stats["rollout/tokens"])
            return batch

        stats = self.method.pretrain(
            sample_batch,
            cfg.credit.value_head.pretrain_steps,
            every=lambda rows: every_process_rows(rows, self.collective)[0],
        )
        # samples drawn for the credit method, not the policy: paid from the token budget
        self._count(extra_tokens_generated=sampled[0])
        self.log(
            "value pretraining: "
            + ", ".join(f"{k.split('/')[-1]}={v:.3f}" for k, v in stats.items())
        )
        if self.accelerator.is_main_process:
            write_text_atomic(self.run_dir / "value_pretrain.json", json.dumps(stats, indent=2))

    # -- evaluation and checkpoints -----------------------------------------------------------
    def evaluate(self) -> float:
        """Greedy accuracy on the evaluation set (split over the processes)."""
        return greedy_accuracy_over_processes(
            self.policy,
            self.tokenizer,
            self.task,
            self.eval_set,
            self.cfg.sampling.max_new_tokens,
            self.collective,
            decoder=self.decoder,
        )

    def save(self) -> Path:
        """Checkpoint the run after ``self.step`` (``rredcot.training.checkpoint``)."""
        return save_training_checkpoint(
            self.run_dir,
            {name: getattr(self, name) for name in COUNTERS},
            self.policy,
            self.tokenizer,
            self.optimizer,
            self.scheduler,
            self.method,
            keep=self.cfg.keep_checkpoints,
        )

    def restore(self, ckpt: Path) -> None:
        """Continue from checkpoint ``ckpt``: its state, its totals, and the metrics it saw."""
        counters = restore_training_checkpoint(
            ckpt,
            self.policy,
            self.optimizer,
            self.scheduler,
            self.method,
            dtype=getattr(torch, self.cfg.model.dtype),
        )
        for name, value in counters.items():
            setattr(self, name, value)
        if self.accelerator.is_main_process:
            self.metrics.continue_after(self.step, counters, log=self.log)

    def budget_spent(self) -> bool:
        """Whether a budget is reached: ``max_train_seconds`` (rank 0's training seconds: every
        process stops at the same step), ``max_compute`` or ``max_tokens_generated`` (policy
        rollouts + credit generations; both totals are every process's, :meth:`_count`)."""
        cfg = self.cfg
        if cfg.max_train_seconds > 0:  # rank 0's clock decides
            (seconds,) = self.collective.sum([self.train_seconds * (self.rank == 0)])
            if cfg.max_train_seconds <= seconds:
                return True
        if 0 < cfg.max_compute <= self.compute_used:
            return True
        budget = cfg.max_tokens_generated
        return 0 < budget <= self.tokens_generated + self.extra_tokens_generated


def step_compute(
    sampled_tokens: float,
    generated_tokens: float,
    scoring_passes: int,
    scored_tokens: float,
    trained_tokens: float,
    credit_forward_tokens: float,
    credit_backward_tokens: float,
    credit_generated_tokens: float,
) -> float:
    """One step's compute in forward-token equivalents (FLOPs / 2N, N the policy's parameters;
    attention's quadratic term ignored), billing what the step forwards: sampling forwards
    every real token of the sampled rows once (``sampled_tokens``: prompt + response;
    ``generated_tokens`` of them sampled one by one, each a forward), each no-grad scoring pass
    (the loss's old log-probs, the KL reference) forwards the batch's ``scored_tokens`` once,
    the update forwards and back-propagates ``trained_tokens`` (2N + 4N = 3 forwards each:
    the real tokens of the rows and columns forwarded with grad, summed over epochs and
    minibatches, and the sft references'), and the credit method's extra forward and generated
    tokens are a forward each (its backward tokens, a value head's, 2 more)."""
    del generated_tokens  # inside sampled_tokens: named so the caller says what it counts
    return (
        sampled_tokens
        + scoring_passes * scored_tokens
        + 3 * trained_tokens
        + credit_forward_tokens
        + 2 * credit_backward_tokens
        + credit_generated_tokens
    )


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


def _without_probe_cache(batch: RolloutBatch) -> RolloutBatch:
    """``batch`` with the decoder's cache it carried (if any) freed and dropped."""
    if batch.probe_cache is None:
        return batch
    batch.probe_cache.free()
    return batch.replace(probe_cache=None)


def shared_token_weighted(advantages: torch.Tensor, batch: RolloutBatch, rule: str) -> torch.Tensor:
    """The advantages the loss uses, ``(B, T)``. In a tree group (``batch.token_share_counts``) a
    token that ``k`` leaves share appears in all ``k`` rows; ``per_leaf`` keeps every row's term
    (the per-trajectory estimator), ``per_node`` divides each by ``k`` so the token counts once in
    total. The clipped PPO term is linear in the advantage for a given ratio, so dividing the
    advantage divides the token's loss and gradient. Independent groups: unchanged."""
    if rule == "per_leaf" or batch.token_share_counts is None:
        return advantages
    counts = batch.token_share_counts.to(advantages.device).clamp_min(1.0)
    return advantages / counts


def planned_saves(cfg: TrainConfig, start: int) -> list[int]:
    """The steps after ``start`` at which the run saves a checkpoint (a budget that ends the run
    sooner adds its last step)."""
    every = max(cfg.checkpoint_every, 1)
    return [s for s in range(start + 1, cfg.steps + 1) if s % every == 0 or s == cfg.steps]


def _progress(enabled: bool, total: int, initial: int):
    if not enabled:
        return None

    return tqdm(total=total, initial=initial, desc="rl", unit="step", dynamic_ncols=True)


def train(cfg: TrainConfig, log=print, given: set[str] | None = None) -> dict[str, Any]:
    """Run (or resume) training and return start/final accuracy.

    With ``cfg.resume`` the run's own ``config.yaml`` is the config and only the fields named in
    ``given`` (dotted names set on the command line or in ``--config``; by default the fields where
    ``cfg`` differs from the defaults) apply over it; a change to a field outside
    ``config.RESUMABLE_FIELDS`` is refused, every one named (``config_io.resume_config``)."""
    if cfg.resume:
        cfg = resume_config(cfg, given)
        named = cfg.credit.process_reward  # restated on the command line: said before loading
        for name in ("function", "model"):
            if getattr(named, name):
                log(f"--resume: loading credit.process_reward.{name}={getattr(named, name)!r}")
    return Trainer(cfg, log=log).train()


__all__ = ["Trainer", "train", "policy_loss"]

"""The trainer: :class:`RREDCoTGRPOTrainer`, TRL's ``GRPOTrainer`` whose advantages come from an
rredcot credit method (the package's docstring says how), over TRL's private methods.

TRL internals this adapter depends on, as of TRL 1.16.0, the one version its tests ran against
(the ``trl`` extra pins ``trl>=1.16,<1.17``). It overrides the ``GRPOTrainer`` methods in
:data:`OVERRIDDEN_TRL_METHODS` (five private ones and the public ``save_model``), each calling
TRL's own inside: ``_generate_and_score_completions`` (its advantages replaced, and luffy's
reference rows put in place of rollouts), ``_calculate_rewards`` (every process's rewards per
function, kept before TRL scales them), ``_get_per_token_logps_and_entropies`` (the hidden
states of TRL's pass or of the single loss forward, read by a hook on the decoder, with the
log-probs of the same forward), ``_compute_loss`` (which micro-batch the single loss forward's
credit goes to, and the references' terms added), ``_load_optimizer_and_scheduler`` (the
credit's state read back on resume) and ``save_model`` (that state written beside TRL's
checkpoints). It also reads TRL's private attributes in :data:`TRL_PRIVATE_ATTRIBUTES` and the
keys of the dict ``_generate_and_score_completions`` returns. All the adapter holds between
those calls is one :class:`CreditState`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor

from rredcot.algebra.normalization import masked_mean
from rredcot.config import CreditConfig
from rredcot.errors import require_extra
from rredcot.integrations._batch import METRICS_PREFIX, rollout_batch_from_tensors
from rredcot.integrations.trl import forward, references, state
from rredcot.integrations.trl.config import (
    TRL_METHODS,
    RREDCoTGRPOConfig,
    describe_credit,
    resolve_model,
)
from rredcot.integrations.trl.rewards import outcome_rewards, problem_of_row
from rredcot.methods.auto import (
    AUTO,
    CreditChoice,
    apply_choice,
    choose_from_rollouts,
    measured_rows,
    policy_figures,
)
from rredcot.methods.base import (
    CreditContext,
    CreditMethod,
    CreditOutput,
    RolloutBatch,
    build_credit,
)
from rredcot.methods.processes import (
    Collective,
    GlobalRows,
    credit_over_processes,
    global_rows,
    group_peers,
    prefix_ids_over_processes,
)
from rredcot.segment import segmenter_from_config
from rredcot.tasks import get_task
from rredcot.tasks.base import Problem, Task, Verdict, safe_verify
from rredcot.training.row_policies import drop_small_tails

_trl = require_extra("trl", "trl", "rredcot.integrations.trl")
GRPOTrainer = _trl.GRPOTrainer
is_conversational = _trl.data_utils.is_conversational

__all__ = ["OVERRIDDEN_TRL_METHODS", "TRL_PRIVATE_ATTRIBUTES", "RREDCoTGRPOTrainer"]

OVERRIDDEN_TRL_METHODS = (
    "_generate_and_score_completions",
    "_calculate_rewards",
    "_get_per_token_logps_and_entropies",
    "_compute_loss",
    "_load_optimizer_and_scheduler",
    "save_model",
)
"""The ``GRPOTrainer`` methods :class:`RREDCoTGRPOTrainer` overrides (each calls TRL's own);
tests/integrations/trl/test_trl_integration.py checks that TRL still has each."""
TRL_PRIVATE_ATTRIBUTES = ("_metrics", "_logs", "_step", "_tokenizer")
"""The private attributes of a ``GRPOTrainer`` the adapter reads."""


@dataclass
class Waiting:
    """A generation batch whose credit waits for its one loss forward (the hidden states)."""

    batch: RolloutBatch  # this process's rows, no hidden states yet
    rows: GlobalRows
    loss_mask: Tensor  # (B, T)
    mode: str
    inputs: dict | None = None  # the micro-batch TRL is forming the loss of (set in _compute_loss)


@dataclass
class CreditState:
    """What the adapter holds between TRL's calls: the generation batch in hand (a new one each
    batch; an evaluation batch keeps the training batch's reference term)."""

    rewards_per_func: Tensor | None = None  # (N all processes, funcs), before TRL scales them
    read_pass: bool = False  # read the hidden states of TRL's coming old-log-prob pass
    hidden: Tensor | None = None  # (B, P+T, D) what that pass gave
    waiting: Waiting | None = None  # the credit waiting for the batch's loss forward
    references: references.ReferenceTerm | None = None  # the training batch's sft term
    loss_logps: list[Tensor] | None = None  # luffy: the loss forward's log-probs, kept here


class RREDCoTGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose advantages come from an rredcot credit method (the package docstring).

    Same constructor as ``GRPOTrainer``; ``args`` must be a :class:`RREDCoTGRPOConfig`. The
    credit method is ``trainer.credit_method`` (its value head, if any, at
    ``trainer.credit_method.head``); with ``credit_method="auto"`` it is None until the first
    generation batch chose it (``trainer.credit_choice`` says what and why).
    """

    def __init__(self, model, reward_funcs=None, args: RREDCoTGRPOConfig | None = None, **kwargs):
        if args is None:
            name = model if isinstance(model, (str, os.PathLike)) else model.config._name_or_path
            args = RREDCoTGRPOConfig(f"{str(name).split('/')[-1] or 'model'}-RREDCoT-GRPO")
        if not isinstance(args, RREDCoTGRPOConfig):
            raise TypeError(
                f"args must be an RREDCoTGRPOConfig (a GRPOConfig with the credit settings), got "
                f"{type(args).__name__}; build it with RREDCoTGRPOConfig(**your_grpo_kwargs, "
                "credit_method=..., credit={...})"
            )
        if isinstance(model, (str, os.PathLike)):
            model = resolve_model(model)
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        self.task: Task | None = get_task(args.task, **args.task_args) if args.task else None
        self.segmenter = segmenter_from_config(
            args.credit_config, getattr(self.task, "answer_line_pattern", None)
        )
        self.collective = Collective(self.accelerator)
        self.credit_method: CreditMethod | None = None
        self.credit_choice: CreditChoice | None = None  # what auto chose, and why
        self.last_batch: RolloutBatch | None = None  # the last generation batch, for inspection
        self.last_credit: CreditOutput | None = None  # its credit (this process's rows)
        self._state = CreditState()
        self.reference_tokens_trained = 0  # references.mode: reference tokens trained on (run)
        references.check_reference_data(
            args.references_config.mode,
            self.train_dataset,
            args.answer_column,
            self.task,
            args.task,
            self._problem,
        )
        if args.credit_method == AUTO:
            measured_rows()  # the rows auto reads: a bad file is refused before training
            self._announce(self.describe_credit())
        else:
            self._use_method(args.credit_method, args.credit_config)

    # -- the credit method --------------------------------------------------------------------
    def _use_method(self, name: str, config: CreditConfig) -> None:
        """Build the credit method ``name`` (at start, or once ``auto`` chose it)."""
        method = build_credit(
            name,
            config,
            CreditContext(
                policy=self.model,
                tokenizer=self._tokenizer,
                task=self.task,
                segmenter=self.segmenter,
                device=self.accelerator.device,
            ),
        )
        self.credit_method = method
        self._announce(self.describe_credit())

    def _choose_credit(self, rows: GlobalRows, batch: RolloutBatch) -> CreditChoice:
        """``auto``'s choice from the first generation batch's own rollouts, by rredcot train's
        rule (:mod:`rredcot.methods.auto`): every process's rewards by group, and whether the
        task has a reference solution for every prompt of every process."""
        task = self.task
        mine = task is not None and all(task.gold_completion(p) is not None for p in batch.problems)
        has_references = self.collective.max_int(int(not mine)) == 0
        model = policy_figures(self.model, self.processing_class)
        return choose_from_rollouts(
            rows.rewards.cpu(), rows.group_ids.cpu(), has_references, model=model
        )

    def _use_choice(self, choice: CreditChoice, config: CreditConfig | None = None) -> None:
        """Use what ``auto`` chose: its method, with its settings over the run's credit config
        (``config``: a resumed run's saved one, the settings in it already)."""
        if choice.method not in TRL_METHODS:
            raise ValueError(
                f"credit_method='auto' chose {choice.method!r}, which TRL does not support; name "
                f"one of {', '.join(TRL_METHODS)}"
            )
        if config is None:
            chosen = SimpleNamespace(
                credit_method=AUTO, credit=self.args.credit_config_for(choice.method)
            )
            apply_choice(chosen, choice)
            config = chosen.credit
        self.credit_choice = choice
        self._announce(f"credit auto: {choice.method}, because {choice.reason}")
        self._use_method(choice.method, config)

    def _announce(self, line: str) -> None:
        if self.accelerator.is_main_process:
            print(f"rredcot: {line}", flush=True)

    def describe_credit(self) -> str:
        """One line saying what was resolved: the method, the segmenter, the normalisation, the
        hand-over and where the values' inputs come from (printed when the method is built)."""
        return describe_credit(self.credit_method, self.args, self._hidden_source("train"))

    # -- where the hidden states come from -----------------------------------------------------
    def _trl_runs_old_logprob_pass(self) -> bool:
        """Whether TRL 1.16's ``_generate_and_score_completions`` runs its no-grad old-log-prob
        forward on ``self.model`` (the same condition it uses)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _hidden_source(self, mode: str) -> str:
        """``trl_pass``, ``loss_forward`` or ``own_forward`` (:func:`forward.hidden_source`)."""
        return forward.hidden_source(self.args, mode, self._trl_runs_old_logprob_pass())

    # -- TRL's internals, overridden ------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        self._state.rewards_per_func = rewards_per_func  # (N all processes, funcs), unscaled
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        if self._state.waiting is not None:
            raise RuntimeError(
                "rredcot: a new generation batch started before the last one went through its "
                "loss forward (TRL internals changed?)"
            )
        mode = "train" if self.model.training else "eval"
        method = self.credit_method
        reads = method is not None and method.needs_hidden_states
        self._state = CreditState(
            read_pass=reads and self._hidden_source(mode) == "trl_pass",
            references=self._state.references if mode == "eval" else None,
        )
        output = super()._generate_and_score_completions(inputs)
        return self._apply_credit(inputs, output)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        result = self._logps_reading_hidden_states(model, *args, **kwargs)
        if self._state.loss_logps is not None:  # luffy's loss reads the forward's log-probs
            self._state.loss_logps.append(result[0])
        return result

    def _logps_reading_hidden_states(self, model, *args, **kwargs):
        held = self._state
        trl_pass = held.read_pass and model is self.model  # its first pass; a PEFT ref's follows
        loss_forward = held.waiting is not None and held.waiting.inputs is not None
        if not (trl_pass or loss_forward):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        held.read_pass = False
        store: list[Tensor] = []
        with forward.capture_hidden_states(model, self.credit_method.hidden_layers, store):
            result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        if trl_pass:
            held.hidden = torch.cat(store, dim=0)
        else:
            self._credit_in_loss_forward(torch.cat(store, dim=0), result[0].detach())
        return result

    def _compute_loss(self, model, inputs):
        waiting = self._state.waiting
        if waiting is not None and "rredcot_row" in inputs:
            waiting.inputs = inputs  # its forward gives the credit (_credit_in_loss_forward)
        if "rredcot_reference" in inputs:
            return self._luffy_loss(model, inputs)
        loss = super()._compute_loss(model, inputs)
        term = self._state.references
        if term is not None and self.model.training:
            loss = loss + self._reference_sft_loss(model, term)
        return loss

    # -- the reference solutions (references.mode) ----------------------------------------------
    def _with_references(self, inputs: list[dict], output: dict) -> None:
        """``references.mode`` on a training generation batch: the references of the groups
        ``references.groups`` chooses (default: those with no sample of outcome ``R >= 1``), after
        the group's prompt (:func:`references.batch_references`); sft keeps them for the loss
        (:meth:`_reference_sft_loss`), luffy puts each in place of its group's last rollout
        (:meth:`_replace_rollouts`). Their tokens are counted once per generation batch over every
        process (``rredcot/references/tokens``; the run's ``rredcot/reference_tokens_trained``),
        as rredcot train counts them (docs/metrics.md)."""
        cfg = self.args.references_config
        if cfg.mode == "off":
            return
        G = self.num_generations
        rewards, _ = outcome_rewards(self._state.rewards_per_func, self.reward_weights, G)
        problems = [self._problem(x) for x in inputs]
        refs, start = references.batch_references(
            cfg, rewards, G, output, problems, self.task, self._tokenizer, self.collective.rank
        )
        counts = torch.tensor([[refs.size, refs.tokens]], device=self.collective.device)
        total_rows, total_tokens = (int(x) for x in self.collective.gather(counts).sum(dim=0))
        if cfg.mode == "sft":
            parts = self.args.steps_per_generation
            self._state.references = references.ReferenceTerm(refs, parts, total_rows, total_tokens)
        else:
            self._replace_rollouts(inputs, output, refs, start, total_rows)
        self.reference_tokens_trained += total_tokens
        totals = (total_rows, total_tokens)
        trained = self.reference_tokens_trained
        self._log_credit(references.reference_stats(refs, rewards, G, totals, trained), "train")

    def _replace_rollouts(
        self, inputs: list[dict], output: dict, refs, start: int, total_rows: int
    ) -> None:
        """luffy: the references in place of rollouts (:func:`references.replace_rollouts`), their
        rewards the reward functions' on them (into the outcome ``R`` the credit reads, on every
        process: :func:`references.reference_rewards`). TRL's own logs of the batch (rewards,
        completions) were written before, from the sampled rollouts."""
        pad = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        G = self.num_generations
        rows = references.replace_rollouts(output, refs, start, total_rows, G, pad, self.collective)
        if rows is None:
            return
        self._state.hidden = None  # TRL's pass saw the sampled rows: the credit forwards anew
        references.reference_rewards(
            inputs,
            output,
            refs,
            rows,
            start,
            is_conversational(inputs[0]),
            self._trl_rewards,
            self._tokenizer,
            self.collective,
            self._state.rewards_per_func,
        )

    def _trl_rewards(self, inputs, prompts, completions, completion_ids_list) -> Tensor:
        """TRL's ``_calculate_rewards`` itself (not this class's, which keeps a batch's)."""
        return GRPOTrainer._calculate_rewards(
            self, inputs, prompts, completions, completion_ids_list
        )

    def _loss_shape(self, train: bool) -> references.LossShape:
        accumulation = self.current_gradient_accumulation_steps if train else 1.0
        return references.LossShape(
            self.loss_type,
            self.max_completion_length,
            self.args.steps_per_generation,
            accumulation,
            self.collective.world,
        )

    def _luffy_loss(self, model, inputs: dict) -> Tensor:
        """references.mode luffy: TRL's loss of the micro-batch with its reference rows left out,
        plus LUFFY's term on them (:func:`references.luffy_term`)."""
        trl_inputs, mask = references.luffy_inputs(inputs)
        waiting = self._state.waiting
        if waiting is not None and waiting.inputs is inputs:
            waiting.inputs = trl_inputs  # the loss forward writes the credit where TRL reads it
        self._state.loss_logps = []
        try:
            loss = super()._compute_loss(model, trl_inputs)
            logps = self._state.loss_logps[0]
        finally:
            self._state.loss_logps = None
        inputs["advantages"] = trl_inputs["advantages"]  # the loss forward's credit
        train = self.model.training
        gamma = self.args.references_config.shaping_gamma
        shape = self._loss_shape(train)
        term, ratio = references.luffy_term(
            inputs, mask, logps, gamma, shape, train, self.collective
        )
        if ratio is not None:
            self._log_credit({"references/shaped_ratio": ratio}, "train" if train else "eval")
        return loss + term

    def _reference_sft_loss(self, model, term: references.ReferenceTerm) -> Tensor:
        """This micro-batch's share of ``sft_coef`` times the references' NLL
        (:func:`references.sft_share`); the batch's NLL logged once its last share is in."""
        loss, nll = references.sft_share(
            term,
            self._step,
            model,
            super()._get_per_token_logps_and_entropies,
            self._loss_shape(True),
            self.args.references_config.sft_coef,
            self.collective,
        )
        if nll is not None:
            self._log_credit({"references/sft_nll": nll}, "train")
        return loss

    # -- the credit of a generation batch -------------------------------------------------------
    def _apply_credit(self, inputs: list[dict], output: dict) -> dict:
        """TRL's per-completion advantages replaced by rredcot's ``(B, T)`` token advantages:
        now, or in the batch's loss forward where the hidden states come from it."""
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            self._with_references(inputs, output)
        batch, rows, loss_mask = self._rollout_batch(inputs, output, mode)
        if self.credit_method is None:
            self._use_choice(self._choose_credit(rows, batch))
        self.last_batch = batch
        if self.credit_method.needs_hidden_states:
            hidden, logps = self._state.hidden, output.get("old_per_token_logps")
            own = hidden is None or logps is None or hidden.shape[:2] != batch.input_ids.shape
            if own and self._hidden_source(mode) == "loss_forward":
                return self._wait_for_loss_forward(output, batch, rows, loss_mask, mode)
            if own:
                hidden, logps = self._extra_forward(output, mode)
            self._metrics[mode]["rredcot/extra_forward"].append(float(own))
            batch = batch.replace(hidden_states=hidden, old_logprobs=logps.detach())
        output["advantages"] = self._credit(batch, rows, loss_mask, mode)
        return output

    def _credit(self, batch: RolloutBatch, rows: GlobalRows, loss_mask: Tensor, mode: str):
        """``(B, T)`` advantages of this process's rows, once per generation batch, by the stages
        of rredcot train's step: the method's rows (gathered from every process, so group
        statistics see whole groups), the estimate over them, the segment and token stages
        (:meth:`~rredcot.methods.base.CreditMethod.credit_output` on this process's rows), then,
        in training, the method's update (after the credit: it never sees the step's outcomes;
        every process holds the same head and guard)."""
        method = self.credit_method
        method.context.policy = self.model  # the prepared (possibly wrapped) model
        if method.reads_group_samples:  # a group's rows may sit on several processes
            batch = batch.replace(peers=group_peers(batch, self.collective))
        local = forward.local_rows(method, batch, self.model, self.collective)
        prefix_ids = None  # the value head's shared prefixes, wherever a group's rows are
        if method.node_values == "always":
            prefix_ids = prefix_ids_over_processes(batch, self.collective)
        every = rows.gather(local, self.collective, prefix_ids=prefix_ids)
        estimate = method.estimate(every)
        out = credit_over_processes(
            method,
            every,
            estimate,
            batch.segment_ids,
            batch.response_mask,
            rows.local,
            self.collective,
        )
        advantages = out.advantages.to(torch.float32) * loss_mask.to(torch.float32)
        advantages = drop_small_tails(advantages, loss_mask, self.args.advantage_tail_floor)
        self.last_batch, self.last_credit = batch, out
        self._log_credit(self.collective.mean_metrics(out.metrics), mode)
        self._log_row_advantages(advantages, loss_mask)
        if mode == "train":
            self._log_credit(method.update(every, estimate), mode)
        return advantages

    def _wait_for_loss_forward(self, output: dict, batch, rows, loss_mask: Tensor, mode: str):
        """Leave zero advantages and number the rows (TRL shuffles them); the batch's one loss
        forward gives the credit (:meth:`_credit_in_loss_forward`)."""
        B, T = output["completion_ids"].shape
        device = output["completion_ids"].device
        output["advantages"] = torch.zeros(B, T, device=device)
        output["rredcot_row"] = torch.arange(B, device=device)
        self._state.waiting = Waiting(batch, rows, loss_mask, mode)
        self._metrics[mode]["rredcot/extra_forward"].append(0.0)
        return output

    def _credit_in_loss_forward(self, hidden: Tensor, logps: Tensor) -> None:
        """The waiting batch's credit from the detached hidden states and log-probs of its loss
        forward (TRL's shuffled row order), written into the micro-batch before the loss."""
        waiting, self._state.waiting = self._state.waiting, None
        inputs, batch = waiting.inputs, waiting.batch
        order = inputs["rredcot_row"]
        if hidden.shape[:2] != batch.input_ids.shape or len(order) != batch.size:
            raise RuntimeError(
                f"rredcot: the loss forward's hidden states are {tuple(hidden.shape[:2])}, the "
                f"generation batch is {tuple(batch.input_ids.shape)} (TRL internals changed?)"
            )
        in_order = torch.empty_like(hidden), torch.empty_like(logps)
        in_order[0][order], in_order[1][order] = hidden, logps
        batch = batch.replace(hidden_states=in_order[0], old_logprobs=in_order[1])
        advantages = self._credit(batch, waiting.rows, waiting.loss_mask, waiting.mode)
        inputs["advantages"] = advantages[order.to(advantages.device)]

    def _rollout_batch(self, inputs: list[dict], output: dict, mode: str):
        """``(batch, rows, loss_mask)``: this process's completions as a segmented
        :class:`RolloutBatch`, the rows of every process (:class:`GlobalRows`) and the
        ``(B, T)`` mask of TRL's loss."""
        G = self.num_generations if mode == "train" else self.num_generations_eval
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        B = completion_ids.shape[0]
        start = self.collective.rank * B
        if self._state.rewards_per_func is None:
            raise RuntimeError(
                "rewards were not computed before the credit (TRL internals changed?)"
            )
        all_rewards, all_unscorable = outcome_rewards(
            self._state.rewards_per_func, self.reward_weights, G
        )
        rewards = all_rewards[start : start + B].to(completion_ids.device)
        unscorable = all_unscorable[start : start + B].to(completion_ids.device)
        # Segments cover every completion token (a prefix mask); unscorable rows get none. The
        # advantages are then masked like TRL's loss (tool-output tokens excluded).
        live_mask = completion_mask * (~unscorable).to(completion_mask.dtype).unsqueeze(1)
        loss_mask = live_mask * output["tool_mask"] if "tool_mask" in output else live_mask
        batch = rollout_batch_from_tensors(
            prompt_ids=output["prompt_ids"],
            prompt_mask=output["prompt_mask"],
            completion_ids=completion_ids,
            completion_mask=live_mask,
            rewards=rewards,
            group_ids=torch.arange(start, start + B, device=completion_ids.device) // G,
            tokenizer=self._tokenizer,
            segmenter=self.segmenter if not self.segmenter.uses_entropy else self._line_segmenter,
            eos_token_ids=self.eos_token_ids,
            problems=[self._problem(x) for x in inputs],
        )
        batch.attention_mask[:, batch.prompt_len :] = completion_mask.long()  # what the model saw
        if self.segmenter.uses_entropy:
            batch = forward.entropy_segmented(
                self.model, batch, self._tokenizer, self.segmenter, self.args.temperature
            )
        batch = batch.replace(verdicts=self._verdicts(batch))
        return batch, global_rows(batch, all_rewards, G, self.collective), loss_mask

    def _problem(self, row: dict) -> Problem:
        """A dataset row as the task's :class:`Problem` (:func:`rewards.problem_of_row`)."""
        return problem_of_row(row, self.task, self.args.answer_column)

    def _extra_forward(self, output: dict, mode: str) -> tuple[Tensor, Tensor]:
        """``(hidden states, log-probs)`` of the local rows by one no-grad forward of the
        adapter's own (:func:`forward.extra_forward`)."""
        batch_size = (
            self.args.per_device_train_batch_size
            if mode == "train"
            else self.args.per_device_eval_batch_size
        )
        return forward.extra_forward(
            self.model,
            output,
            self.credit_method.hidden_layers,
            self.args.gradient_checkpointing_kwargs,
            super()._get_per_token_logps_and_entropies,
            batch_size,
        )

    @property
    def _line_segmenter(self):
        """Newline cuts with the segmenter's options: the first cut of a batch that an entropy
        strategy then re-cuts (:func:`forward.entropy_segmented`)."""
        return dataclasses.replace(self.segmenter, strategy="newline")

    def _verdicts(self, batch: RolloutBatch) -> list[Verdict]:
        if self.task is None:
            return [
                Verdict(float(r), None, None, "scored by the TRL reward functions")
                for r in batch.rewards.tolist()
            ]
        return [safe_verify(self.task, p, c) for p, c in zip(batch.problems, batch.completions)]

    def _log_credit(self, metrics: dict[str, float], mode: str) -> None:
        """Log the credit method's metrics in rredcot's one namespace beside TRL's own:
        ``credit/handover_weight`` as ``rredcot/credit/handover_weight`` (docs/metrics.md)."""
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._metrics[mode][f"{METRICS_PREFIX}{key}"].append(float(value))

    def _log_row_advantages(self, advantages: Tensor, mask: Tensor) -> None:
        """Show each completion's mean token advantage in TRL's completions table (TRL logged its
        own per-completion advantages just before)."""
        row_mean = masked_mean(advantages, mask.bool(), dim=1)
        gathered = self.accelerator.gather(row_mean.contiguous()).tolist()
        logs = self._logs["advantages"]
        for _ in range(min(len(gathered), len(logs))):
            logs.pop()
        logs.extend(gathered)

    # -- saving and resuming the credit method's state ---------------------------------------
    def save_credit_state(self, output_dir: str | Path) -> Path | None:
        """Write the credit method's state (the value head) to ``output_dir/value_head.pt`` and
        the run's rredcot settings (method, credit config, task, sampling, and what ``auto``
        chose) to ``output_dir/rredcot_credit.json``, which ``rredcot explain --run output_dir``
        reads. Nothing before ``auto`` chose."""
        method = self.credit_method
        if not self.args.should_save or method is None:
            return None
        example = state.example_row(self.task, self.train_dataset, self._problem)
        return state.write_credit(
            output_dir, method, self.args, self.temperature, self.credit_choice, example
        )

    def load_credit_state(self, checkpoint_dir: str | Path) -> bool:
        """Read ``value_head.pt`` from a checkpoint or model directory; False if it has none.
        With ``auto`` not yet chosen, the checkpoint's choice (``rredcot_credit.json``) is used,
        with the credit config it saved, so a resumed run keeps its method."""
        if self.credit_method is None:
            saved = state.saved_choice(checkpoint_dir, self.args.credit_config)
            if saved is None:
                return False  # nothing chosen there: the first generation batch chooses
            self._use_choice(*saved)
        return state.load_method_state(checkpoint_dir, self.credit_method)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        self.save_credit_state(output_dir or self.args.output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.load_credit_state(checkpoint)

"""rredcot credit inside TRL's ``GRPOTrainer`` (``pip install 'rredcot[trl]'``).

TRL keeps everything it does well: sampling (transformers or vLLM), reward functions, datasets,
the clipped loss, ``accelerate launch`` / DeepSpeed / FSDP, logging and checkpoints. This adapter
changes one thing: the advantages. TRL 1.16 computes one advantage per completion at the end of
``GRPOTrainer._generate_and_score_completions``; :class:`RREDCoTGRPOTrainer` lets that method run
unchanged, then replaces ``output["advantages"]`` with rredcot's ``(B, T)`` token advantages. TRL's
``_compute_loss`` takes ``(B, T)`` advantages as they are (it unsqueezes only 1-D ones), so the loss
is not overridden.

Per generation batch, on each process (the local rows):

1. the outcome reward ``R`` of each completion is the weighted sum of TRL's reward functions (as
   ``multi_objective_aggregation="sum_then_normalize"`` computes it, before normalisation);
2. completions are decoded with token offsets and segmented (``rredcot.integrations._batch``);
3. credit methods that read hidden states (the value head) get them from TRL's own no-grad
   old-log-prob pass when TRL runs one (``steps_per_generation > gradient_accumulation_steps``,
   ``num_iterations > 1``, or vLLM with importance-sampling correction): a forward hook on the
   decoder keeps them, so values cost no extra forward. Otherwise TRL skips that pass (its loss
   uses the live log-probs) and the adapter runs one no-grad forward itself (metric
   ``rredcot/extra_forward`` = 1);
4. ``method.compute(batch)`` gives the advantages; then, in training only, the method learns
   (``update``; the value head trains here, after the credit of the step, on the boundary features
   gathered from every process, so every process holds the same head).

The credit method's state (the value head) is written as ``value_head.pt`` next to every
checkpoint and the final model, and read back on ``train(resume_from_checkpoint=...)``.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rredcot import credit
from rredcot.config import CreditConfig, from_dict
from rredcot.integrations._batch import rollout_batch_from_tensors
from rredcot.methods.base import CreditContext, RolloutBatch, build_credit, get_credit
from rredcot.segment import get_segmenter
from rredcot.tasks import get_task
from rredcot.tasks.base import Problem, Task, Verdict, safe_verify

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as err:  # pragma: no cover - the extra is not installed
    raise ImportError("rredcot.integrations.trl needs TRL: pip install 'rredcot[trl]'") from err

__all__ = [
    "CREDIT_STATE_FILE",
    "TRL_METHODS",
    "RREDCoTGRPOConfig",
    "RREDCoTGRPOTrainer",
    "task_reward",
]

CREDIT_STATE_FILE = "value_head.pt"
TRL_METHODS = ("value_head", "answer_likelihood", "uniform")


# ---------------------------------------------------------------------------------------------
# config


def _as_dict(value: dict | str | None, name: str) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{name} must be a dict or a JSON object string, got {value!r}"
            ) from err
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or a JSON object string, got {value!r}")
    return dict(value)


@dataclass
class RREDCoTGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the rredcot credit settings.

    ``credit`` holds fields of :class:`rredcot.config.CreditConfig` (``segmenter``, ``lam``,
    ``normalization``, ``value_*``, ``handover``, ...), as a dict in Python or a JSON string on
    the command line, e.g. ``--credit '{"segmenter": "sentence", "lam": 0.5}'``. TRL's
    ``scale_rewards`` is not used: ``credit["normalization"]`` decides (``auto``: group std for
    ``uniform``, as TRL does, ``group_or_batch_std`` for the others).
    """

    credit_method: str = field(
        default="value_head",
        metadata={
            "help": "rredcot credit method: value_head, answer_likelihood or uniform (GRPO)."
        },
    )
    credit: dict | str | None = field(
        default=None,
        metadata={
            "help": "Fields of rredcot.config.CreditConfig (segmenter, lam, normalization, "
            "value_lr, ...) as a dict or a JSON object string."
        },
    )
    task: str | None = field(
        default=None,
        metadata={
            "help": "rredcot task name (arithmetic, gsm8k, dataset, ...). answer_likelihood needs "
            "it to write its probes; with it, completions also get the task's verdicts."
        },
    )
    task_args: dict | str | None = field(
        default=None, metadata={"help": "Parameters of the task, a dict or JSON string."}
    )
    answer_column: str = field(
        default="answer",
        metadata={"help": "Dataset column with each prompt's reference answer (if any)."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.credit = _as_dict(self.credit, "credit")
        self.task_args = _as_dict(self.task_args, "task_args")
        get_credit(self.credit_method)  # unknown names list the valid ones
        if self.credit_method not in TRL_METHODS:
            raise ValueError(
                f"credit_method={self.credit_method!r} is not supported in TRL (it needs rredcot's "
                f"own sampling loop); use one of: {', '.join(TRL_METHODS)}"
            )
        if self.credit.get("value_logprob_features"):
            raise ValueError(
                "credit.value_logprob_features is not supported in TRL yet (the head trains on "
                "boundary features gathered across processes, which carry no log-probs); leave it "
                "unset"
            )
        if self.credit_config.value_pretrain_steps:
            raise ValueError(
                "credit.value_pretrain_steps is not supported in TRL (the head trains on TRL's "
                "batches from the first step; the reliability hand-over starts it on uniform "
                "credit); leave it 0"
            )
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "rredcot needs each completion's outcome reward R (the weighted sum of the reward "
                "functions); set multi_objective_aggregation='sum_then_normalize'"
            )
        if self.credit_method == "answer_likelihood" and not self.task:
            raise ValueError(
                "credit_method='answer_likelihood' needs task=... (e.g. 'gsm8k'): the task's "
                "render_answer writes the answer probes"
            )

    @property
    def credit_config(self) -> CreditConfig:
        """The :class:`CreditConfig` built from ``credit`` (unknown keys list the valid ones).
        The value head reads hidden states only here: ``value_logprob_features`` is off."""
        fields = {"value_logprob_features": False, **_as_dict(self.credit, "credit")}
        return from_dict(CreditConfig, fields, where="credit.")


# ---------------------------------------------------------------------------------------------
# reward functions from rredcot tasks


def _prompt_text(prompt: Any) -> str:
    """The user text of a standard (str) or conversational (list of messages) prompt."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        content = (users or prompt)[-1].get("content", "") if (users or prompt) else ""
        if isinstance(content, list):  # multimodal content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return str(content)
    return str(prompt)


def _completion_text(completion: Any) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def task_reward(task: str | Task, answer_column: str = "answer", **task_args: Any):
    """A TRL reward function that scores completions with an rredcot task's verifier.

    The dataset needs a ``prompt`` column and an ``answer_column`` with each reference answer.
    Verifier errors score 0 (``safe_verify``).
    """
    the_task = get_task(task, **task_args) if isinstance(task, str) else task

    def reward(prompts, completions, **kwargs) -> list[float]:
        if answer_column not in kwargs:
            raise ValueError(
                f"the dataset has no {answer_column!r} column with the reference answers "
                f"(columns seen: {sorted(k for k in kwargs if not k.startswith('trainer'))})"
            )
        answers = kwargs[answer_column]
        return [
            float(
                safe_verify(the_task, Problem(_prompt_text(p), str(a)), _completion_text(c)).reward
            )
            for p, c, a in zip(prompts, completions, answers)
        ]

    reward.__name__ = f"rredcot_{the_task.name}"
    return reward


# ---------------------------------------------------------------------------------------------
# hidden states from a forward pass TRL runs anyway


def _decoder(model) -> torch.nn.Module:
    """The transformer backbone whose output TRL's fused LM head reads."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(inner, "module", inner)  # DDP / DeepSpeed engine
    if hasattr(inner, "get_decoder"):
        return inner.get_decoder()
    return inner.base_model


@contextlib.contextmanager
def _capture_hidden_states(model, layers: tuple[int, ...], store: list[Tensor]):
    """While active, every forward of ``model``'s decoder also returns its hidden states, and
    the chosen layers (concatenated on the last dim, detached) are appended to ``store``."""
    decoder = _decoder(model)

    def pre(module, args, kwargs):
        kwargs["output_hidden_states"] = True
        return args, kwargs

    def post(module, args, kwargs, output):
        states = output.hidden_states
        store.append(torch.cat([states[i] for i in layers], dim=-1).detach())

    handles = [
        decoder.register_forward_pre_hook(pre, with_kwargs=True),
        decoder.register_forward_hook(post, with_kwargs=True),
    ]
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def _no_checkpointing(model, kwargs):
    try:
        from trl.models.utils import disable_gradient_checkpointing
    except ImportError:  # pragma: no cover - older/newer TRL layout
        return contextlib.nullcontext()
    return disable_gradient_checkpointing(model, kwargs)


def _boundary_batch(batch: RolloutBatch) -> RolloutBatch:
    """A compact batch holding only the hidden states at the segment boundaries.

    Row ``b`` becomes ``[s_0 | s_1 ... s_n]``: ``prompt_len = 1`` and boundaries ``[0, 1, ..., n]``,
    so ``boundary_positions`` of the compact batch point at the same features as those of the
    full batch. What a value head trains on is unchanged; it is small enough to gather across
    processes.
    """
    positions, mask = batch.boundary_positions()
    hs = batch.hidden_states
    rows = torch.arange(batch.size, device=hs.device).unsqueeze(1)
    feats = hs[rows, positions.clamp(min=0).to(hs.device)]
    feats = torch.where(mask.to(hs.device).unsqueeze(-1), feats, torch.zeros_like(feats))
    counts = batch.num_segments
    return _compact_from(feats, counts, batch.rewards, batch.group_ids)


def _compact_from(
    feats: Tensor, counts: Tensor, rewards: Tensor, group_ids: Tensor
) -> RolloutBatch:
    B, S1, _ = feats.shape
    device = feats.device
    counts = counts.to("cpu").long()
    boundaries = [list(range(int(n) + 1)) if int(n) > 0 else [0] for n in counts]
    cols = torch.arange(max(S1 - 1, 0)).unsqueeze(0)
    response_mask = (cols < counts.unsqueeze(1)).float().to(device)
    attention_mask = torch.cat([torch.ones(B, 1, device=device), response_mask], dim=1).long()
    return RolloutBatch(
        input_ids=torch.zeros(B, S1, dtype=torch.long, device=device),
        attention_mask=attention_mask,
        prompt_len=1,
        response_mask=response_mask,
        rewards=rewards.to(device),
        group_ids=group_ids.to(device),
        boundaries=boundaries,
        segment_ids=credit.boundaries_to_segment_ids(boundaries, S1 - 1, device=device),
        hidden_states=feats,
    )


# ---------------------------------------------------------------------------------------------
# the trainer


class RREDCoTGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose advantages come from an rredcot credit method (module docstring).

    Same constructor as ``GRPOTrainer``; ``args`` must be a :class:`RREDCoTGRPOConfig`. The
    credit method is ``trainer.credit_method`` (its value head, if any, at
    ``trainer.credit_method.head``).
    """

    def __init__(self, model, reward_funcs=None, args: RREDCoTGRPOConfig | None = None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = RREDCoTGRPOConfig(f"{str(name).split('/')[-1] or 'model'}-RREDCoT-GRPO")
        if not isinstance(args, RREDCoTGRPOConfig):
            raise TypeError(
                f"args must be an RREDCoTGRPOConfig (a GRPOConfig with the credit settings), got "
                f"{type(args).__name__}; build it with RREDCoTGRPOConfig(**your_grpo_kwargs, "
                "credit_method=..., credit={...})"
            )
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        c = args.credit_config
        self.segmenter = get_segmenter(
            c.segmenter,
            min_chars=c.min_chars,
            max_segments=c.max_segments or None,
            separate_answer=c.separate_answer,
        )
        self.task: Task | None = get_task(args.task, **args.task_args) if args.task else None
        self.credit_method = build_credit(
            args.credit_method,
            c,
            CreditContext(
                policy=self.model,
                tokenizer=self._tokenizer,
                task=self.task,
                segmenter=self.segmenter,
                device=self.accelerator.device,
            ),
        )
        self._hidden_layers = (
            tuple(self.credit_method.hidden_layers)
            if self.credit_method.needs_hidden_states
            else None
        )
        self.last_batch: RolloutBatch | None = None  # the last generation batch, for inspection
        self.last_credit = None  # its CreditOutput
        self._rewards_per_func: Tensor | None = None
        self._capture_armed = False
        self._captured: list[Tensor] = []

    # -- what TRL computes, kept for the credit -----------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        self._rewards_per_func = rewards_per_func  # (N_all_processes, num_funcs), before scaling
        return rewards_per_func

    def _trl_runs_old_logprob_pass(self) -> bool:
        """Whether TRL 1.16's ``_generate_and_score_completions`` runs its no-grad old-log-prob
        forward on ``self.model`` (the same condition it uses)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        # Armed only around TRL's old-log-prob pass, which is its first call on self.model in a
        # generation step (a PEFT reference pass, also on self.model, comes after it).
        if not self._capture_armed or model is not self.model:
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        self._capture_armed = False
        with _capture_hidden_states(model, self._hidden_layers, self._captured):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    # -- the override -------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        self._captured = []
        self._capture_armed = self._hidden_layers is not None and self._trl_runs_old_logprob_pass()
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._capture_armed = False
        return self._apply_credit(inputs, output)

    def _hidden_states(self, output: dict, mode: str) -> Tensor:
        """``(B, P+T, D)`` hidden states of the local rows: captured from TRL's pass, or from one
        no-grad forward of our own (TRL skipped its pass)."""
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        captured = torch.cat(self._captured, dim=0) if self._captured else None
        self._captured = []
        extra = captured is None or tuple(captured.shape[:2]) != tuple(ids.shape)
        if extra:
            store: list[Tensor] = []
            batch_size = (
                self.args.per_device_train_batch_size
                if mode == "train"
                else self.args.per_device_eval_batch_size
            )
            with (
                torch.no_grad(),
                _no_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
                _capture_hidden_states(self.model, self._hidden_layers, store),
            ):
                super()._get_per_token_logps_and_entropies(
                    self.model, ids, mask, output["completion_ids"].size(1), batch_size=batch_size
                )
            captured = torch.cat(store, dim=0)
        self._metrics[mode]["rredcot/extra_forward"].append(float(extra))
        return captured

    def _local_rewards(self, start: int, size: int, num_generations: int) -> tuple[Tensor, Tensor]:
        """Outcome rewards of the local rows; unscorable rows (every reward function returned
        None) get their group's mean so they move no statistic (their response is masked)."""
        if self._rewards_per_func is None:
            raise RuntimeError(
                "rewards were not computed before the credit (TRL internals changed?)"
            )
        rpf = self._rewards_per_func
        weights = self.reward_weights.to(rpf.device).unsqueeze(0)
        rewards = (rpf * weights).nansum(dim=1)
        rewards[torch.isnan(rpf).all(dim=1)] = torch.nan
        rewards = rewards[start : start + size].float()
        groups = rewards.view(-1, num_generations)
        mean = torch.nanmean(groups, dim=1, keepdim=True).nan_to_num(0.0)
        filled = torch.where(torch.isnan(groups), mean.expand_as(groups), groups)
        return filled.view(-1), torch.isnan(rewards)

    def _apply_credit(self, inputs: list[dict], output: dict) -> dict:
        """Replace TRL's per-completion advantages with rredcot's ``(B, T)`` token advantages."""
        mode = "train" if self.model.training else "eval"
        G = self.num_generations if mode == "train" else self.num_generations_eval
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        B = completion_ids.shape[0]
        if B % G:
            raise ValueError(
                f"each process must hold whole prompt groups for rredcot credit: it has {B} "
                f"completions and num_generations={G}. Make per_device_{mode}_batch_size x "
                "steps_per_generation a multiple of num_generations"
            )
        start = self.accelerator.process_index * B
        rewards, unscorable = self._local_rewards(start, B, G)
        # Segments cover every completion token (a prefix mask); unscorable rows get none. The
        # advantages are then masked like TRL's loss (tool-output tokens excluded).
        live_mask = completion_mask * (~unscorable).to(completion_mask.dtype).unsqueeze(1)
        loss_mask = live_mask * output["tool_mask"] if "tool_mask" in output else live_mask
        group_ids = torch.arange(start, start + B, device=completion_ids.device) // G

        problems = [
            Problem(_prompt_text(x.get("prompt", "")), str(x.get(self.args.answer_column, "")))
            for x in inputs
        ]
        hidden = self._hidden_states(output, mode) if self._hidden_layers is not None else None
        batch = rollout_batch_from_tensors(
            prompt_ids=output["prompt_ids"],
            prompt_mask=output["prompt_mask"],
            completion_ids=completion_ids,
            completion_mask=live_mask,
            rewards=rewards,
            group_ids=group_ids,
            tokenizer=self._tokenizer,
            segmenter=self.segmenter,
            eos_token_ids=self.eos_token_ids,
            problems=problems,
            hidden_states=hidden,
        )
        batch.attention_mask[:, batch.prompt_len :] = completion_mask.long()  # what the model saw
        batch.verdicts = self._verdicts(batch)

        self.credit_method.context.policy = self.model  # the prepared (possibly wrapped) model
        out = self.credit_method.compute(batch)
        advantages = out.advantages.to(device=completion_ids.device, dtype=torch.float32)
        output["advantages"] = advantages * loss_mask.to(advantages.dtype)
        self._log_credit(out.metrics, mode)
        self._log_row_advantages(output["advantages"], loss_mask)
        if mode == "train":
            self._log_credit(self._update_credit(batch), mode)
        self.last_batch, self.last_credit = batch, out
        return output

    def _verdicts(self, batch: RolloutBatch) -> list[Verdict]:
        if self.task is None:
            return [
                Verdict(float(r), None, None, "scored by the TRL reward functions")
                for r in batch.rewards.tolist()
            ]
        return [safe_verify(self.task, p, c) for p, c in zip(batch.problems, batch.completions)]

    def _update_credit(self, batch: RolloutBatch) -> dict[str, float]:
        """Train the credit method on this step's outcomes (after its credit was computed)."""
        if self._hidden_layers is None:
            return self.credit_method.update(batch)
        compact = _boundary_batch(batch)
        if self.accelerator.num_processes > 1:
            acc = self.accelerator
            feats = acc.gather(acc.pad_across_processes(compact.hidden_states.contiguous(), dim=1))
            compact = _compact_from(
                feats,
                acc.gather(batch.num_segments.to(acc.device)),
                acc.gather(batch.rewards.contiguous()),
                acc.gather(batch.group_ids.contiguous()),
            )
        return self.credit_method.update(compact)

    def _log_credit(self, metrics: dict[str, float], mode: str) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._metrics[mode][key].append(float(value))

    def _log_row_advantages(self, advantages: Tensor, mask: Tensor) -> None:
        """Show each completion's mean token advantage in TRL's completions table (TRL logged its
        own per-completion advantages just before)."""
        row_mean = credit.masked_mean(advantages, mask.bool(), dim=1)
        gathered = self.accelerator.gather(row_mean.contiguous()).tolist()
        logs = self._logs["advantages"]
        for _ in range(min(len(gathered), len(logs))):
            logs.pop()
        logs.extend(gathered)

    # -- saving and resuming the credit method's state ---------------------------------------
    def save_credit_state(self, output_dir: str | Path) -> Path | None:
        """Write the credit method's state (the value head) to ``output_dir/value_head.pt``."""
        state = self.credit_method.state_dict()
        if not state or not self.args.should_save:
            return None
        path = Path(output_dir) / CREDIT_STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"credit_method": self.args.credit_method, "state": state}, path)
        return path

    def load_credit_state(self, checkpoint_dir: str | Path) -> bool:
        """Read ``value_head.pt`` from a checkpoint or model directory; False if it has none."""
        path = Path(checkpoint_dir) / CREDIT_STATE_FILE
        if not path.exists():
            return False
        saved = torch.load(path, map_location=self.accelerator.device, weights_only=True)
        if saved.get("credit_method") != self.args.credit_method:
            raise ValueError(
                f"{path} holds the state of credit method {saved.get('credit_method')!r}, but "
                f"this trainer uses {self.args.credit_method!r}"
            )
        self.credit_method.load_state_dict(saved["state"])
        return True

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        self.save_credit_state(output_dir or self.args.output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.load_credit_state(checkpoint)

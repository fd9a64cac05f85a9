"""``rredcot train``'s config: ``TrainConfig`` (the run's own settings, with the sections nested in
it: ``model``, ``sampling``, ``credit``, ``references``), the checks that span sections, and the
fields a resume may change (``RESUMABLE_FIELDS``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rredcot.config.credit import BUILTIN_CREDIT_METHODS, CreditConfig
from rredcot.config.fields import (
    help_field,
    refuse_bad_seed,
    refuse_bad_threads,
    refuse_blank_path,
    refuse_non_finite,
)
from rredcot.config.model import ModelConfig
from rredcot.config.references import ReferencesConfig
from rredcot.config.sampling import SamplingConfig
from rredcot.machine import refuse_beyond_memory
from rredcot.tasks import list_tasks

TASK_HELP = f"Task name: {', '.join(list_tasks())} (rredcot.tasks.register_task adds others)."
"""``--task``'s help, from the task registry (``rredcot.tasks.list_tasks``)."""


@dataclass
class TrainConfig:
    task: str = help_field(TASK_HELP, default="arithmetic")
    task_args: dict = help_field(
        "Task parameters (CLI: --task.NAME VALUE, e.g. --task.num_steps 4).", default_factory=dict
    )
    credit_method: str = help_field(
        f"Credit method: auto, {', '.join(BUILTIN_CREDIT_METHODS)} (oracle is benchmark only: "
        "it reads the verifier's step labels; rredcot.methods.base.register_credit adds "
        "others). auto chooses "
        "from step 1's own batch (nothing sampled extra): a method measured ahead of GRPO per "
        "second on a testbed and a model like the run's (rredcot/measurements/credit_auto.json), "
        "else uniform "
        "(no method is yet: auto runs uniform on the measured testbeds); the choice and its "
        "figures are logged and written to the run's credit_choice.json, and config.yaml holds "
        "the chosen method (docs/diagnose.md).",
        default="auto",
    )
    init: str | None = help_field(
        "Policy checkpoint directory to start from (e.g. from `rredcot sft`); takes precedence "
        "over --model.name_or_path.",
        default=None,
    )
    out: str = help_field(
        "Run directory. One that holds a run already is refused: continue it with --resume, or "
        "replace it with --overwrite.",
        default="runs/default",
    )
    resume: str | None = help_field(
        "Resume the run in this directory from its newest valid checkpoint. Only steps, "
        "max_tokens_generated, max_train_seconds, max_compute, eval_every, eval_size, "
        "checkpoint_every, keep_checkpoints, report_to, progress, threads, device, "
        "sampling.decoder, shared_prompt_forward, skip_zero_advantage_rows, "
        "micro_batch_tokens and probe_from_cache may change.",
        default=None,
    )
    overwrite: bool = help_field(
        "Replace the run in --out (its config, metrics, checkpoints and plots) with a new one.",
        default=False,
    )
    seed: int = help_field("Random seed; on CPU a seed fixes the run.", default=0)
    steps: int = help_field("RL steps (one batch of prompts each).", default=60)
    prompts_per_step: int = help_field("Prompts per RL step.", default=16)
    lr: float | None = help_field(
        "Policy learning rate. Empty (the default): by the policy's kind (MODEL_DEFAULTS), "
        "1e-4 for the built-in character model (tuned on the default task: "
        "benchmarks/results/headroom/arith4_default_tuning), 3e-5 for a language model with a "
        "subword vocabulary, such as SmolLM2-135M-Instruct (GRPO's rate of 1e-5 and 3e-5 on "
        "word_problems: benchmarks/results/smollm2/word_problems_tuning; 1e-4 there halves its "
        "accuracy in three steps; for longer generations pass 1e-5: at 128 new tokens 3e-5 fell on "
        "five of the eight fresh seeds of benchmarks/results/smollm2/ceiling and 1e-5 ended "
        "higher on each). The run logs the value it used and config.yaml holds it.",
        default=None,
    )
    lr_schedule: str = help_field("constant, linear or cosine (after warm-up).", default="constant")
    warmup_steps: int = help_field("Linear LR warm-up steps.", default=0)
    weight_decay: float = help_field("AdamW weight decay.", default=0.0)
    epochs_per_batch: int = help_field(
        "Optimisation passes over each rollout batch. With 1 epoch and 1 minibatch (the "
        "defaults) the update is on-policy: the PPO ratio is exactly 1 and clipping never acts.",
        default=1,
    )
    minibatches: int = help_field(
        "Minibatches per pass (one optimiser step each); more than 1 makes later minibatches "
        "off-policy, where the PPO clip acts.",
        default=1,
    )
    grad_accumulation: int = help_field("Micro-batches accumulated into each minibatch.", default=1)
    single_forward: bool = help_field(
        "On-policy updates (1 epoch, 1 minibatch, no accumulation) run ONE policy forward per "
        "step: the loss forward, whose detached log-probs, hidden states and entropies feed the "
        "credit before the loss is formed. A batch larger than one micro-batch "
        "(micro_batch_tokens) keeps one forward where the credit reads none (uniform, the probe "
        "methods) and takes a scoring pass where it reads hidden states or entropies. False: a "
        "separate no-grad scoring pass as well (always used for off-policy updates; metric "
        "forward/scoring_pass says which ran).",
        default=True,
    )
    skip_zero_advantage_rows: bool = help_field(
        "Leave out of the loss forward the rows whose advantages are all zero (uniform credit "
        "in a group whose samples all got the same reward), and cut every other row after its "
        "last token with a non-zero advantage (segment credit that ends early): with no KL "
        "term their loss terms and gradients are exactly zero, so the loss, gradients and "
        "update are the same for less work (under several processes too: each cuts its own "
        "rows, and one with none runs a stand-in pass of zero weight). The entropy, ratio and "
        "clip metrics then cover the tokens that were forwarded (update/rows_forwarded and "
        "update/tokens_forwarded say what share). False: forward every row whole.",
        default=True,
    )
    advantage_tail_floor: float = help_field(
        "Drop the tail of each row's credit where it is smaller than this: token advantages "
        "after a row's last token with |advantage| >= advantage_tail_floor are set to 0, so "
        "with skip_zero_advantage_rows the update stops at that token (a row with none is "
        "skipped). Value credit is rarely exactly zero (a wrong trace's values after its "
        "error are small, not 0), so 0 (the exact gradient) forwards nearly every row whole; "
        "0.01 drops a tiny share of the advantages' mass for a much shorter update "
        "(docs/results.md). GRPO's advantages are never that small: it is unchanged. In [0, 1).",
        default=0.0,
    )
    agreeing_update_fraction: float = help_field(
        "The expected share of the agreeing groups' credited tokens (groups whose samples all "
        "got the same reward: GRPO gives them 0, finer credit does not) that the update "
        "forwards. Each such row is drawn with probability proportional to its credit's norm "
        "over the square root of its length (capped at 1) and its advantages divided by that "
        "probability, so the expected gradient is the full one; rows not drawn are skipped "
        "(skip_zero_advantage_rows). 1: every row. Under several processes the rows of "
        "every process are drawn as one batch.",
        default=1.0,
    )
    shared_prompt_forward: bool = help_field(
        "Policy forwards (loss, scoring, KL reference) compute each distinct prompt once for "
        "all of its samples, on the Llama-family models the fast decoder supports: the same "
        "loss and gradients to float rounding for G-fold less work on the prompt tokens. Falls "
        "back to the model's own forward elsewhere (other models, gradient checkpointing, "
        "distributed wrappers). False: always the model's own forward.",
        default=True,
    )
    probe_from_cache: bool = help_field(
        "The probe credit methods (answer_likelihood, continuation_likelihood, the value head's "
        "alik_feature and continuation teacher) score their probes against the fast decoder's "
        "KV cache of the step's own sampling: only the probe tokens are forwarded, not each "
        "trace's prompt and prefix again (the same log-probs to float rounding; the cache stays "
        "in memory from sampling until the credit is computed). Where the cache cannot serve "
        "(Hugging Face generate, models the fast decoder does not support, tree sampling, "
        "generation in several parts under a memory limit, rows added after sampling) the "
        "probes re-forward their prefixes; metric credit/probe_from_cache says what share "
        "came from the cache. False: always re-forward.",
        default=True,
    )
    max_grad_norm: float = help_field("Gradient clipping norm (0: off).", default=1.0)
    clip_eps_low: float = help_field("PPO ratio clip below 1.", default=0.2)
    clip_eps_high: float = help_field("PPO ratio clip above 1 (DAPO's clip-higher).", default=0.28)
    loss_agg: str = help_field(
        "Loss aggregation: token_mean, seq_mean or dr_grpo.", default="token_mean"
    )
    kl_coef: float = help_field(
        "KL (k3) penalty to the frozen reference policy (0: no reference).", default=0.0
    )
    max_tokens_generated: int = help_field(
        "Token budget: stop once the sampled tokens reach it, counting the policy's rollouts "
        "plus the tokens a credit method generates on top (Monte Carlo continuations) and the "
        "reference tokens trained on (references.mode); 0: no budget, only `steps` ends the run.",
        default=0,
    )
    max_train_seconds: float = help_field(
        "Time budget: stop once the run's training seconds reach it (the sum of the steps' "
        "step_seconds: rollout, scoring, credit and update; evaluation, checkpoints and start-up "
        "excluded); 0: no time budget.",
        default=0.0,
    )
    max_compute: float = help_field(
        "Compute budget in forward-token equivalents (FLOPs / 2N, N the policy's parameters): "
        "stop once the run's compute reaches it. A token sampled, scored (the loss's no-grad "
        "pass, the KL reference, the credit method's extra forwards) or generated by the credit "
        "method counts 1 (a forward, 2N FLOPs), a token the update forwards and "
        "back-propagates counts 3 per epoch (forward 2N + backward 4N; rows and tails left out "
        "by skip_zero_advantage_rows are not, sft references are); 0: no compute budget.",
        default=0.0,
    )
    eval_every: int = help_field(
        "Greedy evaluation every N steps (0: only at start and end).", default=10
    )
    eval_size: int = help_field("Held-out prompts in each greedy evaluation.", default=128)
    checkpoint_every: int = help_field("Checkpoint every N steps.", default=10)
    keep_checkpoints: int = help_field(
        "Checkpoints kept on disk (the newest ones); 0 keeps every checkpoint.", default=2
    )
    report_to: str = help_field(
        "Metric sink besides metrics.jsonl: none, tensorboard or wandb.", default="none"
    )
    device: str = help_field("Device: auto, cpu, cuda, mps.", default="auto")
    progress: bool = help_field("Show a progress bar.", default=True)
    threads: int = help_field(
        "CPU threads for torch. 0 (auto): on the CPU, the cores that are idle when the run "
        "starts (measured over a quarter second; at least 1): on an idle 2-core machine the "
        "tiny model's steps are about 1.5x faster with 2 threads than with 1, and threads "
        "beyond the idle cores only contend with other jobs; torch's default on accelerators.",
        default=0,
    )
    micro_batch_tokens: int = help_field(
        "Tokens (rows x padded length) forwarded at a time by every pass over a batch (the "
        "update, with gradients accumulated across micro-batches; the old-log-prob, reference "
        "and credit scoring passes), so memory grows with this, not the batch; a micro-batch "
        "holds at least one row. The update's gradient is the whole batch's (to float rounding; "
        "identical where the batch fits one micro-batch). 0 (auto): a budget of min(available "
        "memory / 8, 1 GiB) on the CPU, free GPU memory / 4 on a GPU, divided by 4 x (3 x "
        "vocabulary + 16 x hidden size x layers) bytes per token (at least 64); the run logs "
        "the value (docs/memory.md).",
        default=0,
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    credit: CreditConfig = field(default_factory=CreditConfig)
    references: ReferencesConfig = field(default_factory=ReferencesConfig)

    def loss_settings(self) -> dict[str, Any]:
        """The policy loss's settings, as ``rredcot.algebra.loss.LossSettings`` takes them."""
        return {
            "clip_eps_low": self.clip_eps_low,
            "clip_eps_high": self.clip_eps_high,
            "loss_agg": self.loss_agg,
            "max_len": self.sampling.max_new_tokens,
            "kl_coef": self.kl_coef,
            "off_policy_gamma": self.references.shaping_gamma,
        }

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        self._check_ranges()
        if self.loss_agg not in ("token_mean", "seq_mean", "dr_grpo"):
            raise ValueError(f"loss_agg={self.loss_agg!r}: use token_mean, seq_mean or dr_grpo")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"lr_schedule={self.lr_schedule!r}: use constant, linear or cosine")
        if self.report_to not in ("none", "tensorboard", "wandb"):
            raise ValueError(f"report_to={self.report_to!r}: use none, tensorboard or wandb")
        if not isinstance(self.probe_from_cache, bool):
            raise ValueError(f"probe_from_cache={self.probe_from_cache!r}: give true or false")
        refuse_blank_path(self.out)
        if self.resume is not None and not self.resume.strip():
            raise ValueError("resume='' names no run directory; give --resume RUN_DIR")
        self._check_sections_agree()
        self.refuse_sizes_beyond_memory()

    def _check_sections_agree(self) -> None:
        """Refuse settings of two sections (or of a section and the run) that cannot go together;
        each section checks its own fields in its ``__post_init__``."""
        if self.references.mode in ("luffy", "bread") and self.sampling.tree.enabled:
            raise ValueError(
                f"references.mode {self.references.mode} adds rows to independent groups; it "
                "does not join tree groups: turn sampling.tree.enabled off or use "
                "references.mode sft"
            )
        if self.references.mode == "bread" and self.credit_method != "uniform":
            raise ValueError(
                "references.mode bread runs with credit_method uniform (a branched rollout "
                "starts inside the reference, where other methods' per-step values are not "
                f"defined), not {self.credit_method!r}: set --credit uniform"
            )

    def _check_ranges(self) -> None:
        """Refuse a number outside its field's range, naming the range."""
        if self.lr is not None and self.lr < 0:
            raise ValueError(f"lr={self.lr} must be >= 0 (empty: the model's default)")
        for name in ("weight_decay", "max_grad_norm", "kl_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.advantage_tail_floor < 1:
            raise ValueError(
                f"advantage_tail_floor={self.advantage_tail_floor} must be in [0, 1): a floor on "
                "the normalised advantages, which are about 1 in size (0.01 drops a tiny share; "
                "1 or more zeroes GRPO's own credit)"
            )
        if not 0 < self.agreeing_update_fraction <= 1:
            raise ValueError(
                f"agreeing_update_fraction={self.agreeing_update_fraction} must be in (0, 1] "
                "(1 updates on every agreeing row)"
            )
        for name in ("warmup_steps", "eval_every", "keep_checkpoints"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.steps < 0:
            raise ValueError("steps must be >= 0")
        if self.prompts_per_step < 1:
            raise ValueError("prompts_per_step must be >= 1")
        for name in ("epochs_per_batch", "minibatches", "grad_accumulation", "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not (0 <= self.clip_eps_low < 1 and self.clip_eps_high >= 0):
            raise ValueError("clip_eps_low must be in [0, 1) and clip_eps_high >= 0")
        if self.checkpoint_every < 1:
            raise ValueError("checkpoint_every must be >= 1")
        refuse_bad_threads(self.threads)
        refuse_bad_seed(self.seed)
        if self.micro_batch_tokens < 0:
            raise ValueError(f"micro_batch_tokens={self.micro_batch_tokens} must be >= 0 (0: auto)")
        if self.max_tokens_generated < 0:
            raise ValueError(
                f"max_tokens_generated={self.max_tokens_generated} must be >= 0 (0: no budget)"
            )
        for name in ("max_train_seconds", "max_compute"):
            if not getattr(self, name) >= 0:  # NaN fails too
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0: no budget)")

    def refuse_sizes_beyond_memory(self) -> None:
        """Refuse the batch, evaluation and Monte Carlo sizes that cannot fit this machine (again
        once ``sampling.max_new_tokens`` = 0 is the task's length: ``train_setup``)."""
        tokens = self.sampling.max_new_tokens  # 0: the task's, at least one
        group = self.sampling.num_generations
        branches = self.references.branch_rollouts or group
        rows = self.prompts_per_step * (
            group + (branches if self.references.mode == "bread" else 0)
        )
        refuse_beyond_memory(
            f"prompts_per_step={self.prompts_per_step} x (sampling.num_generations={group}"
            + (
                f" + references.branch_rollouts={branches})"
                if self.references.mode == "bread"
                else ")"
            ),
            rows,
            tokens,
            "lower them",
        )
        refuse_beyond_memory(f"eval_size={self.eval_size}", self.eval_size, tokens, "lower it")
        if self.credit_method == "monte_carlo":  # a boundary's continuations are sampled at once
            k = self.credit.monte_carlo.rollouts
            refuse_beyond_memory(f"credit.monte_carlo.rollouts={k}", k, tokens, "lower it")


RESUMABLE_FIELDS = (
    "steps",
    "max_tokens_generated",
    "max_train_seconds",
    "max_compute",
    "eval_every",
    "eval_size",
    "checkpoint_every",
    "keep_checkpoints",
    "report_to",
    "progress",
    "threads",
    "device",
    "sampling.decoder",
    "shared_prompt_forward",
    "skip_zero_advantage_rows",
    "micro_batch_tokens",
    "probe_from_cache",
)
"""Fields of a ``TrainConfig`` that ``--resume`` may change: how long the run goes on and how it
is evaluated, checkpointed, logged and placed, never what it trains."""

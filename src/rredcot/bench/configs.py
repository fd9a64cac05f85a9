"""The benchmarks' configurations, free of torch so that ``rredcot bench --help`` (whose flag
defaults come from them) starts fast. Each benchmark module re-exports its own:
``rredcot.bench.credit.CreditBenchConfig``, ``rredcot.bench.learn.LearnBenchConfig``,
``rredcot.bench.overhead.OverheadBenchConfig``, ``rredcot.bench.peer.PeerBenchConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CreditBenchConfig:
    checkpoint: str
    methods: str = "uniform,value_head,answer_likelihood,monte_carlo,gradient,attention,first_last"
    segmenters: str = "newline"
    task: str | None = None  # default: the checkpoint's task, else arithmetic
    task_args: dict = field(default_factory=dict)
    prompts: int = 32
    samples: int = 8
    mc_k: int = 32
    lam: float = 0.0
    out: str = "bench/credit"
    seed: int = 0
    value_fit_batches: int = 20
    value_fit_prompts: int = 16
    run: str | None = None  # load learned method states from this training run instead
    max_new_tokens: int | None = None  # default: the run's sampling.max_new_tokens, else 64
    temperature: float = 1.0
    top_p: float = 1.0
    blame_threshold: float = 0.0
    chunk_prompts: int = 16
    examples: int = 2
    overrides: dict = field(default_factory=dict)  # dotted credit.* defaults for every variant
    device: str = "auto"

    def __post_init__(self) -> None:
        for name in ("prompts", "samples", "mc_k", "chunk_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        for name in ("value_fit_batches", "value_fit_prompts", "examples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam={self.lam} must be in [0, 1]")


@dataclass
class LearnBenchConfig:
    methods: str = "uniform,value_head,answer_likelihood,monte_carlo"
    seeds: int = 3
    first_seed: int = 0
    budget_tokens: int = 200_000
    init: str | None = None  # default: the train config's init, else the default warm-start
    out: str = "bench/learn"
    steps_max: int = 1000
    eval_every: int | None = None  # default: the train config's
    eval_size: int | None = None
    target_acc: float | None = None  # default: mean warm-start accuracy + target_delta
    target_delta: float = 0.1
    config: str | None = None  # YAML TrainConfig every run starts from
    overrides: dict = field(default_factory=dict)  # dotted TrainConfig overrides (--set)
    task: str | None = None
    task_args: dict = field(default_factory=dict)
    variance_probes: int = 3
    variance_prompts: int = 8
    variance_minibatch: int = 2
    variance_bootstrap: int = 200
    progress: bool = False

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ValueError("--seeds must be >= 1")
        if self.budget_tokens < 1:
            raise ValueError("--budget-tokens must be >= 1 (sampled tokens per run)")
        if self.steps_max < 1:
            raise ValueError("--steps-max must be >= 1")
        if self.variance_probes < 0 or self.variance_prompts < 1:
            raise ValueError("--variance-probes must be >= 0 and --variance-prompts >= 1")
        if self.variance_minibatch < 1 or self.variance_bootstrap < 1:
            raise ValueError("--variance-minibatch and --variance-bootstrap must be >= 1")


@dataclass
class OverheadBenchConfig:
    methods: str = "uniform,value_head,answer_likelihood,monte_carlo"
    steps: int = 20
    warmup: int = 2
    init: str | None = None
    out: str = "bench/overhead"
    seed: int = 0
    reset_policy: bool = True
    config: str | None = None
    overrides: dict = field(default_factory=dict)
    task: str | None = None
    task_args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError("--steps must be >= 1 (timed rounds)")
        if self.warmup < 0:
            raise ValueError("--warmup must be >= 0")


@dataclass
class PeerBenchConfig:
    model: str | None = None  # default: the task's default model (tiny warm-start on arithmetic)
    task: str = "arithmetic"
    task_args: dict = field(default_factory=dict)
    prompts: int = 16
    generations: int = 8
    max_new_tokens: int | None = None  # default: the task's suggestion, else 64
    steps: int = 20
    warmup: int = 3
    repeats: int = 4
    threads: int = 0
    lr: float = 1e-5
    seed: int = 0
    trl_overrides: dict = field(default_factory=dict)
    out: str = "bench/peer"
    timeout: float = 7200.0  # per process

    def __post_init__(self) -> None:
        for name in ("prompts", "generations", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1")
        if self.warmup < 0 or self.threads < 0:
            raise ValueError("--warmup and --threads must be >= 0")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")

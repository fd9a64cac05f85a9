"""Memory bounded by a micro-batch: the token budget of each forward, and what a run needs.

The trainer's passes over a batch (the policy update, the old-log-prob and reference passes)
forward it ``micro_batch_tokens`` tokens (rows x padded length) at a time, and sampling generates
:func:`generation_rows` rows at a time, so their memory grows with the micro-batch, not the batch
(the credit methods' probe passes have token budgets of their own); whether a step's loss forward
can keep its graph while the credit is computed is its :func:`forward_plan`. Unset, the budget is
chosen from the model's size and the free memory (:func:`auto_micro_batch_tokens`). A run whose batch
would not fit is refused before it samples (:func:`check_run_fits`), naming the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rredcot.errors import UserError

GIB = 1 << 30

ACTIVATIONS_PER_LAYER = 16
"""Hidden-width float32 activations a Llama-style layer keeps per token for its backward (norms,
q/k/v/o, the MLP's gate, up and activation at ~3x the width): the rule's estimate."""

LOGIT_COPIES = 3
"""Vocabulary-width float32 tensors per token in the update: the logits, their gradient, and the
head's working copy (the log-softmax itself runs in bounded chunks)."""

CPU_BUDGET_CAP = GIB
"""On the CPU a micro-batch's forward-and-backward memory is at most this (and an eighth of the
available memory): a fixed cap keeps a run's peak independent of what else the machine runs."""


@dataclass(frozen=True)
class ModelShape:
    """What a forward's memory depends on: sizes read from the model's config."""

    vocab: int
    hidden: int
    layers: int
    kv_width: int  # key (= value) features per token per layer: kv_heads x head_dim
    parameters: int
    trainable: int
    param_bytes: int  # bytes per parameter (2: bf16/fp16, 4: fp32)

    @classmethod
    def of(cls, policy) -> ModelShape:
        config = getattr(policy, "config", None)
        get = lambda name, default=0: int(getattr(config, name, None) or default)  # noqa: E731
        hidden = get("hidden_size") or get("n_embd") or get("d_model")
        layers = get("num_hidden_layers") or get("n_layer") or get("num_layers")
        heads = get("num_attention_heads", 1)
        head_dim = get("head_dim") or (hidden // max(heads, 1))
        kv_heads = get("num_key_value_heads") or heads
        params = list(policy.parameters())
        first = params[0] if params else torch.empty(0)
        return cls(
            vocab=get("vocab_size"),
            hidden=hidden,
            layers=layers,
            kv_width=kv_heads * head_dim,
            parameters=sum(p.numel() for p in params),
            trainable=sum(p.numel() for p in params if p.requires_grad),
            param_bytes=first.element_size() if first.is_floating_point() else 4,
        )

    def forward_bytes_per_token(self) -> int:
        """Bytes one token of a forward with its backward needs (the rule of
        :func:`auto_micro_batch_tokens`)."""
        logits = LOGIT_COPIES * 4 * self.vocab
        activations = ACTIVATIONS_PER_LAYER * 4 * self.hidden * self.layers
        return logits + activations


def available_bytes(device: torch.device | str = "cpu") -> int:
    """Free memory where the forwards run: CUDA's ``mem_get_info`` on a GPU, else the host's
    available memory (psutil, or ``MemAvailable`` of /proc/meminfo)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    raise RuntimeError("cannot tell the free memory (no psutil, no /proc/meminfo)")


def auto_micro_batch_tokens(shape: ModelShape, free_bytes: int, device_type: str = "cpu") -> int:
    """The token budget of a micro-batch when ``micro_batch_tokens`` is unset (0).

    Rule: a budget of ``free / 4`` bytes on a GPU, ``min(free / 8, 1 GiB)`` on the CPU, divided
    by :meth:`ModelShape.forward_bytes_per_token` = ``4 * (3 * vocab + 16 * hidden * layers)``
    (fp32 logits, their gradient and a working copy; 16 hidden-width activations per layer kept
    for the backward); at least 64 tokens. A micro-batch holds at least one row whatever the
    budget."""
    if device_type == "cuda":
        budget = free_bytes // 4
    else:
        budget = min(free_bytes // 8, CPU_BUDGET_CAP)
    return max(64, budget // max(shape.forward_bytes_per_token(), 1))


def resolve_micro_batch_tokens(requested: int, policy, device, log=print) -> int:
    """``micro_batch_tokens`` as a run uses it: ``requested``, or the automatic rule where 0.
    Refuses a requested budget whose forward would not fit the free memory."""
    shape = ModelShape.of(policy)
    free = available_bytes(device)
    if requested == 0:
        tokens = auto_micro_batch_tokens(shape, free, torch.device(device).type)
        log(
            f"micro_batch_tokens: {tokens} (auto: {gib(free)} free, "
            f"{shape.forward_bytes_per_token() / 2**20:.2f} MiB per token)"
        )
        return tokens
    need = requested * shape.forward_bytes_per_token()
    if need > free:
        fits = auto_micro_batch_tokens(shape, free, torch.device(device).type)
        raise UserError(
            f"--micro_batch_tokens {requested} needs about {gib(need)} per micro-batch "
            f"({shape.forward_bytes_per_token() / 2**20:.2f} MiB per token) but {gib(free)} is "
            f"free; lower --micro_batch_tokens (e.g. {fits}) or set it to 0 (auto)"
        )
    return requested


def micro_batches(
    rows: torch.Tensor, row_tokens: int | torch.Tensor, budget: int
) -> list[torch.Tensor]:
    """``rows`` (indices, in order) split into consecutive micro-batches of at most ``budget``
    tokens, each row ``row_tokens`` long; at least one row each. One micro-batch when it fits.
    With ``row_tokens`` per row (a tensor, rows cut to different lengths) a micro-batch is
    padded to its longest row: rows join it while ``rows x longest`` fits."""
    if isinstance(row_tokens, torch.Tensor):
        return _packed_micro_batches(rows, row_tokens.tolist(), budget)
    per = rows_per_micro_batch(row_tokens, budget)
    if len(rows) <= per:
        return [rows]
    return list(rows.split(per))


def rows_per_micro_batch(row_tokens: int, budget: int) -> int:
    """How many rows of ``row_tokens`` tokens one micro-batch of :func:`micro_batches` holds:
    as many as fit in ``budget`` tokens, at least one."""
    return max(1, budget // max(row_tokens, 1))


@dataclass(frozen=True)
class ForwardPlan:
    """Which policy forwards one training step runs over its batch, chosen once before the first
    of them (:func:`forward_plan`).

    - ``scoring_pass``: a no-grad pass fills the old log-probs (and the hidden states or
      entropies the credit reads) before the credit; the loss forwards its own micro-batches.
    - ``loss_forward_first``: no scoring pass; the loss forward (with grad) runs before the
      credit, which reads its hidden states or entropies, and the update keeps its graph.
    - ``loss_forward_after``: no scoring pass; the credit reads no forward, so the one loss
      forward runs after it, over the credited rows and columns only.
    Neither loss-forward flag: an on-policy update in micro-batches, each forwarded in the update.
    """

    scoring_pass: bool
    loss_forward_first: bool
    loss_forward_after: bool


def forward_plan(
    rows: int, row_tokens: int, budget: int, *, single_pass: bool, reads_forward: bool
) -> ForwardPlan:
    """The :class:`ForwardPlan` of a step's ``rows`` of ``row_tokens`` tokens under a ``budget``
    of tokens per micro-batch: the loss forward is the only pass when the update is on-policy
    (``single_pass``) and the rows are one micro-batch (:func:`rows_per_micro_batch`: a batch in
    several cannot keep its graph while the credit is computed); a credit that ``reads_forward``
    reads it first."""
    one_graph = single_pass and rows <= rows_per_micro_batch(row_tokens, budget)
    scoring = not single_pass or (reads_forward and not one_graph)
    return ForwardPlan(
        scoring_pass=scoring,
        loss_forward_first=not scoring and reads_forward,
        loss_forward_after=one_graph and not reads_forward,
    )


def _packed_micro_batches(rows: torch.Tensor, lengths: list[int], budget: int):
    """:func:`micro_batches` of rows of different ``lengths``: consecutive, greedy
    (:func:`token_chunks`)."""
    return [rows[group[0] : group[-1] + 1] for group in token_chunks(lengths, budget)] or [rows]


def token_chunks(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Group item indices (in order) so that ``items * longest`` stays under
    ``max_batch_tokens`` (an item alone may exceed it)."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, length in enumerate(lengths):
        new_longest = max(longest, length)
        if current and (len(current) + 1) * new_longest > max_batch_tokens:
            groups.append(current)
            current, new_longest = [], length
        current.append(i)
        longest = new_longest
    if current:
        groups.append(current)
    return groups


def generation_row_bytes(shape: ModelShape, length: int) -> int:
    """Memory one sampled row takes while it is generated: its KV cache (``length`` positions
    x 2 x layers x key width at the parameters' dtype) and its float32 next-token scores, sorted
    for top-p (16 bytes per vocabulary entry)."""
    return length * 2 * shape.layers * shape.kv_width * shape.param_bytes + 16 * shape.vocab


def generation_rows(shape: ModelShape, micro_batch_tokens: int, length: int) -> int:
    """Rows sampled at a time (``rollout.sample``'s ``max_rows``): as many as fit the memory
    of one micro-batch's forward (``micro_batch_tokens`` x its bytes per token)."""
    budget = micro_batch_tokens * shape.forward_bytes_per_token()
    return max(1, budget // generation_row_bytes(shape, length))


@dataclass(frozen=True)
class RunEstimate:
    """What a run's memory grows with besides the micro-batch (bytes), and the free memory."""

    weights: int  # gradients and AdamW moments still to be built, the frozen reference
    rollout: int  # the batch's rows (per-row tensors, features) and the rows being generated
    micro_batch: int
    free: int

    @property
    def total(self) -> int:
        return self.weights + self.rollout + self.micro_batch


def estimate_run(cfg, policy, device, micro_batch_tokens: int, prompt_tokens: int) -> RunEstimate:
    """The memory a training run with ``cfg`` needs beyond what is already loaded: the optimiser
    state still to be built, and the largest batch it samples (:func:`sampled_rows` rows of
    ``prompt_tokens + max_new_tokens``), generated :func:`generation_rows` rows at a time."""
    shape = ModelShape.of(policy)
    rows = sampled_rows(cfg)
    length = prompt_tokens + cfg.sampling.max_new_tokens
    # per kept row: ids, masks, log-probs, advantages (~64 B a token) and two hidden layers of
    # the value head's features
    kept = rows * length * (64 + 2 * 4 * shape.hidden)
    generating = min(rows, generation_rows(shape, micro_batch_tokens, length))
    rollout = kept + generating * generation_row_bytes(shape, length)
    weights = 3 * 4 * shape.trainable  # gradients and AdamW's two moments (float32)
    if cfg.kl_coef > 0:
        weights += shape.parameters * shape.param_bytes  # the frozen reference
    micro = micro_batch_tokens * shape.forward_bytes_per_token()
    return RunEstimate(weights, rollout, micro, available_bytes(device))


def sampled_rows(cfg) -> int:
    """The most rows a run samples at once: a step's (``--credit auto`` decides from step 1's
    own batch, so it samples nothing more)."""
    return cfg.prompts_per_step * cfg.sampling.num_generations


def check_run_fits(cfg, policy, device, micro_batch_tokens: int, prompt_tokens: int) -> None:
    """Refuse, before anything is sampled, a run whose estimate exceeds the free memory, naming
    the flag that grows the batch."""
    est = estimate_run(cfg, policy, device, micro_batch_tokens, prompt_tokens)
    if est.total <= est.free:
        return
    s = cfg.sampling
    rows = sampled_rows(cfg)
    raise UserError(
        f"this run would need about {gib(est.total)} but {gib(est.free)} is free: "
        f"{rows} sampled rows of up to {prompt_tokens}+{s.max_new_tokens} tokens "
        f"({gib(est.rollout)}: their tensors and features, the KV cache of those being generated), optimiser state "
        f"{gib(est.weights)}, micro-batch {gib(est.micro_batch)}; lower "
        f"--sampling.num_generations ({s.num_generations}) or --prompts_per_step "
        f"({cfg.prompts_per_step}) or --sampling.max_new_tokens ({s.max_new_tokens})"
    )


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"

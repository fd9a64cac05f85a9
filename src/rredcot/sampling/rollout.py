"""Sampling, verification and segmentation: prompts in, a :class:`RolloutBatch` out.

The policy's forward passes that score a batch (old log-probs, hidden states, entropies) are
:mod:`rredcot.sampling.forward`'s; they are importable from here too, as they were.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from rredcot.sampling import decode
from rredcot.sampling import tree as tree_sampling
from rredcot.sampling.batch import RolloutBatch, segment_layout
from rredcot.sampling.forward import (  # noqa: F401 - their path before sampling.forward
    LOGSOFTMAX_CHUNK_BYTES,
    ForwardOutput,
    chosen_token_logprobs,
    eval_mode,
    fill_forward,
    policy_forward,
    position_ids_from_mask,
    scoring_forward,
    train_mode_without_dropout,
)
from rredcot.segment import Segmenter, segment_completion
from rredcot.tasks.base import (  # noqa: F401 - checked_verify: its path before tasks.base
    Problem,
    Task,
    Verdict,
    checked_verify,
)


def render_prompt(problem: Problem, tokenizer) -> str:
    """The prompt text the policy sees: through the chat template when the tokenizer has one.

    A task may give a system turn as ``problem.meta["system"]`` (instructions, a worked example);
    without a chat template it is put before the prompt, separated by a blank line.
    """
    system = problem.meta.get("system") if isinstance(problem.meta, dict) else None
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": problem.prompt}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system}\n\n{problem.prompt}" if system else problem.prompt


def context_limit(policy) -> int | None:
    cfg = getattr(policy, "config", None)
    return getattr(cfg, "max_position_embeddings", None)


def prompt_special_tokens(tokenizer) -> bool:
    """Whether prompt encoding adds the tokenizer's special tokens (BOS): yes for raw prompts, no
    for chat-templated ones, whose text already carries them."""
    return not getattr(tokenizer, "chat_template", None)


def encode_prompts(tokenizer, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids ``(B, P)`` and attention mask ``(B, P)``."""
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(
            prompts,
            return_tensors="pt",
            padding=True,
            add_special_tokens=prompt_special_tokens(tokenizer),
        )
    finally:
        tokenizer.padding_side = side
    if enc["input_ids"].shape[1] == 0:
        raise ValueError("every prompt encoded to zero tokens; check the task's prompt template")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def response_mask_from_ids(response_ids: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
    """(B, T) float mask: tokens up to and including the first EOS."""
    if eos_token_id is None:
        return torch.ones_like(response_ids, dtype=torch.float)
    is_eos = response_ids == eos_token_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after_eos).float()


@contextlib.contextmanager
def plain_generation_config(policy):
    """Swap the model's ``generation_config`` for a neutral one (its special token ids only) while
    a block runs. ``generate`` fills every setting the caller leaves unset from the model's own
    config, so a hub model's repetition penalty or top-k would silently change the sampling
    distribution away from the one the loss scores."""
    own = getattr(policy, "generation_config", None)
    if own is None:
        yield
        return
    keep = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    policy.generation_config = GenerationConfig(**{k: getattr(own, k, None) for k in keep})
    try:
        yield
    finally:
        policy.generation_config = own


def resolve_decoder(
    policy, requested: str = "auto", use_model_generation_config: bool = False
) -> tuple[str, str]:
    """The decoding loop that runs (``"fast"`` or ``"hf"``) for ``sampling.decoder =
    requested``, and why, in a phrase. ``auto`` and ``fast`` take rredcot's loop
    (:mod:`rredcot.sampling.decode`) where the model is supported and sampling is plain temperature /
    top-p (no model ``generation_config``); otherwise Hugging Face ``generate``."""
    if requested == "hf":
        return "hf", "asked for"
    if use_model_generation_config:
        return "hf", "sampling.use_model_generation_config needs generate's logits processors"
    why = decode.unsupported_reason(policy)
    if why is not None:
        return "hf", f"the fast loop does not support this model: {why}"
    return "fast", "a supported Llama-family model" if requested == "auto" else "asked for"


@torch.no_grad()
def sample(
    policy, tokenizer, prompts: list[str], **options
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """:func:`sample_keeping_cache` without the cache (``options``: its keyword arguments but
    ``keep_cache``): ``(input_ids (B, P+T), attention_mask (B, P+T), P, response_mask (B, T))``."""
    return sample_keeping_cache(policy, tokenizer, prompts, **options)[:4]


@torch.no_grad()
def sample_keeping_cache(
    policy,
    tokenizer,
    prompts: list[str],
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    device=None,
    use_model_generation_config: bool = False,
    decoder: str = "auto",
    max_rows: int = 0,
    keep_cache: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, decode.SampledCache | None]:
    """Sample ``num_generations`` completions per prompt (rows grouped by prompt).

    Sampling is plain temperature / top-p sampling, the distribution the loss scores: a hub
    model's ``generation_config`` (repetition penalty, top-k, min-p, ...) is ignored unless
    ``use_model_generation_config``. ``decoder`` is ``sampling.decoder`` (auto, fast or hf;
    :func:`resolve_decoder`): both loops draw the same tokens from the same RNG state.
    ``max_rows`` > 0 generates whole prompts' groups of at most that many rows at a time
    (``rredcot.sampling.memory.generation_rows``), so the KV cache grows with it, not the batch; a batch
    within it is generated at once, as with 0.

    ``keep_cache``: also keep the fast decoder's filled cache (:func:`decode.generate_keeping_cache`)
    where the fast loop runs and the batch is generated at once; else the cache is None.

    Returns ``(input_ids (B, P+T), attention_mask (B, P+T), P, response_mask (B, T), cache)``.
    """
    device = device or next(policy.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device)
    repeated_ids = prompt_ids.repeat_interleave(num_generations, dim=0)
    repeated_mask = prompt_mask.repeat_interleave(num_generations, dim=0)
    fast = resolve_decoder(policy, decoder, use_model_generation_config)[0] == "fast"
    per = len(prompts) if max_rows <= 0 else max(1, max_rows // num_generations)
    keep = keep_cache and fast and per >= len(prompts)
    kept: list[decode.SampledCache | None] = [None]

    def generate(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if fast:
            run = decode.generate_keeping_cache if keep else decode.generate
            out = run(  # takes each prompt once, for its G samples
                policy,
                ids,
                mask,
                num_return_sequences=num_generations,
                max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                greedy=greedy,
                temperature=temperature,
                top_p=top_p,
            )
            if keep:
                out, kept[0] = out
            return out
        return _hf_generate(
            policy,
            tokenizer,
            ids.repeat_interleave(num_generations, dim=0),
            mask.repeat_interleave(num_generations, dim=0),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            greedy=greedy,
            use_model_generation_config=use_model_generation_config,
        )

    parts = [
        generate(prompt_ids[s : s + per], prompt_mask[s : s + per])
        for s in range(0, len(prompts), per)
    ]
    input_ids, attention_mask, response_mask = _joined_rows(
        parts, repeated_ids, repeated_mask, tokenizer
    )
    return input_ids, attention_mask, repeated_ids.shape[1], response_mask, kept[0]


def _joined_rows(parts: list[torch.Tensor], prompt_ids, prompt_mask, tokenizer):
    """The rows ``[prompt | response]`` of the generated ``parts`` (each ``(rows, T_i)``, in
    order) after their prompts ``prompt_ids, prompt_mask (B, P)``: ``(input_ids (B, P+T),
    attention_mask (B, P+T), response_mask (B, T))``, the pad id after each row's EOS."""
    width = max(part.shape[1] for part in parts)  # a part whose rows all ended stops early
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    response_ids = torch.cat([F.pad(part, (0, width - part.shape[1]), value=pad) for part in parts])
    response_mask = response_mask_from_ids(response_ids, tokenizer.eos_token_id)
    # Padding after EOS is replaced by the pad id so that the sequence is well formed.
    response_ids = torch.where(
        response_mask.bool(), response_ids, torch.full_like(response_ids, pad)
    )
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    return input_ids, attention_mask, response_mask


@torch.no_grad()
def sample_tree_group(
    policy,
    tokenizer,
    prompts: list[str],
    segmenter: Segmenter,
    tree,
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    device=None,
    use_model_generation_config: bool = False,
    decoder: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, tree_sampling.TreeSample]:
    """:func:`sample`'s output for tree-structured groups (``tree``: ``sampling.tree``): each
    prompt's ``num_generations`` completions are the leaves of one tree
    (:func:`rredcot.sampling.tree.sample_tree`) that forks at ``segmenter``'s boundaries. Also returns the
    :class:`~rredcot.sampling.tree.TreeSample` (tokens generated, forks)."""
    loop, why = resolve_decoder(policy, decoder, use_model_generation_config)
    if loop != "fast":
        raise ValueError(
            f"sampling.tree needs rredcot's fast decoder (it forks its KV cache), but {why}: "
            "use a llama / qwen2 model with sampling.decoder auto, or turn sampling.tree off"
        )
    device = device or next(policy.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device)

    def candidates(ids: list[int], entropies: list[float]) -> list[int]:
        bounds, _, _ = segment_completion(segmenter, tokenizer, ids, entropies=entropies)
        return bounds[1:-1]

    grown = tree_sampling.sample_tree(
        policy,
        prompt_ids,
        prompt_mask,
        num_leaves=num_generations,
        roots=tree.roots,
        forks_per_round=tree.forks_per_round,
        fork_rule=tree.fork_rule,
        candidates=candidates,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        temperature=temperature,
        top_p=top_p,
    )
    response_ids = grown.response_ids
    response_mask = response_mask_from_ids(response_ids, tokenizer.eos_token_id)
    repeated_ids = prompt_ids.repeat_interleave(num_generations, dim=0)
    repeated_mask = prompt_mask.repeat_interleave(num_generations, dim=0)
    input_ids = torch.cat([repeated_ids, response_ids], dim=1)
    attention_mask = torch.cat([repeated_mask, response_mask.long()], dim=1)
    return input_ids, attention_mask, repeated_ids.shape[1], response_mask, grown


def _hf_generate(
    policy,
    tokenizer,
    prompt_ids,
    prompt_mask,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    greedy: bool,
    use_model_generation_config: bool,
) -> torch.Tensor:
    """Hugging Face ``generate``'s new tokens ``(B, T)`` after the prompts ``(B, P)``."""
    kwargs = (
        dict(do_sample=False)
        if greedy
        else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    )
    settings = (
        contextlib.nullcontext() if use_model_generation_config else plain_generation_config(policy)
    )
    with settings:
        out = policy.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **kwargs,
        )
    return out[:, prompt_ids.shape[1] :]


def segment_batch(
    batch: RolloutBatch,
    tokenizer,
    segmenter: Segmenter,
    entropies: torch.Tensor | None = None,
) -> RolloutBatch:
    """The batch with ``boundaries``, ``segment_ids``, ``segment_char_starts`` and ``prefix_ids``
    of every row.

    ``entropies (B, T)``: the policy's next-token entropies, needed by entropy strategies (read
    from the forward pass the step already runs, so entropy segmentation costs nothing extra).
    """
    if segmenter.uses_entropy and entropies is None:
        raise ValueError(
            f"segmenter {segmenter.strategy!r} cuts at entropy peaks: segment after the forward "
            "pass that computes the entropies"
        )
    P = batch.prompt_len
    lengths = batch.response_mask.sum(-1).long().tolist()
    boundaries, char_starts = [], []
    branches = None
    if batch.token_share_counts is not None:  # a tree group: its nodes are boundaries too
        branches = tree_sampling.branch_points(batch.token_share_counts, batch.response_mask)
    for row, length in enumerate(lengths):
        ids = batch.input_ids[row, P : P + length].tolist()
        ent = None if entropies is None else entropies[row, :length].tolist()
        bounds, starts, _ = segment_completion(
            segmenter, tokenizer, ids, text=batch.completions[row], entropies=ent
        )
        if branches is not None:
            bounds, starts = _with_branch_points(bounds, starts, branches[row], ids, tokenizer)
        boundaries.append(bounds)
        char_starts.append(starts)
    return batch.with_segments(boundaries, char_starts)


def _with_branch_points(
    bounds: list[int], starts: list[int], branches: list[int], ids: list[int], tokenizer
) -> tuple[list[int], list[int]]:
    """A row's boundaries with the tree's branch points on its path added (a node's value is
    read where its leaves part), and the char start of every segment (a new segment starts at
    the length of the decoded text before its first token)."""
    if not branches or len(bounds) < 2:
        return bounds, starts
    merged = sorted(set(bounds) | {b for b in branches if 0 < b < bounds[-1]})
    if len(merged) == len(bounds):
        return bounds, starts
    old = dict(zip(bounds[:-1], starts))
    new_starts = [
        old[b] if b in old else len(tokenizer.decode(ids[:b], skip_special_tokens=True))
        for b in merged[:-1]
    ]
    return merged, new_starts


def sample_groups(
    policy,
    tokenizer,
    task: Task,
    problems: list[Problem],
    segmenter: Segmenter,
    sampling,
    decoder,
    *,
    tree: bool = True,
    max_rows: int = 0,
    keep_cache: bool = False,
) -> tuple[RolloutBatch, dict[str, float]]:
    """:func:`build_rollout_batch` at a run's sampling settings (``sampling``: its
    ``SamplingConfig``), as tree groups where ``sampling.tree.enabled`` and ``tree``;
    ``max_rows``, ``keep_cache``: :func:`sample_keeping_cache`'s."""
    return build_rollout_batch(
        policy,
        tokenizer,
        task,
        problems,
        segmenter,
        num_generations=sampling.num_generations,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        use_model_generation_config=sampling.use_model_generation_config,
        decoder=decoder,
        tree=sampling.tree if tree and sampling.tree.enabled else None,
        max_rows=max_rows,
        keep_cache=keep_cache,
    )


def build_rollout_batch(
    policy,
    tokenizer,
    task: Task,
    problems: list[Problem],
    segmenter: Segmenter,
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    use_model_generation_config: bool = False,
    decoder: str = "auto",
    tree=None,
    max_rows: int = 0,
    keep_cache: bool = False,
) -> tuple[RolloutBatch, dict[str, float]]:
    """Sample, decode, verify and segment. Returns the batch and rollout statistics.

    ``keep_cache``: the batch carries the fast decoder's cache (``batch.probe_cache``, a
    :class:`decode.SampledCache` whose rows follow the batch's, dropped rows included) where
    :func:`sample_keeping_cache` keeps one (never for tree groups); free it once read.

    ``tree`` (``sampling.tree`` with ``enabled``) grows each prompt's group as a tree
    (:func:`sample_tree_group`): ``rollout/tokens`` then counts each generated token once, and the
    batch carries ``token_share_counts`` (how many leaves share each token); segmentation adds
    the tree's branch points as boundaries.

    Bad samples (verifier error, NaN reward) are dropped from the batch, so they carry no loss,
    no credit and do not enter their group's mean and std; ``rollout/skipped_samples`` counts
    them (their tokens still count as generated). With an entropy segmenter the batch comes back
    unsegmented (every row one segment): call :func:`segment_batch` with the entropies of the
    step's forward pass.
    """
    prompts = [render_prompt(p, tokenizer) for p in problems]
    options = dict(
        num_generations=num_generations,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        use_model_generation_config=use_model_generation_config,
        decoder=decoder,
    )
    grown = cache = None
    if tree is not None and tree.enabled:
        input_ids, attention_mask, P, response_mask, grown = sample_tree_group(
            policy, tokenizer, prompts, segmenter, tree, **options
        )
    else:
        input_ids, attention_mask, P, response_mask, cache = sample_keeping_cache(
            policy, tokenizer, prompts, **options, max_rows=max_rows, keep_cache=keep_cache
        )
    rows_problems = [p for p in problems for _ in range(num_generations)]
    group_ids = torch.arange(len(problems)).repeat_interleave(num_generations)
    checked = _verify_rows(tokenizer, task, rows_problems, input_ids[:, P:], response_mask)
    batch = _unsegmented_batch(
        input_ids, attention_mask, P, response_mask, group_ids, rows_problems, checked, grown
    ).replace(probe_cache=cache)
    if checked.skipped:
        batch = batch.select([row for row, ok in enumerate(checked.valid) if ok])
    if not segmenter.uses_entropy:
        batch = segment_batch(batch, tokenizer, segmenter)
    return batch, _rollout_stats(batch, response_mask, checked, grown)


@dataclass
class _CheckedRows:
    """Every sampled row decoded and verified (:func:`_verify_rows`)."""

    completions: list[str]  # the decoded text, EOS and special tokens left out
    verdicts: list[Verdict]
    rewards: list[float]
    valid: list[bool]  # False: the verifier failed or gave no finite reward (the row is dropped)
    skipped: int  # rows not valid
    truncated: int  # rows that did not end with EOS


def _verify_rows(
    tokenizer, task: Task, problems: list[Problem], response_ids, response_mask
) -> _CheckedRows:
    """Decode each row's response ``response_ids (B, T)`` (its ``response_mask`` tokens) and
    verify it against its problem (:func:`checked_verify`)."""
    checked = _CheckedRows([], [], [], [], 0, 0)
    eos = tokenizer.eos_token_id
    lengths = response_mask.sum(-1).long().tolist()
    for row in range(response_mask.shape[0]):
        ids = response_ids[row, : lengths[row]].tolist()
        content_ids = ids[:-1] if ids and ids[-1] == eos else ids
        checked.truncated += int(not ids or ids[-1] != eos)
        text = tokenizer.decode(content_ids, skip_special_tokens=True)
        verdict, ok = checked_verify(task, problems[row], text)
        checked.skipped += int(not ok)
        checked.valid.append(ok)
        checked.completions.append(text)
        checked.verdicts.append(verdict)
        checked.rewards.append(float(verdict.reward))
    return checked


def _unsegmented_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    P: int,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    problems: list[Problem],
    checked: _CheckedRows,
    grown,
) -> RolloutBatch:
    """The batch of every sampled row, each one segment; a tree's rows (``grown`` not ``None``)
    carry ``token_share_counts``."""
    device = input_ids.device
    lengths = response_mask.sum(-1).long().tolist()
    whole = [[0, n] if n else [0] for n in lengths]
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_len=P,
        response_mask=response_mask,
        rewards=torch.tensor(checked.rewards, dtype=torch.float, device=device),
        group_ids=group_ids.to(device),
        boundaries=whole,
        segment_ids=segment_layout(whole, response_mask)[0],
        segment_char_starts=[[0] if n else [] for n in lengths],
        problems=problems,
        completions=checked.completions,
        verdicts=checked.verdicts,
        token_share_counts=None
        if grown is None
        else tree_sampling.token_share_counts(
            input_ids[:, P:], response_mask, group_ids.to(device)
        ),
    )


def _rollout_stats(
    batch: RolloutBatch, response_mask: torch.Tensor, checked: _CheckedRows, grown
) -> dict[str, float]:
    """The ``rollout/*`` metrics of a step: ``response_mask (B, T)`` of every sampled row (the
    skipped ones too), ``batch`` the segmented rows kept; a tree's cost where ``grown`` is one."""
    B = response_mask.shape[0]
    leaf_tokens = float(response_mask.sum())
    generated_tokens = leaf_tokens if grown is None else float(grown.generated_tokens)
    stats = {
        "rollout/skipped_samples": float(checked.skipped),
        "rollout/verify_timeouts": float(sum(v.timed_out for v in checked.verdicts)),
        "rollout/truncated_fraction": checked.truncated / max(B, 1),
        "rollout/mean_length": float(response_mask.sum(-1).mean()) if B else 0.0,
        "rollout/mean_segments": sum(len(b) - 1 for b in batch.boundaries) / max(batch.size, 1),
        "rollout/tokens": generated_tokens,
    }
    if grown is not None:
        stats.update(
            {
                "rollout/tree_leaf_tokens": leaf_tokens,
                "rollout/tree_shared_fraction": 1.0 - generated_tokens / max(leaf_tokens, 1.0),
                "rollout/tree_refed_tokens": float(grown.refed_tokens),
                "rollout/tree_rounds": float(grown.rounds),
                "rollout/tree_mean_fork_depth": sum(grown.fork_depths)
                / max(len(grown.fork_depths), 1),
            }
        )
    return stats

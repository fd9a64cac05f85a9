"""Attribution baselines: split ``R - V(s_0)`` over segments by weights, with no value estimate.

docs/method.md, value sources. Each method gives per-segment weights ``w_k >= 0`` with ``sum_k w_k = 1``
(``CreditRows.weights``); the shared base class turns them into ``r_k = w_k (R - mean(R_group))``
and gives every token of segment ``k`` the segment advantage ``r_k`` directly. There is no
segment GAE over these ``r_k`` (``credit.lam`` is ignored): docs/method.md's table lists no λ for the
attribution baselines, the weights already say how much of the outcome each segment earns.

- ``first_last``: half the credit to the first segment, half to the last (all of it to a single
  segment). No model call.
- ``gradient``: grad × input. The target is the log-probability of the trace's *answer line*
  (see :func:`answer_line_starts`) under the current policy; each response token before the
  answer line gets ``|grad_e · e|``, the absolute dot product of the target's gradient with
  respect to that token's input embedding and the embedding itself (the first-order change of
  the target when the token's embedding is scaled to zero). Summed per segment. One forward and
  one backward per micro-batch, gradients w.r.t. the embeddings only.
- ``attention``: the attention mass that the positions producing the answer line's log-probs
  put on each response token before the answer line, averaged over heads and layers. Summed per
  segment. One forward with ``output_attentions=True`` per micro-batch; it needs an attention
  implementation that returns weights (``eager``).

What is attributed, in both model-based methods: the answer line's tokens ``y_a .. y_{T-1}``
(eos included) are the target; the inputs scored are the response tokens ``y_0 .. y_{a-1}``.
The prompt and the answer line itself get no share, so a segment holding the answer line (the
default segmentation merges it into the last step) is scored by its tokens before the answer
line only, and a segment that is nothing but the answer line gets weight 0. A row whose scores are
all zero (e.g. a single-line response: nothing before its answer line) gets uniform weights.

Cost: ``credit/extra_forward_tokens`` (real tokens of the extra forward passes),
``credit/extra_backward_tokens`` (gradient: the same tokens again, backward) and
``credit/extra_generated_tokens`` (always 0).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rredcot.algebra.credit import Cost
from rredcot.methods.base import CreditMethod, CreditRows, register_credit
from rredcot.sampling.batch import RolloutBatch
from rredcot.sampling.forward import position_ids_from_mask
from rredcot.segment import decode_with_offsets

__all__ = [
    "AttentionCredit",
    "FirstLastCredit",
    "GradientCredit",
    "answer_line_starts",
    "attention_token_scores",
    "first_last_weights",
    "gradient_token_scores",
    "tokens_to_segment_weights",
]


# ---------------------------------------------------------------------------------------------
# pure helpers


def first_last_weights(num_segments: torch.Tensor) -> torch.Tensor:
    """``(B, S)`` weights: ``1/2`` on the first and the last segment, ``1`` on a lone segment.

    Args:
        num_segments: ``(B,)`` long, segments per row (0 gives an all-zero row).
    """
    n = num_segments.long()
    S = int(n.max()) if n.numel() else 0
    weights = torch.zeros(n.shape[0], S)
    rows = torch.arange(n.shape[0])
    has = n > 0
    if S:
        weights[rows[has], 0] += 0.5
        weights[rows[has], n[has] - 1] += 0.5
    return weights


def tokens_to_segment_weights(
    token_scores: torch.Tensor, segment_ids: torch.Tensor, num_segments: torch.Tensor
) -> torch.Tensor:
    """Sum non-negative token scores per segment and normalise each row to 1.

    Args:
        token_scores: ``(B, T)`` scores ``>= 0`` (0 where a token is not attributed).
        segment_ids: ``(B, T)`` long, 0-based segment of each token, ``-1`` on padding.
        num_segments: ``(B,)`` long.

    Returns:
        ``(B, S)`` weights, ``S = max(num_segments)``: summing to 1 over each row's valid
        segments, uniform where a row's scores are all zero, 0 on padding and on rows without
        segments.
    """
    n = num_segments.long().cpu()
    B = token_scores.shape[0]
    S = int(n.max()) if n.numel() else 0
    scores = token_scores.detach().double().cpu()
    ids = segment_ids.long().cpu()
    valid = ids >= 0
    sums = torch.zeros(B, S + 1, dtype=torch.float64)  # column S collects the padding
    sums.scatter_add_(1, torch.where(valid, ids, torch.full_like(ids, S)), scores * valid)
    sums = sums[:, :S]
    seg_mask = torch.arange(S).unsqueeze(0) < n.unsqueeze(1)
    sums = torch.where(seg_mask, sums, torch.zeros_like(sums))
    total = sums.sum(dim=1, keepdim=True)
    uniform = seg_mask.double() / n.clamp(min=1).unsqueeze(1)
    weights = torch.where(total > 0, sums / total.clamp(min=1e-300), uniform)
    return weights.float()


def answer_line_starts(
    tokenizer: Any, input_ids: torch.Tensor, prompt_len: int, lengths: list[int]
) -> list[int]:
    """Per row, the response index ``a`` where the answer line starts.

    The answer line is the last non-blank line of the decoded response (``A:15`` in the
    arithmetic task, ``#### 72`` on GSM8K); its tokens are ``[a, length)``, the eos and any
    trailing whitespace included. Its first token is the first one that starts at or after the
    line's first character (a token straddling the preceding newline belongs before it). A
    response with no line break before its last line gives ``a = 0``; an empty one ``a = 0``.
    """
    starts = []
    for row, length in enumerate(lengths):
        ids = input_ids[row, prompt_len : prompt_len + length].tolist()
        text, spans = decode_with_offsets(tokenizer, ids)
        line_char = text.rstrip().rfind("\n") + 1
        a = next((i for i, (s, _) in enumerate(spans) if s >= line_char), length)
        starts.append(a if line_char > 0 else 0)
    return starts


def _row_masks(
    prompt_len: int, width: int, answer_starts: list[int], lengths: list[int], device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scored (b, T), target (b, T))`` bool: response tokens before the answer line, and the
    answer line's tokens (the target), for response width ``T = width - prompt_len``."""
    t = torch.arange(width - prompt_len, device=device).unsqueeze(0)
    a = torch.tensor(answer_starts, device=device).unsqueeze(1)
    n = torch.tensor(lengths, device=device).unsqueeze(1)
    return t < a, (t >= a) & (t < n)


def gradient_token_scores(
    policy: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    answer_starts: list[int],
    lengths: list[int],
) -> torch.Tensor:
    """Grad × input scores ``(b, T)`` of the answer line's log-prob, one forward + backward.

    ``score[b, t] = |∇_{e_t} log π(answer | ...) · e_t|`` for response tokens ``t < a_b``,
    0 elsewhere. The target is the sum over rows of each row's answer log-prob; rows do not
    interact, so its gradient holds each row's own. Only the embeddings get gradients (the
    policy's parameters keep ``.grad`` untouched); call with the policy in eval mode.

    Args:
        input_ids, attention_mask: ``(b, L)`` ``[left-padded prompt | right-padded response]``.
        answer_starts, lengths: per row, the answer line's start ``a`` and the response length.
    """
    device = input_ids.device
    embed = policy.get_input_embeddings()
    with torch.enable_grad():
        embeds = embed(input_ids).detach().requires_grad_(True)
        out = policy(
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        scored, target = _row_masks(prompt_len, input_ids.shape[1], answer_starts, lengths, device)
        rows, cols = target.nonzero(as_tuple=True)
        logits = out.logits[rows, prompt_len - 1 + cols]  # (N, V): the answer tokens' logits
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        tokens = input_ids[rows, prompt_len + cols]
        objective = -F.cross_entropy(logits, tokens, reduction="sum")
        (grad,) = torch.autograd.grad(objective, embeds)
    dtype = torch.promote_types(embeds.dtype, torch.float32)
    scores = (grad.to(dtype) * embeds.detach().to(dtype)).sum(-1).abs()[:, prompt_len:]
    return torch.where(scored, scores, torch.zeros_like(scores))


def attention_token_scores(
    policy: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    answer_starts: list[int],
    lengths: list[int],
) -> torch.Tensor:
    """Attention mass ``(b, T)`` from the answer line to each response token before it.

    The queries are the positions whose outputs give the answer tokens' log-probs (response
    positions ``a-1 .. length-2``, i.e. the same target as the gradient method); their attention
    rows, averaged over heads and layers, are summed, and the keys kept are the response tokens
    ``t < a`` (attention to the prompt and to the answer line is dropped). Raises ``RuntimeError``
    when the model returns no attention weights (sdpa / flash attention).
    """
    out = policy(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        output_attentions=True,
        use_cache=False,
    )
    attentions = getattr(out, "attentions", None)
    if not attentions or any(a is None for a in attentions):
        impl = getattr(getattr(policy, "config", None), "_attn_implementation", "unknown")
        raise RuntimeError(
            f"credit method 'attention' needs attention weights, but the policy (attention "
            f"implementation {impl!r}) returns none: sdpa and flash attention never materialise "
            "them. Load the policy with eager attention: `--model.attn_implementation eager` on "
            "the CLI, load_policy(..., attn_implementation='eager') in Python, or call "
            "policy.set_attn_implementation('eager') on a loaded model."
        )
    mean = sum(a.float().mean(dim=1) for a in attentions) / len(attentions)  # (b, L, L)
    scored, target = _row_masks(
        prompt_len, input_ids.shape[1], answer_starts, lengths, input_ids.device
    )
    queries = torch.zeros(input_ids.shape, dtype=mean.dtype, device=mean.device)
    queries[:, prompt_len - 1 : -1] = target.to(mean.dtype)  # position P+t-1 predicts y_t
    mass = torch.einsum("bq,bqk->bk", queries, mean)[:, prompt_len:]
    return torch.where(scored, mass, torch.zeros_like(mass))


# ---------------------------------------------------------------------------------------------
# methods


class _AttributionCredit(CreditMethod):
    """Shared part: model-based subclasses set ``token_scores``, run over micro-batches of the
    rows that need the model; the estimate's cost counts those rows' tokens."""

    micro_batch_size: int = 16  # rows per extra forward (and backward), at most
    backward: bool = False  # whether the extra pass also runs backward

    def row_chunks(self, need: list[int], lengths: list[int], prompt_len: int) -> list[list[int]]:
        """``need`` in consecutive chunks of at most ``micro_batch_size`` rows and, where the
        context sets ``micro_batch_tokens``, at most that many tokens (rows x padded width); at
        least one row each."""
        budget = self.context.micro_batch_tokens
        chunks: list[list[int]] = []
        for i in need:
            trial = (chunks[-1] if chunks else []) + [i]
            width = prompt_len + max(lengths[j] for j in trial)
            fits = len(trial) <= self.micro_batch_size and (
                not budget or len(trial) * width <= budget
            )
            if chunks and fits:
                chunks[-1] = trial
            else:
                chunks.append([i])
        return chunks

    def rows(self, batch: RolloutBatch) -> CreditRows:
        """The batch's rows with their attribution weights."""
        weights, cost = self.weights_and_cost(batch)
        return CreditRows.of(batch).replace(weights=weights, cost=cost)

    def token_scores(self, policy, input_ids, attention_mask, prompt_len, starts, lengths):
        raise NotImplementedError

    def weights_and_cost(self, batch: RolloutBatch) -> tuple[torch.Tensor, Cost]:
        """``(weights (B, S), cost)``."""
        n = batch.num_segments
        lengths = [int(x) for x in batch.response_mask.sum(-1).tolist()]
        P = batch.prompt_len
        scores = torch.zeros(batch.size, batch.response_len)
        forward_tokens = 0
        # Rows with fewer than two segments have their weights already; skip the model for them.
        need = [i for i in range(batch.size) if int(n[i]) >= 2]
        starts = dict(
            zip(
                need,
                answer_line_starts(
                    self.context.tokenizer,
                    batch.input_ids[need].cpu(),
                    P,
                    [lengths[i] for i in need],
                ),
                strict=True,
            )
        )
        need = [i for i in need if starts[i] > 0]  # nothing before the answer line to score
        policy = self.context.policy
        device = next(policy.parameters()).device
        was_training = policy.training
        policy.eval()
        try:
            for rows in self.row_chunks(need, lengths, P):
                width = P + max(lengths[i] for i in rows)
                ids = batch.input_ids[rows, :width].to(device)
                mask = batch.attention_mask[rows, :width].to(device)
                chunk = self.token_scores(
                    policy,
                    ids,
                    mask,
                    P,
                    [starts[i] for i in rows],
                    [lengths[i] for i in rows],
                )
                scores[rows, : width - P] = chunk.detach().float().cpu()
                forward_tokens += int(mask.sum())
        finally:
            policy.train(was_training)
        cost = Cost(
            extra_forward_tokens=float(forward_tokens),
            extra_backward_tokens=float(forward_tokens if self.backward else 0),
        )
        weights = tokens_to_segment_weights(scores, batch.segment_ids, n)
        return weights.to(batch.rewards.device), cost


@register_credit("first_last")
class FirstLastCredit(_AttributionCredit):
    """Credit only to the first and the last segment (a sparse baseline), no model call."""

    def weights_and_cost(self, batch: RolloutBatch) -> tuple[torch.Tensor, Cost]:
        return first_last_weights(batch.num_segments).to(batch.rewards.device), Cost()


@register_credit("gradient")
class GradientCredit(_AttributionCredit):
    """Grad × input attribution of the answer line's log-prob, summed per segment."""

    backward = True

    def token_scores(self, policy, input_ids, attention_mask, prompt_len, starts, lengths):
        return gradient_token_scores(policy, input_ids, attention_mask, prompt_len, starts, lengths)


@register_credit("attention")
class AttentionCredit(_AttributionCredit):
    """Attention mass from the answer line to each segment, averaged over heads and layers."""

    def token_scores(self, policy, input_ids, attention_mask, prompt_len, starts, lengths):
        with torch.no_grad():
            return attention_token_scores(
                policy, input_ids, attention_mask, prompt_len, starts, lengths
            )

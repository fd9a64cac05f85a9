"""A fast sampling loop for Llama-family decoder-only models on small hardware.

Hugging Face ``generate`` spends most of a small model's decoding time outside the arithmetic:
per token it rebuilds masks and cache bookkeeping, runs its logits processors and stopping
criteria, and its dynamic cache grows every layer's keys and values with ``torch.cat``. This loop
does the same arithmetic with less around it:

- keys and values go into buffers preallocated for the whole completion (a static cache),
  written in place, and each step attends only over the columns filled so far;
- the prompt is one forward (the prefill), then one token per step for all rows at once;
- it stops as soon as every row has produced EOS, or at ``max_new_tokens``;
- the layers' own modules compute the projections, norms, MLPs and rotary embeddings (so LoRA
  adapters and the model's numerics are kept); only attention and the cache are written here.

The token choice is ``generate``'s, call for call: float32 logits, divided by the temperature,
HF's top-p filter, a softmax and one ``torch.multinomial`` draw per step over the whole batch
(finished rows included, which then get the pad id), or ``argmax`` when greedy. So with the same
torch RNG state both loops draw the same tokens (up to float rounding of the logits).

Which models it runs: :func:`unsupported_reason` says why not (None when it can).
"""

from __future__ import annotations

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
"""``config.model_type`` values whose layers this loop knows: pre-norm blocks of rotary
multi-head (or grouped-query) self-attention and a gated MLP."""

_LAYER_PARTS = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp",
)


def base_model(policy):
    """The transformers model under a peft wrapper (LoRA layers stay in place inside it)."""
    get_base = getattr(policy, "get_base_model", None)
    return get_base() if callable(get_base) else policy


def unsupported_reason(policy) -> str | None:
    """Why the fast loop cannot decode ``policy``, in a phrase; None when it can."""
    model = base_model(policy)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    inner = getattr(model, "model", None)
    for part in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if getattr(inner, part, None) is None:
            return f"the model has no model.{part}"
    if getattr(model, "lm_head", None) is None:
        return "the model has no lm_head"
    for layer in inner.layers:
        for path in _LAYER_PARTS:
            node = layer
            for name in path.split("."):
                node = getattr(node, name, None)
            if node is None:
                return f"a decoder layer has no {path}"
    if policy.training and getattr(config, "attention_dropout", 0.0):
        return "the model is in training mode with attention dropout"
    return None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def next_token_scores(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """``generate``'s scores for plain sampling: ``logits (B, V)`` in float32, divided by the
    temperature, then HF's top-p filter (tokens outside the nucleus set to -inf; the most
    probable token always kept). Sampling draws from ``softmax`` of these."""
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(1, order, remove_sorted)
        scores = scores.masked_fill(remove, -float("inf"))
    return scores


class StaticKVCache:
    """Keys and values of every layer, preallocated and filled in place: the prompts' once per
    distinct prompt, ``(layers, B' * H_kv, P, D)`` (the ``G`` samples of a prompt read the same
    ones), and the decoded tokens' per row, ``(layers, T, B * H_kv, D)``, one column per step.
    Rows run over ``(prompt or row, kv head)``, row-major."""

    def __init__(self, layers, prompts, rows, kv_heads, prompt_len, new_tokens, head_dim, like):
        def empty(n: int, length: int) -> torch.Tensor:
            shape = (layers, n * kv_heads, length, head_dim)
            return torch.empty(shape, dtype=like.dtype, device=like.device)

        self.prompt_keys = empty(prompts, prompt_len)
        self.prompt_values = empty(prompts, prompt_len)
        # decoded tokens position-major, (layers, T, B * H_kv, D): the columns so far are one
        # contiguous block (a per-row batched product over a strided slice is slow on the CPU)
        shape = (layers, new_tokens, rows * kv_heads, head_dim)
        self.keys = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.values = torch.empty(shape, dtype=like.dtype, device=like.device)

    def fill(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The prompts' keys and values ``(B', H_kv, P, D)``."""
        self.prompt_keys[layer] = keys.flatten(0, 1)
        self.prompt_values[layer] = values.flatten(0, 1)

    def write(self, layer: int, column: int, keys: torch.Tensor, values: torch.Tensor):
        """Put decoded column ``column``, ``keys``, ``values (B * H_kv, D)``; returns the decoded
        columns so far, ``(column + 1, B * H_kv, D)``."""
        self.keys[layer, column] = keys
        self.values[layer, column] = values
        return self.keys[layer, : column + 1], self.values[layer, : column + 1]


class Decoder:
    """The layers of one model and a cache for one batch of ``G`` samples per prompt:
    :meth:`prefill` runs the prompts, :meth:`step` one new token per row; both return the last
    position's float32 logits. Public for :mod:`rredcot.tree`, whose branches share one prefill
    and copy columns of each other's caches."""

    def __init__(self, policy, prompts: int, samples: int, prompt_len: int, new_tokens: int):
        model = base_model(policy)
        config = model.config
        self.inner, self.lm_head = model.model, model.lm_head
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.groups = self.heads // self.kv_heads
        self.head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        attn = self.inner.layers[0].self_attn
        self.scaling = getattr(attn, "scaling", None) or self.head_dim**-0.5
        self.prompts, self.samples = prompts, samples
        like = next(p for p in model.parameters() if p.is_floating_point())
        self.cache = StaticKVCache(
            len(self.inner.layers),
            prompts,
            prompts * samples,
            self.kv_heads,
            prompt_len,
            new_tokens,
            self.head_dim,
            like,
        )

    def _rotary(self, x, positions):
        cos, sin = self.inner.rotary_emb(x, positions)  # (B, n, D)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.inner.norm(x[:, -1:]))[:, -1].float()

    def _qkv(self, attn, h, cos, sin):
        """Rotated queries ``(B, H, n, D)`` and keys, values ``(B, H_kv, n, D)`` of ``h``."""
        B, n, _ = h.shape
        q = attn.q_proj(h).view(B, n, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(B, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(B, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def prefill(self, ids, positions, bias) -> torch.Tensor:
        """The prompts ``ids (B', P)`` at rotary ``positions (B', P)``; ``bias (B', 1, P, P)``:
        0 where a query may look, -inf elsewhere. Fills the prompts' cache; returns their
        logits ``(B', V)``."""
        x = self.inner.embed_tokens(ids)
        B, n, _ = x.shape
        cos, sin = self._rotary(x, positions)
        for i, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(x), cos, sin)
            self.cache.fill(i, k, v)
            q = q.reshape(B, self.kv_heads, self.groups, n, self.head_dim)
            scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * self.scaling
            probs = torch.softmax(scores + bias.unsqueeze(1), dim=-1, dtype=torch.float32)
            out = torch.matmul(probs.to(q.dtype), v.unsqueeze(2))  # (B, H_kv, G, n, D)
            out = out.view(B, self.heads, n, self.head_dim).transpose(1, 2).reshape(B, n, -1)
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._logits(x)

    def _by_prompt(self, x: torch.Tensor) -> torch.Tensor:
        """``(B * H_kv, groups, n)`` rows of ``(sample, kv head)`` -> ``(B' * H_kv, G * groups,
        n)``: the queries of one prompt's samples side by side, per kv head."""
        U, G, n = self.prompts, self.samples, x.shape[-1]
        x = x.view(U, G, self.kv_heads, self.groups, n).transpose(1, 2)
        return x.reshape(U * self.kv_heads, G * self.groups, n)

    def _by_row(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_by_prompt`."""
        U, G, n = self.prompts, self.samples, x.shape[-1]
        x = x.view(U, self.kv_heads, G, self.groups, n).transpose(1, 2)
        return x.reshape(U * G * self.kv_heads, self.groups, n)

    def step(self, ids, positions, column: int, prompt_bias, decoded_bias=None) -> torch.Tensor:
        """One token per row, ``ids (B, 1)`` at rotary ``positions (B, 1)``, into decoded column
        ``column``; ``prompt_bias (B' * H_kv, 1, P)``: 0 on the prompt's tokens, -inf on its
        padding; ``decoded_bias (columns, B * H_kv, 1)`` or None: added to the scores of the
        decoded columns (-inf hides a column from a row: the tree sampler's rows start at
        different columns). Returns the logits ``(B, V)``."""
        x = self.inner.embed_tokens(ids)
        B = x.shape[0]
        rows, D, P = B * self.kv_heads, self.head_dim, prompt_bias.shape[-1]
        cos, sin = self._rotary(x, positions)
        cache = self.cache
        for i, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(x), cos, sin)
            keys, values = cache.write(i, column, k.reshape(rows, D), v.reshape(rows, D))
            # query head h reads key/value head h // groups: the groups' queries side by side;
            # the prompt's keys once for all of its samples' queries
            q = q.reshape(rows, self.groups, D)
            on_prompt = torch.baddbmm(
                prompt_bias,
                self._by_prompt(q),
                cache.prompt_keys[i].transpose(1, 2),
                alpha=self.scaling,
            )
            # (columns, rows, groups): each row's query against its own decoded keys
            on_decoded = (keys.unsqueeze(2) * q).sum(-1) * self.scaling
            if decoded_bias is not None:
                on_decoded = on_decoded + decoded_bias[: column + 1]
            scores = torch.cat([self._by_row(on_prompt), on_decoded.permute(1, 2, 0)], dim=-1)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = self._by_row(torch.bmm(self._by_prompt(probs[..., :P]), cache.prompt_values[i]))
            weights = probs[..., P:].permute(2, 0, 1).unsqueeze(-1)  # (columns, rows, groups, 1)
            out = out + (weights * values.unsqueeze(2)).sum(0)
            x = x + attn.o_proj(out.view(B, 1, self.heads * D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._logits(x)


def check_left_padded(mask: torch.Tensor) -> None:
    if mask.shape[1] and bool((mask[:, :-1] & ~mask[:, 1:]).any()):
        raise ValueError("the fast decoder needs left-padded prompts (padding before the text)")


@torch.no_grad()
def generate(
    policy,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int | None,
    num_return_sequences: int = 1,
    greedy: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    return_logprobs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sample (or greedily decode) up to ``max_new_tokens`` tokens after left-padded prompts.

    Args:
        input_ids, attention_mask: ``(B', P)`` prompts, padded on the left.
        num_return_sequences: completions per prompt ``G``; rows come grouped by prompt
            (``B = B' G``), and each prompt's forward runs once for its ``G`` samples.
        return_logprobs: also return the log-probability ``(B, T)`` of each chosen token under
            the distribution it was drawn from (``log_softmax`` of :func:`next_token_scores`;
            0 after a row's end).

    Returns the new tokens ``(B, T)``, ``T <= max_new_tokens`` (fewer when every row ended with
    EOS): what Hugging Face's ``generate`` returns after the prompts (``[:, P:]``) for the same
    settings and the prompts repeated ``G`` times each, the pad id after a row's EOS. Uses the
    global torch RNG, as ``generate`` does.
    """
    mask = attention_mask.bool()
    check_left_padded(mask)
    groups, P = input_ids.shape
    G = num_return_sequences
    B, device = groups * G, input_ids.device
    if max_new_tokens == 0 or B == 0:
        empty = torch.zeros(B, 0, dtype=torch.long, device=device)
        return (empty, empty.float()) if return_logprobs else empty
    if pad_token_id is None:
        pad_token_id = eos_token_id if eos_token_id is not None else 0
    decoder = Decoder(policy, groups, G, P, max_new_tokens)
    logits, last_position, prompt_bias = prefill_prompts(decoder, input_ids, attention_mask)
    out, logprobs = _decode(
        decoder,
        logits.repeat_interleave(G, dim=0),
        last_position[:, None].repeat_interleave(G, dim=0),
        prompt_bias,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        greedy=greedy,
        temperature=temperature,
        top_p=top_p,
        return_logprobs=return_logprobs,
    )
    return (out, logprobs) if return_logprobs else out


def prefill_prompts(
    decoder: Decoder, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the ``(U, P)`` left-padded prompts through ``decoder`` (filling its prompt cache).

    Returns ``(logits (U, V), last_position (U,), prompt_bias (U * H_kv, 1, P))``: the next-token
    logits after each prompt, the rotary position of its last token, and the additive attention
    bias that later steps read the prompt columns with (0 on the prompt's tokens, -inf on its
    padding). In the prefill a query sees the prompt's earlier tokens (a padding query only
    itself).
    """
    mask = attention_mask.bool()
    U, P = input_ids.shape
    device = input_ids.device
    dtype = decoder.cache.keys.dtype
    causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
    allowed = (causal & mask[:, None, :]) | torch.eye(P, dtype=torch.bool, device=device)
    prefill_bias = torch.zeros(U, 1, P, P, dtype=dtype, device=device)
    prefill_bias.masked_fill_(~allowed[:, None], float("-inf"))
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = decoder.prefill(input_ids, positions, prefill_bias)
    prompt_bias = torch.zeros(U, P, dtype=dtype, device=device).masked_fill_(~mask, -torch.inf)
    prompt_bias = prompt_bias.repeat_interleave(decoder.kv_heads, dim=0)[:, None]
    return logits, positions[:, -1], prompt_bias


def _decode(
    decoder: Decoder,
    logits: torch.Tensor,
    position: torch.Tensor,
    prompt_bias: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int,
    greedy: bool,
    temperature: float,
    top_p: float,
    return_logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decoding loop of :func:`generate` from the prefill's ``logits (B, V)`` at rotary
    ``position (B, 1)``: ``(tokens (B, T), logprobs (B, T) | None)``. The prompt's padding stays
    masked; every decoded column is visible, finished rows included (as in ``generate``, whose
    attention mask grows by a one per step)."""
    B, device = logits.shape[0], prompt_bias.device
    out = torch.empty(B, max_new_tokens, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, max_new_tokens, device=device) if return_logprobs else None
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    pad = torch.tensor(pad_token_id, device=device)
    steps = max_new_tokens
    for t in range(max_new_tokens):
        scores = logits if greedy else next_token_scores(logits, temperature, top_p)
        if greedy:
            token = torch.argmax(scores, dim=-1)
        else:
            token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        if logprobs is not None:
            chosen = torch.log_softmax(scores, dim=-1).gather(-1, token[:, None]).squeeze(-1)
            logprobs[:, t] = torch.where(unfinished, chosen, 0.0)
        token = torch.where(unfinished, token, pad)
        out[:, t] = token
        if eos_token_id is not None:
            unfinished &= token != eos_token_id
            if not bool(unfinished.any()):
                steps = t + 1
                break
        if t == max_new_tokens - 1:
            break
        position = position + 1
        logits = decoder.step(token[:, None], position, t, prompt_bias)
    return out[:, :steps], None if logprobs is None else logprobs[:, :steps]

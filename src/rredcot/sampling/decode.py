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

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F_nn

from rredcot.sampling.memory import token_chunks

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
    position's float32 logits. Public for :mod:`rredcot.sampling.tree`, whose branches share one prefill
    and copy columns of each other's caches."""

    def __init__(
        self,
        policy,
        prompts: int,
        samples: int,
        prompt_len: int,
        new_tokens: int,
        keep_hidden: bool = False,
    ):
        model = base_model(policy)
        config = model.config
        self.inner, self.lm_head = model.model, model.lm_head
        self.softcap = getattr(config, "final_logit_softcapping", None)
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
        # keep_hidden: the final-norm hidden state after each prompt ``(B', H)`` and after each
        # decoded column ``(T, B, H)``: a probe's first token is scored from it (score_probes)
        self.prompt_hidden: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        if keep_hidden:
            shape = (new_tokens, prompts * samples, config.hidden_size)
            self.hidden = torch.empty(shape, dtype=like.dtype, device=like.device)

    def _rotary(self, x, positions):
        cos, sin = self.inner.rotary_emb(x, positions)  # (B, n, D)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def _logits(self, x: torch.Tensor, column: int | None = None) -> torch.Tensor:
        """The last position's float32 logits; with ``keep_hidden`` its normed hidden state is
        kept (the prompts' where ``column`` is None, else decoded column ``column``'s)."""
        hidden = self.inner.norm(x[:, -1:])
        if self.hidden is not None:
            if column is None:
                self.prompt_hidden = hidden[:, -1].clone()
            else:
                self.hidden[column] = hidden[:, -1]
        return self.lm_head(hidden)[:, -1].float()

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
        return self._logits(x, column)


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
    out, logprobs, _ = _generate(
        policy,
        input_ids,
        attention_mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        num_return_sequences=num_return_sequences,
        greedy=greedy,
        temperature=temperature,
        top_p=top_p,
        return_logprobs=return_logprobs,
        keep_cache=False,
    )
    return (out, logprobs) if return_logprobs else out


@torch.no_grad()
def generate_keeping_cache(
    policy, input_ids: torch.Tensor, attention_mask: torch.Tensor, **options
) -> tuple[torch.Tensor, SampledCache | None]:
    """:func:`generate`'s tokens ``(B, T)`` (``options``: its keyword arguments but
    ``return_logprobs``), and the filled cache they were decoded with (:class:`SampledCache`),
    for :func:`score_probes`; None where nothing was decoded. Free it (``.free()``) when done:
    it holds every layer's keys and values of the batch."""
    out, _, decoder = _generate(policy, input_ids, attention_mask, keep_cache=True, **options)
    if decoder is None:
        return out, None
    cache = SampledCache(
        store=_CacheStore(decoder, base_model(policy)),
        prompt_ids=input_ids.detach().cpu(),
        prompt_mask=attention_mask.detach().bool().cpu(),
        response_ids=out.detach().cpu(),
        filled=max(out.shape[1] - 1, 0),  # the last token is sampled, never forwarded
        samples=options.get("num_return_sequences", 1),
        rows=torch.arange(out.shape[0]),
        version=parameter_version(base_model(policy)),
    )
    return out, cache


def _generate(
    policy,
    input_ids,
    attention_mask,
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int | None,
    num_return_sequences: int = 1,
    greedy: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    return_logprobs: bool = False,
    keep_cache: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, Decoder | None]:
    """:func:`generate`: ``(tokens, logprobs | None, the decoder | None)``; the decoder keeps
    its hidden states (``keep_cache``) for :func:`generate_keeping_cache`."""
    mask = attention_mask.bool()
    check_left_padded(mask)
    groups, P = input_ids.shape
    G = num_return_sequences
    B, device = groups * G, input_ids.device
    if max_new_tokens == 0 or B == 0:
        empty = torch.zeros(B, 0, dtype=torch.long, device=device)
        return empty, empty.float() if return_logprobs else None, None
    if pad_token_id is None:
        pad_token_id = eos_token_id if eos_token_id is not None else 0
    decoder = Decoder(policy, groups, G, P, max_new_tokens, keep_hidden=keep_cache)
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
    return out, logprobs, decoder if keep_cache else None


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


# ---------------------------------------------------------------------------------------------
# Probes scored against the cache of a sampled batch


def parameter_version(model) -> int:
    """The sum of the parameters' in-place version counters: it changes whenever a parameter is
    written in place (an optimiser step, a loaded state dict), so a cache taken at one value
    holds the current policy's keys and values only while it is unchanged."""
    return sum(p._version for p in model.parameters())


class _CacheStore:
    """The decoder (its layers and filled cache) that every view of one :class:`SampledCache`
    shares, until :meth:`free`."""

    def __init__(self, decoder: Decoder, model) -> None:
        self.decoder: Decoder | None = decoder
        self.model = model

    def free(self) -> None:
        self.decoder = self.model = None


@dataclasses.dataclass(frozen=True, eq=False)
class SampledCache:
    """The fast decoder's cache of one sampled batch (:func:`generate_keeping_cache`), kept so
    that probes written after a prefix of a sampled row are scored against it
    (:func:`score_probes`) instead of re-forwarding the prompt and prefix: each prompt's keys and
    values, those of each row's first ``filled`` decoded tokens, and the normed hidden state
    after the prompt and after each of those tokens, at the parameters it sampled with.

    A view of a batch's rows: ``rows (N,)`` gives each batch row's sampled row (-1: none, a row
    added after sampling); :meth:`select` follows ``RolloutBatch.select``."""

    store: _CacheStore
    prompt_ids: torch.Tensor  # (U, P) the prompts as decoded, left-padded, CPU
    prompt_mask: torch.Tensor  # (U, P) bool, CPU
    response_ids: torch.Tensor  # (B, T) the decoded tokens (the pad id after a row's end), CPU
    filled: int  # decoded columns whose keys, values and hidden states are cached (T - 1)
    samples: int  # G: sampled row r decoded prompt r // G
    rows: torch.Tensor  # (N,) long, batch row -> sampled row, -1 for none
    version: int  # parameter_version when sampled

    def select(self, rows) -> SampledCache:
        """The view of batch rows ``rows`` (as ``RolloutBatch.select``)."""
        return dataclasses.replace(self, rows=self.rows[torch.as_tensor(rows, dtype=torch.long)])

    def appended(self, count: int) -> SampledCache:
        """The view with ``count`` rows that were not sampled added at the end."""
        none = torch.full((count,), -1, dtype=torch.long)
        return dataclasses.replace(self, rows=torch.cat([self.rows, none]))

    def free(self) -> None:
        """Release the keys, values and hidden states (every view of them)."""
        self.store.free()

    def unusable_reason(self, model) -> str | None:
        """Why probes of ``model`` (unwrapped) cannot read this cache, in a phrase; None if they
        can: the same model, its parameters unchanged since sampling."""
        if self.store.decoder is None:
            return "the cache was freed"
        if base_model(model) is not self.store.model:
            return "the probes score another model"
        if parameter_version(self.store.model) != self.version:
            return "the parameters changed since sampling"
        return None

    def sampled_row(self, row: int, prompt_ids, prompt_mask, prefix_ids) -> int:
        """Batch row ``row``'s sampled row where its prompt ``prompt_ids, prompt_mask (P,)`` and
        response prefix ``prefix_ids (c,)`` are token for token the ones decoded there; -1
        otherwise (then the cache does not hold its keys)."""
        sampled = int(self.rows[row]) if row < len(self.rows) else -1
        c = len(prefix_ids)
        if sampled < 0 or c > self.response_ids.shape[1]:
            return -1
        prompt = sampled // self.samples
        mask = prompt_mask.bool().cpu()
        same = (
            prompt_ids.shape == self.prompt_ids[prompt].shape
            and torch.equal(mask, self.prompt_mask[prompt])
            and torch.equal(prompt_ids.cpu()[mask], self.prompt_ids[prompt][mask])
            and torch.equal(prefix_ids.cpu(), self.response_ids[sampled, :c])
        )
        return sampled if same else -1


@dataclasses.dataclass
class _RowQueries:
    """One sampled row's probe pass: its query tokens are the decoded tokens its probes need
    beyond the cache (the tail: columns ``context`` to the largest ``b``), then each probe's."""

    row: int  # sampled row
    prompt: int  # its prompt
    context: int  # cached decoded columns it reads
    ids: list[int] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)
    decoded_seen: list[int] = dataclasses.field(default_factory=list)  # cached columns < this
    tail_seen: list[int] = dataclasses.field(default_factory=list)  # tail queries < this
    block_start: list[int] = dataclasses.field(default_factory=list)  # own block [start, q]
    # per probe token, what predicts it: ("query", q), ("decoded", column) or ("prompt", 0)
    sources: list[list[tuple[str, int]]] = dataclasses.field(default_factory=list)


def _row_queries(cache: SampledCache, row: int, probes: list[tuple[int, Sequence[int]]]):
    """The :class:`_RowQueries` of sampled row ``row``'s ``probes``, ``(b, ids)`` each."""
    n_prompt = int(cache.prompt_mask[row // cache.samples].sum())
    c = max(b for b, _ in probes)
    context = min(c, cache.filled)
    lay = _RowQueries(row, row // cache.samples, context)
    for i, token in enumerate(cache.response_ids[row, context:c].tolist()):
        lay.ids.append(token)
        lay.positions.append(n_prompt + context + i)
        lay.decoded_seen.append(context)
        lay.tail_seen.append(0)
        lay.block_start.append(0)
    for b, ids in probes:
        start = len(lay.ids)
        for j, token in enumerate(ids):
            lay.ids.append(int(token))
            lay.positions.append(n_prompt + b + j)
            lay.decoded_seen.append(min(b, context))
            lay.tail_seen.append(max(b - context, 0))
            lay.block_start.append(start)
        if not ids:
            lay.sources.append([])
            continue
        if b == 0:
            first = ("prompt", 0)
        elif b - 1 < context:
            first = ("decoded", b - 1)
        else:
            first = ("query", b - 1 - context)
        lay.sources.append([first] + [("query", start + j) for j in range(len(ids) - 1)])
    return lay


def _query_bias(cache: SampledCache, chunk: list[_RowQueries], Q: int, F: int, like):
    """The additive attention bias ``(R, 1, Q, P + F + Q)`` of a chunk's queries over the keys
    ``[prompt (P) | cached decoded columns (F) | the queries' own (Q)]``: 0 where a query may
    look (its prompt's tokens, the decoded columns before its boundary, the tail tokens before it
    and its own probe's earlier tokens), -inf elsewhere; a padding query sees itself only."""
    P = cache.prompt_ids.shape[1]
    R = len(chunk)
    allowed = torch.zeros(R, Q, P + F + Q, dtype=torch.bool)
    decoded, own = torch.arange(F), torch.arange(Q)
    for r, lay in enumerate(chunk):
        n = len(lay.ids)
        query = torch.arange(n)[:, None]
        allowed[r, :n, :P] = cache.prompt_mask[lay.prompt]
        allowed[r, :n, P : P + F] = decoded[None] < torch.tensor(lay.decoded_seen)[:, None]
        block = (own[None] >= torch.tensor(lay.block_start)[:, None]) & (own[None] <= query)
        allowed[r, :n, P + F :] = block | (own[None] < torch.tensor(lay.tail_seen)[:, None])
    allowed[:, own, P + F + own] = True
    bias = torch.zeros(allowed.shape, dtype=like.dtype).masked_fill_(~allowed, -torch.inf)
    return bias[:, None].to(like.device)


def _row_keys(decoder: Decoder, layer: int, k, v, prompts, rows, F: int):
    """Keys and values ``(R, H_kv, P + F + Q, D)`` of layer ``layer`` for a chunk's queries:
    the cached ones of their ``prompts (R,)``, of their sampled ``rows (R,)``' first ``F``
    decoded columns, then their own ``k, v (R, H_kv, Q, D)``."""
    cache = decoder.cache
    U, kv, D = decoder.prompts, decoder.kv_heads, decoder.head_dim
    B = U * decoder.samples

    def joined(prompt_part, decoded_part, own):
        on_prompt = prompt_part[layer].view(U, kv, -1, D)[prompts]
        on_decoded = decoded_part[layer, :F].view(F, B, kv, D)[:, rows].permute(1, 2, 0, 3)
        return torch.cat([on_prompt, on_decoded, own], dim=2)

    return joined(cache.prompt_keys, cache.keys, k), joined(cache.prompt_values, cache.values, v)


def _forward_queries(decoder: Decoder, cache: SampledCache, chunk: list[_RowQueries]):
    """The normed last hidden states ``(R, Q, H)`` of a chunk's query tokens, attending over
    their rows' cached prompt and decoded keys and values and their own (:func:`_query_bias`),
    with the decoder's layer parts. Only the attention sees the rows padded to ``Q``; the
    projections and MLPs run on the real query tokens alone (rows' probe counts differ)."""
    like = decoder.cache.keys
    R, Q = len(chunk), max(len(lay.ids) for lay in chunk)
    F = max(lay.context for lay in chunk)
    real = torch.zeros(R, Q, dtype=torch.bool)
    for r, lay in enumerate(chunk):
        real[r, : len(lay.ids)] = True
    real = real.to(like.device)
    ids = torch.tensor([t for lay in chunk for t in lay.ids], dtype=torch.long)
    positions = torch.tensor([p for lay in chunk for p in lay.positions], dtype=torch.long)
    bias = _query_bias(cache, chunk, Q, F, like)
    rows = torch.tensor([lay.row for lay in chunk], device=like.device)
    prompts = torch.tensor([lay.prompt for lay in chunk], device=like.device)

    def padded(t: torch.Tensor) -> torch.Tensor:  # (1, heads, N, D) -> (R, heads, Q, D)
        out = t.new_zeros(R, Q, t.shape[1], t.shape[-1])
        out[real] = t[0].transpose(0, 1)
        return out.transpose(1, 2)

    x = decoder.inner.embed_tokens(ids.to(like.device))[None]  # (1, N, H)
    cos, sin = decoder._rotary(x, positions.to(like.device)[None])
    for i, layer in enumerate(decoder.inner.layers):
        attn = layer.self_attn
        q, k, v = (padded(t) for t in decoder._qkv(attn, layer.input_layernorm(x), cos, sin))
        keys, values = _row_keys(decoder, i, k, v, prompts, rows, F)
        # query head h reads key/value head h // groups, as the model's own sdpa attention
        keys = keys.repeat_interleave(decoder.groups, dim=1)  # (R, H, P + F + Q, D)
        values = values.repeat_interleave(decoder.groups, dim=1)
        out = F_nn.scaled_dot_product_attention(
            q, keys, values, attn_mask=bias, scale=decoder.scaling
        )  # (R, H, Q, D)
        out = out.transpose(1, 2).reshape(R, Q, -1)[real][None]  # (1, N, H * D)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    hidden = decoder.inner.norm(x)[0]
    out = hidden.new_zeros(R, Q, hidden.shape[-1])
    out[real] = hidden
    return out


def _picked_hidden(decoder: Decoder, chunk: list[_RowQueries], hidden: torch.Tensor):
    """The normed hidden state ``(N, H)`` before each probe token of the chunk, in order: a
    query's (``hidden (R, Q, H)``), a cached decoded column's, or the prompt's last."""
    picked = []
    for r, lay in enumerate(chunk):
        for sources in lay.sources:
            for kind, index in sources:
                if kind == "query":
                    picked.append(hidden[r, index])
                elif kind == "decoded":
                    picked.append(decoder.hidden[index, lay.row])
                else:
                    picked.append(decoder.prompt_hidden[lay.prompt])
    return torch.stack(picked) if picked else hidden.new_zeros(0, hidden.shape[-1])


def _chosen_logprobs(decoder: Decoder, picked, targets, logits_mb: int) -> torch.Tensor:
    """``log softmax(head(picked))`` at ``targets (N,)``, float32 on the CPU, the output head
    (soft-capped where the model caps) over at most ``logits_mb`` MiB of fp32 logits at a time."""
    vocab = decoder.lm_head.weight.shape[0]
    step = max(1, (logits_mb << 20) // (4 * vocab))
    token_logp = torch.empty(len(targets), dtype=torch.float32)
    targets = targets.to(picked.device)
    for start in range(0, len(targets), step):
        sl = slice(start, start + step)
        logits = decoder.lm_head(picked[sl]).float()
        if decoder.softcap:
            logits = torch.tanh(logits / decoder.softcap) * decoder.softcap
        chosen = logits.gather(-1, targets[sl, None]).squeeze(-1)
        token_logp[sl] = (chosen - torch.logsumexp(logits, dim=-1)).cpu()
    return token_logp


@torch.no_grad()
def score_probes(
    cache: SampledCache,
    probes: Sequence[tuple[int, int, Sequence[int]]],
    max_batch_tokens: int = 16384,
    logits_mb: int = 256,
) -> tuple[list[torch.Tensor], int]:
    """Per-token log-probs of probes ``(sampled row, b, ids)``, each the tokens ``ids`` written
    after the prompt and the first ``b`` decoded tokens of a sampled row, read from ``cache``.

    Per row one forward of its probes' tokens only (all its probes concatenated), over keys
    ``[its prompt's cached keys (pad columns masked) | its cached decoded columns | its own]``:
    a probe sees the prompt, decoded columns ``< b`` and its own earlier tokens, at positions
    ``prompt tokens + b + i`` (:func:`rredcot.methods.probe_logprobs.packed_probe_logprobs`'s
    values). A probe's first token is scored from the hidden state kept after its prefix; a
    boundary past the cached columns (the last token, sampled but never forwarded) forwards the
    missing decoded tokens too. Rows go into forwards of at most ``max_batch_tokens`` (rows x
    prompt + prefix + queries); ``logits_mb`` bounds the logits.

    Returns (one ``(len(ids),)`` float32 CPU tensor per probe, in order; tokens forwarded).
    """
    decoder = cache.store.decoder
    if decoder is None:
        raise ValueError("score_probes: the cache was freed")
    by_row: dict[int, list[int]] = {}
    for i, (row, _, _) in enumerate(probes):
        by_row.setdefault(row, []).append(i)
    out: list[torch.Tensor | None] = [None] * len(probes)
    for i, (_, _, ids) in enumerate(probes):
        if not ids:  # nothing to score
            out[i] = torch.zeros(0, dtype=torch.float32)
    by_row = {r: [i for i in items if out[i] is None] for r, items in by_row.items()}
    rows = [r for r, items in by_row.items() if items]
    layouts = [_row_queries(cache, r, [probes[i][1:] for i in by_row[r]]) for r in rows]
    # rows of similar query counts share a forward: less padding in its attention
    by_length = sorted(range(len(rows)), key=lambda g: -len(layouts[g].ids))
    rows, layouts = [rows[g] for g in by_length], [layouts[g] for g in by_length]
    P = cache.prompt_ids.shape[1]
    lengths = [P + lay.context + len(lay.ids) for lay in layouts]
    forwarded = 0
    for group in token_chunks(lengths, max_batch_tokens):
        chunk = [layouts[g] for g in group]
        hidden = _forward_queries(decoder, cache, chunk)
        order = [i for g in group for i in by_row[rows[g]]]
        targets = torch.tensor([int(t) for i in order for t in probes[i][2]], dtype=torch.long)
        token_logp = _chosen_logprobs(
            decoder, _picked_hidden(decoder, chunk, hidden), targets, logits_mb
        )
        start = 0
        for i in order:
            m = len(probes[i][2])
            out[i] = token_logp[start : start + m]
            start += m
        forwarded += sum(len(lay.ids) for lay in chunk)
    return out, forwarded  # type: ignore[return-value]

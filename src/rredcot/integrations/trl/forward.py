"""Forwards: the hidden states of a forward TRL runs anyway (a hook on the decoder), the
adapter's own no-grad forwards, and where the value head's inputs come from. No TRL import."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from rredcot.methods.base import CreditMethod, CreditRows, RolloutBatch
from rredcot.methods.processes import Collective
from rredcot.models import is_activation_checkpointing, set_activation_checkpointing
from rredcot.sampling.forward import eval_mode, policy_forward
from rredcot.sampling.rollout import segment_batch
from rredcot.segment import Segmenter

__all__ = [
    "capture_hidden_states",
    "counting_forwards",
    "decoder_of",
    "entropy_segmented",
    "even_out_forwards",
    "extra_forward",
    "hidden_source",
    "local_rows",
    "no_checkpointing",
]


def decoder_of(model) -> torch.nn.Module:
    """The transformer backbone whose output TRL's fused LM head reads."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(inner, "module", inner)  # DDP / DeepSpeed engine
    if hasattr(inner, "get_decoder"):
        return inner.get_decoder()
    return inner.base_model


@contextlib.contextmanager
def capture_hidden_states(model, layers: tuple[int, ...], store: list[Tensor]):
    """While active, every forward of ``model``'s decoder also returns its hidden states, and
    the chosen layers (concatenated on the last dim, detached) are appended to ``store``."""
    decoder = decoder_of(model)

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


@contextlib.contextmanager
def no_checkpointing(model, kwargs):
    """Activation checkpointing off for a no-grad forward (as TRL's
    ``disable_gradient_checkpointing``, through transformers' current method names: TRL's
    calls the deprecated ``is_gradient_checkpointing`` on every step), then back on."""
    was_on = is_activation_checkpointing(model)
    if was_on:
        set_activation_checkpointing(model, False)
    try:
        yield
    finally:
        if was_on:
            set_activation_checkpointing(model, True, kwargs)


def counting_forwards(model) -> tuple[list[int], Any]:
    """A forward-pre-hook on ``model`` that counts its calls: ``(counter, handle)``."""
    counter = [0]

    def pre(module, args):
        counter[0] += 1

    return counter, model.register_forward_pre_hook(pre)


def hidden_source(args, mode: str, trl_pass: bool) -> str:
    """Where the hidden states come from, as rredcot train's step reads them: ``trl_pass``
    (TRL's own scoring pass, where ``trl_pass`` says TRL runs it), ``loss_forward`` (a generation
    batch that is one micro-batch: its loss forward, the trainer's single pass) or
    ``own_forward`` (a no-grad forward of the adapter's own: the trainer's scoring pass under
    gradient accumulation)."""
    if trl_pass:
        return "trl_pass"
    one_micro_batch = mode == "eval" or args.steps_per_generation == 1
    return "loss_forward" if one_micro_batch and not args.use_liger_kernel else "own_forward"


def local_rows(
    method: CreditMethod, batch: RolloutBatch, model, collective: Collective
) -> CreditRows:
    """The method's rows of this process's batch (:meth:`CreditMethod.rows`: boundary
    features, or values such as answer-likelihood probes). The forwards it runs are evened
    out across processes with dummy forwards, so sharded models (ZeRO-3, FSDP) see the same
    number of forwards on every rank."""
    counter, handle = counting_forwards(model)
    try:
        local = method.rows(batch)
    finally:
        handle.remove()
    even_out_forwards(model, collective, counter[0])
    return local


@torch.no_grad()
def even_out_forwards(model, collective: Collective, done: int) -> int:
    """Run one-token no-grad forwards until this process has run as many as the busiest
    one; returns how many it ran."""
    most = collective.max_int(done)
    ids = torch.zeros(1, 1, dtype=torch.long, device=collective.device)
    for _ in range(most - done):
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return most - done


def extra_forward(
    model, output: dict, layers: tuple[int, ...], checkpointing_kwargs, trl_logps, batch_size: int
) -> tuple[Tensor, Tensor]:
    """``(hidden states (B, P+T, D), log-probs (B, T))`` of the local rows by one no-grad
    forward of the adapter's own (where neither TRL's pass nor a single loss forward gives
    them). ``trl_logps``: TRL's ``_get_per_token_logps_and_entropies`` (not the adapter's)."""
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    store: list[Tensor] = []
    with (
        torch.no_grad(),
        no_checkpointing(model, checkpointing_kwargs),
        capture_hidden_states(model, layers, store),
    ):
        logps, _, _ = trl_logps(
            model, ids, mask, output["completion_ids"].size(1), batch_size=batch_size
        )
    return torch.cat(store, dim=0), logps


@torch.no_grad()
def entropy_segmented(
    model, batch: RolloutBatch, tokenizer, segmenter: Segmenter, temperature: float
) -> RolloutBatch:
    """``batch`` cut by the entropy strategy (``entropy``, ``keywords+entropy``,
    ``newline+merge``), with the policy's next-token entropies from one extra no-grad forward
    (TRL's own pass comes after the advantages are needed)."""
    with eval_mode(model):
        fwd = policy_forward(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_len,
            with_entropy=True,
            temperature=temperature,
            shared_prompt=False,
        )
    return segment_batch(batch, tokenizer, segmenter, fwd.entropy)

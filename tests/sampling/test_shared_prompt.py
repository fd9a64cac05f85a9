"""The policy forward that computes each distinct prompt once (rredcot.sampling.forward.shared_prompt_forward) gives the
plain forward's log-probs, entropies, hidden states, loss and gradients to float rounding."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from helpers import micro_config, train_step_with_grads
from rredcot.models import set_activation_checkpointing
from rredcot.sampling import forward, shared_prompt
from rredcot.sampling.forward import (
    policy_forward,
    position_ids_from_mask,
    train_mode_without_dropout,
)
from rredcot.sampling.rollout import sample
from rredcot.training.trainer import Trainer
from tiny_lms import gqa_lm, lively

PROMPTS = ["1+2=?\n", "12*34+5=?\n", "7\n"]  # different lengths: left padding


def _model(arch: str, tok, tiny_policy):
    if arch == "llama":
        return lively(tiny_policy)
    cls, cfg = {
        "llama_gqa": (LlamaForCausalLM, LlamaConfig),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config),
    }[arch]
    return gqa_lm(cls, cfg, tok, seed=1)


def _batch(model, tok, G=4):
    """Sampled rows, G per prompt, cut to different response lengths (padding after the end,
    as after an EOS)."""
    model.eval()
    torch.manual_seed(0)
    input_ids, attention_mask, P, response_mask = sample(
        model, tok, PROMPTS, num_generations=G, max_new_tokens=24, temperature=1.5
    )
    T = response_mask.shape[1]
    lengths = torch.tensor([T - 3 * (row % 5) for row in range(len(input_ids))]).clamp(min=1)
    response_mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    input_ids = input_ids.clone()
    input_ids[:, P:][~response_mask.bool()] = tok.pad_token_id
    attention_mask = torch.cat([attention_mask[:, :P], response_mask.long()], dim=1)
    return input_ids, attention_mask, P, response_mask


def _loss_and_grads(model, batch, shared, hidden_layers=None):
    input_ids, attention_mask, P, response_mask = batch
    model.zero_grad(set_to_none=True)
    train_mode_without_dropout(model)
    fwd = policy_forward(
        model,
        input_ids,
        attention_mask,
        P,
        with_entropy=True,
        hidden_layers=hidden_layers,
        temperature=0.8,
        shared_prompt=shared,
    )
    advantages = torch.linspace(-1, 1, input_ids.shape[0])[:, None]
    loss = -(fwd.logprobs * advantages * response_mask).sum() / response_mask.sum()
    if fwd.hidden_states is not None:  # a gradient through the real tokens' hidden states
        loss = loss + 1e-3 * fwd.hidden_states[attention_mask.bool()].pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return fwd, loss.detach(), grads


@pytest.mark.parametrize("arch", ["llama", "llama_gqa", "qwen2"])
def test_loss_and_gradients_equal_the_plain_forward(tiny_policy, char_tokenizer, arch):
    model = _model(arch, char_tokenizer, tiny_policy)
    batch = _batch(model, char_tokenizer)
    input_ids, attention_mask, P, response_mask = batch
    assert not response_mask.bool().all()  # some responses end early
    assert forward.shared_prompt_forward(model, input_ids, attention_mask, P) is not None  # it ran
    layers = (0, 1, -1)
    fast, fast_loss, fast_grads = _loss_and_grads(model, batch, True, layers)
    plain, plain_loss, plain_grads = _loss_and_grads(model, batch, False, layers)
    valid = response_mask.bool()
    torch.testing.assert_close(fast.logprobs[valid], plain.logprobs[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.entropy[valid], plain.entropy[valid], atol=1e-5, rtol=1e-5)
    assert not fast.entropy.requires_grad  # a metric: no graph kept for it
    seen = attention_mask.bool()  # hidden states wherever a real token sits
    torch.testing.assert_close(
        fast.hidden_states[seen], plain.hidden_states[seen], atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(fast_loss, plain_loss, atol=1e-6, rtol=1e-5)
    assert fast_grads.keys() == plain_grads.keys() and len(fast_grads) > 0
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_lora_gradients_equal_the_plain_forward(tiny_policy, char_tokenizer):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        lively(tiny_policy),
        peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]),
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)
    assert forward.shared_prompt_unsupported_reason(model) is None
    batch = _batch(model, char_tokenizer)
    fast, fast_loss, fast_grads = _loss_and_grads(model, batch, True)
    plain, plain_loss, plain_grads = _loss_and_grads(model, batch, False)
    torch.testing.assert_close(fast_loss, plain_loss, atol=1e-6, rtol=1e-5)
    assert any("lora" in n for n in plain_grads) and fast_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_prompt_groups_find_every_distinct_prompt():
    ids = torch.tensor([[0, 5, 6, 9], [0, 5, 6, 8], [7, 5, 6, 9], [0, 5, 6, 1], [7, 5, 6, 2]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    first, inverse = forward.prompt_groups(ids, mask, prompt_len=3)
    assert len(first) == 2
    assert torch.equal(inverse[[0, 1, 3]], inverse[[0, 0, 0]]) and inverse[2] == inverse[4]
    assert inverse[0] != inverse[2]
    for row in range(5):  # each row's group leader holds the same prompt
        assert torch.equal(ids[first[inverse[row]], :3], ids[row, :3])


def test_nothing_shared_or_unsupported_falls_back_to_the_plain_forward(tiny_policy, char_tokenizer):
    model = lively(tiny_policy)
    input_ids, attention_mask, P, _ = _batch(model, char_tokenizer, G=1)
    assert (
        forward.shared_prompt_forward(model, input_ids, attention_mask, P) is None
    )  # one per prompt
    set_activation_checkpointing(model, True)
    assert forward.shared_prompt_unsupported_reason(model) == "gradient checkpointing"


@pytest.mark.parametrize("method", ["uniform", "value_head"])
def test_a_training_step_is_the_same_with_the_shared_prompt_forward(init_dir, tmp_path, method):
    """A whole RL step (value head: hidden states read from the loss forward; KL reference)
    gives the same loss, credit and gradients with and without the shared-prompt forward."""
    grads, records = {}, {}
    for shared in (True, False):
        cfg = micro_config(init_dir, tmp_path / f"run{shared}", credit_method=method, kl_coef=0.1)
        cfg.shared_prompt_forward = shared
        cfg.credit.handover.mode = "off"
        trainer = Trainer(cfg, log=lambda *_: None)
        lively(trainer.policy)
        lively(trainer.reference, seed=1)  # a KL gradient even where rewards agree
        records[shared], grads[shared] = train_step_with_grads(trainer)
        trainer.release()
    for key in ("policy_loss", "advantage_abs_mean", "kl", "entropy"):
        assert records[True][key] == pytest.approx(records[False][key], rel=1e-4, abs=1e-6), key
    assert any(g.abs().max() > 0 for g in grads[True])
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_the_plain_forward_scores_only_response_positions_exactly(tiny_policy, char_tokenizer):
    """The output head on the scored positions alone (``logits_to_keep``) gives the log-probs of
    the full logits."""
    model = lively(tiny_policy).eval()
    input_ids, attention_mask, P, response_mask = _batch(model, char_tokenizer)
    fwd = policy_forward(model, input_ids, attention_mask, P, shared_prompt=False)
    with torch.no_grad():
        positions = position_ids_from_mask(attention_mask)
        logits = model(input_ids, attention_mask=attention_mask, position_ids=positions).logits
        full = torch.log_softmax(logits[:, P - 1 : -1].float(), dim=-1)
    want = full.gather(-1, input_ids[:, P:, None]).squeeze(-1)
    valid = response_mask.bool()
    torch.testing.assert_close(fwd.logprobs[valid], want[valid], atol=1e-6, rtol=1e-6)


def test_the_shared_prompt_forward_keeps_its_path_before_sampling_forward():
    assert shared_prompt.forward is forward.shared_prompt_forward
    assert shared_prompt.unsupported_reason is forward.shared_prompt_unsupported_reason
    assert shared_prompt.prompt_groups is forward.prompt_groups

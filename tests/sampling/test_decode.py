"""The fast decoding loop (rredcot.sampling.decode) against Hugging Face ``generate``: the same tokens
greedily and, from the same RNG state, when sampling; the distribution of every drawn token is
the one the loss forward scores."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from rredcot.sampling import decode
from rredcot.sampling.forward import policy_forward
from rredcot.sampling.rollout import encode_prompts, resolve_decoder, sample
from tiny_lms import gqa_lm, lively

PROMPTS = ["1+2=?\n", "12*34+5=?\n", "7\n", "(3+4)*5-6=?\n"]  # different lengths: left padding


def _lively(model, seed: int = 0):
    return lively(model, seed).eval()


@pytest.fixture
def policy(tiny_policy):
    return _lively(tiny_policy)


def _hf_new_tokens(model, ids, mask, *, eos, pad, max_new_tokens, greedy, **sampling):
    kwargs = dict(do_sample=False) if greedy else dict(do_sample=True, top_k=0, **sampling)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
        **kwargs,
    )
    return out[:, ids.shape[1] :]


def _gqa_llama(tok):
    return gqa_lm(LlamaForCausalLM, LlamaConfig, tok, seed=1).eval()


def _tiny_qwen2(tok):
    return gqa_lm(Qwen2ForCausalLM, Qwen2Config, tok, seed=2).eval()


def _mid_batch_eos(model, ids, mask, pad) -> int:
    """A token that greedy decoding emits in some rows (not first) and not in others: as the
    EOS id it ends rows in the middle of the batch."""
    tokens = _hf_new_tokens(
        model, ids, mask, eos=None, pad=pad, max_new_tokens=12, greedy=True
    ).tolist()
    for candidate in sorted({t for row in tokens for t in row[1:]}):
        hits = [candidate in row[1:] for row in tokens]
        if any(hits) and not all(hits):
            return candidate
    raise AssertionError("no token ends some rows but not others")


@pytest.mark.parametrize("arch", ["llama", "llama_gqa", "qwen2"])
def test_greedy_tokens_equal_generate_with_eos_mid_batch(policy, char_tokenizer, arch):
    model = {
        "llama": lambda: policy,
        "llama_gqa": lambda: _gqa_llama(char_tokenizer),
        "qwen2": lambda: _tiny_qwen2(char_tokenizer),
    }[arch]()
    assert decode.unsupported_reason(model) is None
    ids, mask = encode_prompts(char_tokenizer, PROMPTS, "cpu")
    assert not mask.all()  # the prompts really are padded
    pad = char_tokenizer.pad_token_id
    eos = _mid_batch_eos(model, ids, mask, pad)
    want = _hf_new_tokens(model, ids, mask, eos=eos, pad=pad, max_new_tokens=20, greedy=True)
    got = decode.generate(
        model, ids, mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=pad, greedy=True
    )
    ended = (want == eos).any(-1)
    assert ended.any() and not ended.all()  # some rows stop mid-batch, others run on
    assert torch.equal(got, want)


def test_the_loop_stops_once_every_row_has_ended(policy, char_tokenizer):
    ids, mask = encode_prompts(char_tokenizer, PROMPTS, "cpu")
    pad = char_tokenizer.pad_token_id
    kwargs = dict(max_new_tokens=30, pad_token_id=pad, greedy=True)
    endless = decode.generate(policy, ids, mask, eos_token_id=None, **kwargs)
    assert endless.shape == (len(PROMPTS), 30)
    # a token every row emits somewhere, as EOS: every row ends before the limit
    common = set.intersection(*(set(row[:20]) for row in endless.tolist()))
    eos = min(common)
    got = decode.generate(policy, ids, mask, eos_token_id=eos, **kwargs)
    want = _hf_new_tokens(policy, ids, mask, eos=eos, pad=pad, max_new_tokens=30, greedy=True)
    assert got.shape[1] < 30 and (got == eos).any(-1).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_tokens_equal_generate_from_the_same_seed(
    policy, char_tokenizer, temperature, top_p
):
    """Same RNG state, same draws: the loop makes generate's one multinomial call per step."""
    ids, mask = encode_prompts(char_tokenizer, PROMPTS, "cpu")
    eos, pad = char_tokenizer.eos_token_id, char_tokenizer.pad_token_id
    G = 3
    torch.manual_seed(5)
    want = _hf_new_tokens(
        policy,
        ids.repeat_interleave(G, 0),
        mask.repeat_interleave(G, 0),
        eos=eos,
        pad=pad,
        max_new_tokens=24,
        greedy=False,
        temperature=temperature,
        top_p=top_p,
    )
    draws = []
    for _ in range(2):
        torch.manual_seed(5)
        draws.append(
            decode.generate(
                policy,
                ids,
                mask,
                num_return_sequences=G,
                max_new_tokens=24,
                eos_token_id=eos,
                pad_token_id=pad,
                temperature=temperature,
                top_p=top_p,
            )
        )
    assert torch.equal(draws[0], draws[1])  # a seed fixes the draw
    assert torch.equal(draws[0], want)
    torch.manual_seed(6)
    other = decode.generate(
        policy, ids, mask, num_return_sequences=G, max_new_tokens=24, eos_token_id=eos,
        pad_token_id=pad, temperature=temperature, top_p=top_p,
    )  # fmt: skip
    assert not torch.equal(other, draws[0])


def test_sampling_scores_are_generates_temperature_and_top_p():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    for temperature, top_p in [(1.0, 1.0), (0.5, 1.0), (1.3, 0.8), (1.0, 0.05)]:
        want = logits.clone()
        if temperature != 1.0:
            want = TemperatureLogitsWarper(temperature)(None, want)
        if top_p < 1.0:
            want = TopPLogitsWarper(top_p)(None, want)
        got = decode.next_token_scores(logits, temperature, top_p)
        assert torch.equal(got, want)
        kept = torch.isfinite(got)
        assert kept.any(-1).all()  # the most probable token is always kept
        if top_p == 1.0:
            assert kept.all()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_drawn_tokens_logprobs_equal_the_loss_forward(policy, char_tokenizer, temperature):
    """The distribution every token was drawn from (prefill, cache, positions, padding) is the
    one the loss forward scores: the same log-probs to float precision."""
    ids, mask = encode_prompts(char_tokenizer, PROMPTS, "cpu")
    G = 2
    torch.manual_seed(3)
    tokens, logprobs = decode.generate(
        policy,
        ids,
        mask,
        num_return_sequences=G,
        max_new_tokens=16,
        eos_token_id=char_tokenizer.eos_token_id,
        pad_token_id=char_tokenizer.pad_token_id,
        temperature=temperature,
        return_logprobs=True,
    )
    from rredcot.sampling.rollout import response_mask_from_ids

    response_mask = response_mask_from_ids(tokens, char_tokenizer.eos_token_id)
    full_ids = torch.cat([ids.repeat_interleave(G, 0), tokens], dim=1)
    full_mask = torch.cat([mask.repeat_interleave(G, 0), response_mask.long()], dim=1)
    with torch.no_grad():
        fwd = policy_forward(policy, full_ids, full_mask, ids.shape[1], temperature=temperature)
    assert response_mask.sum() > len(PROMPTS) * G  # more than one token per row
    torch.testing.assert_close(
        logprobs * response_mask, fwd.logprobs * response_mask, atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("side", ["left", "right"])
def test_sample_gives_the_same_batch_with_either_decoder(policy, char_tokenizer, side):
    """``rollout.sample`` pads prompts on the left whatever the tokenizer's side; the fast loop
    and generate then agree on every token of the batch."""
    char_tokenizer.padding_side = side
    try:
        batches = {}
        for decoder in ("fast", "hf"):
            torch.manual_seed(11)
            batches[decoder] = sample(
                policy,
                char_tokenizer,
                PROMPTS,
                num_generations=4,
                max_new_tokens=20,
                temperature=0.9,
                decoder=decoder,
            )
    finally:
        char_tokenizer.padding_side = "left"
    for fast, hf in zip(batches["fast"], batches["hf"]):
        assert fast == hf if isinstance(fast, int) else torch.equal(fast, hf)


def test_right_padded_prompts_are_refused(policy, char_tokenizer):
    ids, mask = encode_prompts(char_tokenizer, PROMPTS, "cpu")
    with pytest.raises(ValueError, match="left-padded"):
        decode.generate(
            policy, ids, mask.flip(-1), max_new_tokens=4, eos_token_id=None, pad_token_id=0
        )


def test_lora_adapters_decode_as_generate(policy, char_tokenizer):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        policy, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:  # make the adapters change the function
            torch.nn.init.normal_(param, std=0.5)
    model.eval()
    assert resolve_decoder(model) == ("fast", "a supported Llama-family model")
    ids, mask = encode_prompts(char_tokenizer, PROMPTS, "cpu")
    pad = char_tokenizer.pad_token_id
    want = _hf_new_tokens(model, ids, mask, eos=None, pad=pad, max_new_tokens=12, greedy=True)
    got = decode.generate(
        model, ids, mask, max_new_tokens=12, eos_token_id=None, pad_token_id=pad, greedy=True
    )
    with model.disable_adapter():
        base = _hf_new_tokens(model, ids, mask, eos=None, pad=pad, max_new_tokens=12, greedy=True)
    assert not torch.equal(want, base)  # the adapters matter, and the loop kept them
    assert torch.equal(got, want)


def test_unsupported_models_fall_back_to_generate_and_say_why(char_tokenizer):
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=len(char_tokenizer), n_positions=64, n_embd=16, n_layer=1, n_head=2)
    ).eval()
    decoder, why = resolve_decoder(gpt2, "fast")
    assert decoder == "hf" and "model type 'gpt2'" in why
    torch.manual_seed(0)
    ids, _, P, response_mask = sample(
        gpt2, char_tokenizer, PROMPTS[:2], num_generations=2, max_new_tokens=6, decoder="fast"
    )
    assert ids.shape[0] == 4 and response_mask.shape[1] <= 6


def test_the_decoder_choice(policy):
    assert resolve_decoder(policy, "auto") == ("fast", "a supported Llama-family model")
    assert resolve_decoder(policy, "hf") == ("hf", "asked for")
    decoder, why = resolve_decoder(policy, "auto", use_model_generation_config=True)
    assert decoder == "hf" and "use_model_generation_config" in why
    policy.config.attention_dropout = 0.1
    policy.train()
    decoder, why = resolve_decoder(policy, "fast")
    assert decoder == "hf" and "dropout" in why

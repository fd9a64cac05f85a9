"""rredcot credit inside TRL's GRPOTrainer: a tiny Llama, arithmetic prompts, a few CPU steps."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch

import credit_reference
from helpers import make_rollout_batch
from metrics_doc import undocumented
from rredcot.algebra.normalization import group_mean_std
from rredcot.config import CreditConfig, HandoverConfig, TrainConfig, ValueHeadConfig
from rredcot.integrations.trl import (
    CREDIT_STATE_FILE,
    RREDCoTGRPOConfig,
    RREDCoTGRPOTrainer,
    task_reward,
)
from rredcot.methods.base import CreditContext, CreditRows, build_credit, credit_names
from rredcot.sampling.forward import fill_forward
from rredcot.sampling.rollout import segment_batch
from trl_trainers import SpyTrainer, digit_share, make_trainer

pytestmark = pytest.mark.trl


def test_value_head_gives_segment_credit_and_learns(tiny_model_dir, arithmetic_dataset, tmp_path):
    trainer = make_trainer(tiny_model_dir, arithmetic_dataset, tmp_path)
    head = trainer.credit_method.head
    before = {k: v.clone() for k, v in head.state_dict().items()}
    trainer.train()

    assert len(trainer.records) == 2
    varied = 0
    for rec in trainer.records:
        adv, mask, batch = rec["ours"], rec["mask"].bool(), rec["batch"]
        assert adv.shape == mask.shape  # (B, T): token-level advantages reached TRL
        assert torch.isfinite(adv).all() and (adv[~mask] == 0).all()
        for row, bounds in enumerate(batch.boundaries):
            seg_values = [adv[row, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
            for seg in seg_values:  # one advantage per segment
                assert torch.allclose(seg, seg[0].expand_as(seg))
            if len(seg_values) > 1:
                firsts = torch.stack([s[0] for s in seg_values])
                varied += int((firsts.max() - firsts.min()) > 1e-6)
    assert varied > 0, "value-head credit should differ between the segments of a completion"

    after = head.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the head did not train"
    assert trainer.credit_method.guard.num_updates == 2
    # TRL skips its old-log-prob pass here (its defaults): the hidden states come from the loss
    # forward itself, so no extra forward.
    assert all(rec["deferred"] for rec in trainer.records)
    history = [h for h in trainer.state.log_history if "rredcot/extra_forward" in h]
    assert [h["rredcot/extra_forward"] for h in history] == [0.0, 0.0]
    assert all("rredcot/value/loss" in h for h in history)


def test_uniform_reproduces_trl_advantages(tiny_model_dir, arithmetic_dataset, tmp_path):
    trainer = make_trainer(tiny_model_dir, arithmetic_dataset, tmp_path, method="uniform")
    trainer.train()
    nonzero = 0
    for rec in trainer.records:
        trl, ours, mask = rec["trl"], rec["ours"], rec["mask"].to(torch.float32)
        assert trl.dim() == 1 and ours.dim() == 2
        expected = trl.unsqueeze(1) * mask
        assert torch.equal(ours, expected)  # bit for bit
        nonzero += int((trl.abs() > 1e-3).sum())
    assert nonzero > 0, "rewards never varied within a group: the comparison would be vacuous"


def test_advantage_tail_floor_drops_the_small_tail_as_rredcot_train(
    tiny_model_dir, arithmetic_dataset, tmp_path
):
    """``advantage_tail_floor``: the advantages TRL's loss receives are the credit's with each
    completion's tail after its last ``|A| >= floor`` set to 0 (rredcot train's
    ``row_policies.drop_small_tails``); a negative floor is refused."""
    from rredcot.training.row_policies import drop_small_tails

    floor = 0.5
    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path,
        method="process_reward",
        credit={"process_reward": {"function": f"{__name__}:alternating_scores"}},
        advantage_tail_floor=floor,
        max_steps=1,
    )
    trainer.train()
    rec = trainer.records[0]
    mask = rec["mask"].to(torch.float32)
    credit = trainer.last_credit.advantages.to(torch.float32) * mask
    torch.testing.assert_close(rec["ours"], drop_small_tails(credit, mask, floor))
    dropped = (credit != 0) & (rec["ours"] == 0)
    assert dropped.any() and (rec["ours"] != 0).any()  # a tail went, the rest stayed
    with pytest.raises(ValueError, match="advantage_tail_floor"):
        RREDCoTGRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, advantage_tail_floor=-0.1
        )


def alternating_scores(prompt, completion, ends):
    """Step scores that rise and fall, so a completion's segment credit varies in size."""
    return [0.9 * (k % 2) + 0.01 * min(k, 9) for k in range(len(ends))]


def test_hidden_states_come_from_trls_own_forward(tiny_model_dir, arithmetic_dataset, tmp_path):
    class CheckHidden(SpyTrainer):
        def _apply_credit(self, inputs, output):
            output = super()._apply_credit(inputs, output)
            batch = self.last_batch
            with torch.no_grad():
                ref = self.model(
                    input_ids=batch.input_ids,
                    attention_mask=batch.attention_mask,
                    output_hidden_states=True,
                ).hidden_states[-1]
            self.records[-1]["reference"] = ref
            return output

    # steps_per_generation > gradient_accumulation_steps: TRL runs the old-log-prob pass itself.
    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path,
        cls=CheckHidden,
        steps_per_generation=2,
        max_steps=1,
    )
    assert trainer._trl_runs_old_logprob_pass()
    trainer.train()
    rec = trainer.records[0]
    hidden, ref = rec["batch"].hidden_states, rec["reference"]
    assert hidden.shape == ref.shape
    real = rec["batch"].attention_mask.bool()
    torch.testing.assert_close(hidden[real], ref[real], rtol=1e-4, atol=1e-5)
    history = [h for h in trainer.state.log_history if "rredcot/extra_forward" in h]
    assert history and all(h["rredcot/extra_forward"] == 0.0 for h in history)


def test_value_head_features_equal_the_trainers(tiny_model_dir, arithmetic_dataset, tmp_path):
    """With ``credit.value_head.logprob_features`` the TRL path's value head reads what rredcot's own
    trainer gives it for the same completions: the same segments, and the same boundary features
    (hidden states at the prefix ends, then the log-prob features) as ``forward.fill_forward``."""

    class Compare(SpyTrainer):
        def _apply_credit(self, inputs, output):
            output = super()._apply_credit(inputs, output)
            batch, method = self.last_batch, self.credit_method
            plain = batch.replace(hidden_states=None, old_logprobs=None)
            ours = fill_forward(
                self.model, plain, method.hidden_layers, temperature=self.temperature
            )
            ours = segment_batch(ours, self._tokenizer, self.segmenter)
            self.records[-1].update(
                features_trl=method.boundary_features(batch)[:2],
                features_trainer=method.boundary_features(ours)[:2],
                boundaries_trainer=ours.boundaries,
            )
            return output

    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path,
        cls=Compare,
        credit={"value_head": {"logprob_features": True}},
        steps_per_generation=2,  # TRL runs its old-log-prob pass: hidden states and log-probs
        max_steps=1,
    )
    trainer.train()
    rec = trainer.records[0]
    batch = rec["batch"]
    assert batch.prompt_len > 1 and batch.old_logprobs is not None  # the real batch
    assert batch.boundaries == rec["boundaries_trainer"]
    (trl, trl_mask), (ours, our_mask) = rec["features_trl"], rec["features_trainer"]
    hidden = trainer.model.config.hidden_size
    assert trl.shape[-1] == hidden + trainer.credit_method.extra_size == hidden + 4
    assert torch.equal(trl_mask, our_mask)
    torch.testing.assert_close(trl, ours, rtol=1e-4, atol=1e-5)
    assert trl[..., hidden:].abs().sum() > 0  # the log-prob features are there, not zeros
    assert trainer.credit_method.guard.num_updates == 1


def test_value_head_saved_with_checkpoints_and_resumed(
    tiny_model_dir, arithmetic_dataset, tmp_path
):
    trainer = make_trainer(
        tiny_model_dir, arithmetic_dataset, tmp_path, save_strategy="steps", save_steps=2
    )
    trainer.train()
    ckpt = tmp_path / "checkpoint-2"
    assert (ckpt / CREDIT_STATE_FILE).exists()
    saved_head = {k: v.clone() for k, v in trainer.credit_method.head.state_dict().items()}

    resumed = make_trainer(
        tiny_model_dir, arithmetic_dataset, tmp_path, save_strategy="no", max_steps=3
    )
    assert resumed.credit_method.guard.num_updates == 0
    assert resumed.load_credit_state(ckpt)
    loaded = resumed.credit_method.head.state_dict()
    assert all(torch.equal(saved_head[k], loaded[k].to(saved_head[k].device)) for k in saved_head)

    fresh = make_trainer(
        tiny_model_dir, arithmetic_dataset, tmp_path, save_strategy="no", max_steps=3
    )
    fresh.train(resume_from_checkpoint=str(ckpt))
    assert fresh.state.global_step == 3
    assert fresh.credit_method.guard.num_updates == 3  # 2 restored + 1 after resuming

    fresh.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / CREDIT_STATE_FILE).exists()


def test_answer_likelihood_is_selectable(tiny_model_dir, arithmetic_dataset, tmp_path):
    trainer = make_trainer(
        tiny_model_dir, arithmetic_dataset, tmp_path, method="answer_likelihood", max_steps=1
    )
    trainer.train()
    rec = trainer.records[0]
    adv, mask = rec["ours"], rec["mask"].bool()
    assert torch.isfinite(adv).all() and adv.shape == mask.shape
    batch, out = rec["batch"], trainer.last_credit
    assert batch.problems[0].answer == arithmetic_dataset[0]["answer"]
    probed = out.value_mask.clone()
    probed[torch.arange(batch.size), batch.num_segments] = False  # V(s_n) is the outcome
    assert probed.any()
    values = out.values[probed]
    assert ((values > 0) & (values < 1)).all()  # probabilities of answering right, not outcomes
    logged = [h for h in trainer.state.log_history if "rredcot/credit/extra_forward_tokens" in h]
    assert logged and logged[0]["rredcot/credit/extra_forward_tokens"] > 0  # the probes' one pass


def test_process_reward_prm_is_selectable(tiny_model_dir, arithmetic_dataset, tmp_path):
    """A frozen sequence-classification PRM (a tiny Llama built here) as the value source: its
    scores reach the credit at every interior boundary, and the hand-over learns each step."""
    from rredcot.models import build_char_tokenizer
    from tiny_lms import save_prm

    prm_dir = tmp_path / "prm"
    save_prm(prm_dir, "sequence", build_char_tokenizer())
    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path / "out",
        method="process_reward",
        credit={"process_reward": {"model": str(prm_dir)}},
    )
    trainer.train()
    assert len(trainer.records) == 2
    varied = 0
    for rec in trainer.records:
        adv, mask, batch = rec["ours"], rec["mask"].bool(), rec["batch"]
        assert adv.shape == mask.shape and torch.isfinite(adv).all() and (adv[~mask] == 0).all()
        for row, bounds in enumerate(batch.boundaries):
            firsts = [float(adv[row, a]) for a in bounds[:-1]]
            varied += int(len(firsts) > 1 and max(firsts) - min(firsts) > 1e-6)
    assert varied > 0, "PRM credit should differ between the segments of a completion"
    method, batch, out = trainer.credit_method, trainer.last_batch, trainer.last_credit
    assert method.guard.num_updates == 2  # the hand-over measured each step's fresh outcomes
    again, mask, _ = method.boundary_values(batch)  # the PRM is frozen: the same scores
    interior = mask.clone()
    interior[:, 0] = False
    interior[torch.arange(batch.size), batch.num_segments] = False
    assert interior.any()
    torch.testing.assert_close(out.values[interior], again[interior], rtol=1e-5, atol=1e-6)
    assert ((again[interior] > 0) & (again[interior] < 1)).all()
    logged = [h for h in trainer.state.log_history if "rredcot/credit/extra_forward_tokens" in h]
    assert logged and logged[0]["rredcot/credit/extra_forward_tokens"] > 0  # the PRM's tokens


@pytest.mark.parametrize("logprob_features", [False, True])
def test_gathered_features_train_the_head_like_the_full_batch(
    tiny_policy, char_tokenizer, arithmetic_task, logprob_features
):
    """The adapter hands the head tensors: the batch's own boundary features, zero-padded to
    the widest row of every process. Credit and training on them equal the batch's own."""
    batch = make_rollout_batch(tiny_policy, char_tokenizer, arithmetic_task, segmenter="tokens:5")
    cfg = CreditConfig(
        handover=HandoverConfig(mode="off"),
        value_head=ValueHeadConfig(
            replay=0,
            epochs=2,
            logprob_features=logprob_features,
            shared_prefixes=False,  # prefix ids are the trainer's own (not gathered)
        ),
    )
    ctx = CreditContext(policy=tiny_policy, tokenizer=char_tokenizer)
    full, tensors = build_credit("value_head", cfg, ctx), build_credit("value_head", cfg, ctx)
    feats, mask, _ = tensors.boundary_features(batch)
    width = feats.shape[1] + 2  # another process had longer rows
    feats = torch.cat([feats, feats.new_zeros(feats.shape[0], 2, feats.shape[2])], dim=1)
    mask = torch.cat([mask, mask.new_zeros(mask.shape[0], 2)], dim=1)
    assert feats.shape[1] == width
    assert feats.shape[2] == tensors.head.input_size + tensors.extra_size
    live = batch.response_mask.sum(-1) > 0
    expected = full.estimate(full.rows(batch)).credit
    rows = CreditRows(
        rewards=batch.rewards,
        group_ids=batch.group_ids,
        num_segments=batch.num_segments,
        live=live,
        value_mask=mask,
        segment_lengths=torch.zeros(mask.shape[0], mask.shape[1] - 1),
        features=feats,
    )
    estimate = tensors.estimate(rows)
    got = estimate.credit
    S1 = expected.values.shape[1]
    torch.testing.assert_close(got.values[:, :S1], expected.values)
    assert torch.equal(got.mask[:, :S1], expected.mask) and not got.mask[:, S1:].any()
    credit_reference.learn(full, batch)
    tensors.update(rows, estimate)
    for a, b in zip(full.head.parameters(), tensors.head.parameters()):
        torch.testing.assert_close(a, b)


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="valid keys"):
        RREDCoTGRPOConfig(output_dir=str(tmp_path), use_cpu=True, credit={"lamda": 0.5})
    with pytest.raises(ValueError, match="unknown credit method"):
        RREDCoTGRPOConfig(output_dir=str(tmp_path), use_cpu=True, credit_method="vine")
    with pytest.raises(ValueError, match="not supported in TRL"):
        RREDCoTGRPOConfig(output_dir=str(tmp_path), use_cpu=True, credit_method="monte_carlo")
    with pytest.raises(ValueError, match="needs task"):
        RREDCoTGRPOConfig(output_dir=str(tmp_path), use_cpu=True, credit_method="answer_likelihood")
    with pytest.raises(ValueError, match="needs a value source"):
        RREDCoTGRPOConfig(output_dir=str(tmp_path), use_cpu=True, credit_method="process_reward")
    # a misspelt segmenter fails in the config, naming the valid ones (before any model loads)
    with pytest.raises(
        ValueError, match=r"credit.segmenter: unknown .* 'newlines'; valid: newline, "
    ):
        RREDCoTGRPOConfig(output_dir=str(tmp_path), use_cpu=True, credit={"segmenter": "newlines"})
    with pytest.raises(ValueError, match="agreeing_std"):
        RREDCoTGRPOConfig(output_dir=str(tmp_path), use_cpu=True, credit={"agreeing_std": -1})
    cfg = RREDCoTGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, credit='{"segmenter": "sentence", "lam": 0.25}'
    )
    assert cfg.credit_config.segmenter == "sentence" and cfg.credit_config.lam == 0.25

    from trl import GRPOConfig

    with pytest.raises(TypeError, match="RREDCoTGRPOConfig"):
        RREDCoTGRPOTrainer(model="unused", args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True))


def test_credit_dict_takes_sections(tmp_path):
    def credit_config(credit):
        return RREDCoTGRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, credit=credit
        ).credit_config

    new = credit_config({"value_head": {"lr": 0.003}, "handover": {"mode": "off"}})
    assert new == credit_config('{"value_head": {"lr": 0.003}, "handover": {"mode": "off"}}')
    assert (new.value_head.lr, new.handover.mode) == (0.003, "off")
    # every unset field is rredcot train's default (TrainConfig's credit), not a TRL copy
    unset = credit_config({})
    assert unset.normalization == "group_or_batch_std"  # auto, through scale_rewards="group"
    assert dataclasses.replace(unset, normalization="auto") == TrainConfig().credit
    assert new.value_head.logprob_features is True
    off = credit_config({"value_head": {"logprob_features": False}})
    assert off.value_head.logprob_features is False
    with pytest.raises(ValueError, match="alik_feature is not supported in TRL"):
        credit_config({"value_head": {"alik_feature": True}})
    with pytest.raises(ValueError, match="teacher is not supported in TRL"):
        credit_config({"value_head": {"teacher": "continuation_likelihood"}})
    with pytest.raises(
        ValueError, match="unknown config key credit.value_lr; valid keys in credit"
    ):
        credit_config({"value_lr": 0.003})


def test_task_reward_scores_with_the_verifier():
    reward = task_reward("arithmetic", num_steps=2)
    prompt = "Compute 2+3*4 step by step.\n"  # any prompt works: the answer column decides
    out = reward([prompt, prompt], ["2+3=5\n5*4=20\nA:20", "A:19"], answer=["20", "20"])
    assert out == [1.0, 0.0]
    with pytest.raises(ValueError, match="no 'answer' column"):
        reward([prompt], ["A:20"], solution=["20"])


def test_the_trl_internals_the_adapter_overrides_still_exist(
    tiny_model_dir, arithmetic_dataset, tmp_path
):
    """The GRPOTrainer methods the adapter overrides are listed in one place
    (OVERRIDDEN_TRL_METHODS), the list is complete, and TRL still has each, with the private
    attributes it reads: a TRL upgrade that renames one fails here, not in a training run."""
    from trl import GRPOTrainer

    from rredcot.integrations.trl import OVERRIDDEN_TRL_METHODS
    from rredcot.integrations.trl.trainer import TRL_PRIVATE_ATTRIBUTES

    missing = [n for n in OVERRIDDEN_TRL_METHODS if not callable(getattr(GRPOTrainer, n, None))]
    assert missing == [], f"TRL's GRPOTrainer no longer has {missing}"
    overridden = {
        n for n in vars(RREDCoTGRPOTrainer) if not n.startswith("__") and hasattr(GRPOTrainer, n)
    }
    assert overridden == set(OVERRIDDEN_TRL_METHODS)
    trainer = make_trainer(tiny_model_dir, arithmetic_dataset, tmp_path)
    assert [a for a in TRL_PRIVATE_ATTRIBUTES if not hasattr(trainer, a)] == []


@pytest.mark.slow
def test_core_imports_neither_trl_nor_verl():
    code = (
        "import sys, rredcot, rredcot.algebra.credit, rredcot.segment, rredcot.methods.base, "
        "rredcot.sampling.rollout, rredcot.training.trainer, rredcot.integrations, rredcot.integrations._batch\n"
        "from rredcot.methods.base import get_credit\n"
        "get_credit('value_head'); get_credit('answer_likelihood')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('trl', 'verl'))\n"
        "assert not bad, bad\n"
        "print('clean')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


@pytest.mark.slow
def test_two_processes_groups_span_them(tiny_model_dir, tmp_path):
    """Two real processes (torchrun, gloo): each holds 2 completions of a 4-completion group.
    Uniform credit equals TRL's global advantages; value-head metrics and the head itself are the
    same on both processes."""
    import json
    import os
    import socket
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("trl_two_process.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
        str(script),
        tiny_model_dir,
        str(tmp_path),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("result_*.json"))]
    by = {(r["method"], r["rank"]): r for r in results}
    assert set(by) == {(m, r) for m in ("uniform", "value_head") for r in (0, 1)}
    for rank in (0, 1):
        uni = by["uniform", rank]
        assert uni["world"] == 2 and uni["rows"] == 2  # half a group per process
        assert uni["worst"] < 1e-5
    assert by["uniform", 0]["nonzero"] + by["uniform", 1]["nonzero"] > 0
    vh0, vh1 = by["value_head", 0], by["value_head", 1]
    assert vh0["finite"] and vh1["finite"] and vh0["updates"] == vh1["updates"] == 2
    assert vh0["head"] == vh1["head"]  # trained on the same gathered batch
    assert vh0["logs"] == vh1["logs"] and vh0["logs"]  # credit metrics reduced over processes
    assert all(h.get("rredcot/extra_forward") == 0.0 for h in vh0["logs"])


@pytest.mark.parametrize("scale_rewards", ["none", "group"])
def test_uniform_follows_scale_rewards_exactly(
    tiny_model_dir, arithmetic_dataset, tmp_path, scale_rewards
):
    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path,
        method="uniform",
        scale_rewards=scale_rewards,
        max_steps=1,
    )
    expected_mode = {"none": "none", "group": "group_std"}[scale_rewards]
    assert trainer.credit_method.normalization == expected_mode
    trainer.train()
    for rec in trainer.records:
        expected = rec["trl"].unsqueeze(1) * rec["mask"].to(torch.float32)
        assert torch.equal(rec["ours"], expected)  # TRL's advantages bit for bit
        assert float(rec["trl"].abs().max()) > 1e-3  # rewards varied: not a vacuous check


def small_spread(completions, **kwargs) -> list[float]:
    """A continuous reward whose groups' std is ~0.01-0.03: below credit.agreeing_std (0.1)."""
    return [0.5 + 0.05 * s for s in digit_share(completions)]


def step_scores(prompt, completion, ends):
    return [0.2 + 0.6 * (k % 2) for k in range(len(ends))]


@pytest.mark.parametrize("method", ["value_head", "process_reward", "answer_likelihood"])
def test_handover_weight_zero_is_trls_grpo_for_small_spread_rewards(
    tiny_model_dir, arithmetic_dataset, tmp_path, method, capsys
):
    """Before any trust is earned (w = 0) every value method's advantages are TRL's GRPO
    advantages, also where every group's reward std (~0.02) is below credit.agreeing_std (the
    value head's shared prefixes off: their mean outcomes act from the first step, as in
    rredcot train)."""
    credit = {"handover": {"mode": "reliability"}}
    if method == "value_head":
        credit["value_head"] = {"shared_prefixes": False}
    if method == "process_reward":
        credit["process_reward"] = {"function": f"{__name__}:step_scores"}
    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path,
        method=method,
        credit=credit,
        reward_funcs=[small_spread],
        reward_weights=[1.0],
        max_steps=1,
    )
    started = capsys.readouterr().out  # the one line saying what was resolved
    assert f"rredcot: credit_method={method}, segmenter=tokens:4 (answer line merged), " in started
    assert (
        "normalization=group_or_batch_std (agreeing_std 0.1), from scale_rewards='group'" in started
    )
    assert "hand-over=reliability (slope, starts at w = 0: GRPO)" in started
    features = {
        "value_head": "features=hidden states of layers [-1] + log-prob features from the loss "
        "forward (one micro-batch per generation batch)",
        "process_reward": f"features=step scores of {__name__}:step_scores",
        "answer_likelihood": "features=the policy's probability of the reference answer",
    }
    assert features[method] in started
    trainer.train()
    logged = {k for h in trainer.state.log_history for k in h}
    ours = {k for k in logged if k.startswith("rredcot/")}
    assert ours and not any(k.startswith(("credit/", "value/")) for k in logged)  # one namespace
    assert any(k.startswith("rredcot/value/") for k in ours) == (method == "value_head")
    assert undocumented(ours, prefix="rredcot/") == []  # every key is in docs/metrics.md
    rec = trainer.records[0]
    rewards = trainer.last_batch.rewards
    _, std = group_mean_std(rewards, trainer.last_batch.group_ids)
    assert 0 < float(std.max()) < 0.1  # every group below the agreeing threshold, none agreeing
    assert trainer.last_credit.metrics["credit/handover_weight"] == 0.0
    assert trainer.last_credit.metrics["credit/agreeing_groups"] == 1.0
    expected = rec["trl"].unsqueeze(1) * rec["mask"].to(torch.float32)
    assert torch.equal(rec["ours"], expected)  # TRL's GRPO bit for bit
    assert float(rec["trl"].abs().max()) > 0.5  # GRPO's scale: rewards varied in the groups


@pytest.mark.parametrize("method", ["uniform", "value_head"])
def test_scale_rewards_batch_is_trls_for_small_spread_rewards(
    tiny_model_dir, arithmetic_dataset, tmp_path, method
):
    """scale_rewards="batch" with a batch reward std below batch_std's 0.1 floor: uniform, and a
    value method before any trust is earned, still give TRL's advantages (the floor only guards
    the value credit's departure from GRPO; shared prefixes off, whose means act at once)."""
    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path,
        method=method,
        credit={"handover": {"mode": "reliability"}, "value_head": {"shared_prefixes": False}},
        reward_funcs=[small_spread],
        reward_weights=[1.0],
        scale_rewards="batch",
        max_steps=1,
    )
    assert trainer.credit_method.normalization == "batch_std"
    trainer.train()
    rec = trainer.records[0]
    assert float(trainer.last_batch.rewards.std()) < 0.1
    expected = rec["trl"].unsqueeze(1) * rec["mask"].to(torch.float32)
    assert torch.equal(rec["ours"], expected)  # TRL's advantages bit for bit
    assert float(rec["trl"].abs().max()) > 0.5


def test_explain_reads_a_trl_run(tiny_model_dir, arithmetic_dataset, tmp_path, capsys):
    """`rredcot explain --run OUTPUT_DIR` (or a checkpoint-N) uses the TRL run's policy, its
    trained head (value_head.pt), its credit settings (tokens:4) and its task (rredcot_credit.json)."""
    from rredcot.cli.commands import main
    from rredcot.integrations.saved import SETTINGS_FILE, read_settings

    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path,
        save_strategy="steps",
        save_steps=1,
        max_steps=1,
    )
    trainer.train()
    ckpt = tmp_path / "checkpoint-1"
    assert (ckpt / CREDIT_STATE_FILE).exists() and (ckpt / SETTINGS_FILE).exists()
    saved = read_settings(ckpt)
    assert (saved.credit_method, saved.task, saved.task_args) == (
        "value_head",
        "arithmetic",
        {"num_steps": 2},
    )
    assert saved.credit.segmenter == "tokens:4" and saved.credit.lam == 0.5
    assert saved.sampling.max_new_tokens == 24

    assert main(["explain", "--run", str(tmp_path), "--samples", "3", "--no-color"]) == 0
    captured = capsys.readouterr()
    assert "untrained" not in captured.err and "no --run" not in captured.err
    assert f"value_head (head from {ckpt})" in captured.out
    prompts = [line for line in captured.out.splitlines() if line.startswith("prompt: ")]
    assert prompts and all(p.count("+") + p.count("-") + p.count("*") >= 1 for p in prompts)
    rows = [line for line in captured.out.splitlines() if re.match(r"\s+\d+\s+-?\d\.\d{3}", line)]
    assert rows and all(len(r.split("  ")[-1].replace("⏎", "\n")) <= 4 for r in rows)

    trainer.save_model(str(tmp_path / "final"))  # the final model: settings beside it too
    assert main(["explain", "--run", str(tmp_path / "final"), "--samples", "2"]) == 0
    assert f"head from {tmp_path / 'final'}" in capsys.readouterr().out


def test_scale_rewards_maps_and_conflicts_warn(tmp_path):
    from rredcot.integrations.trl import normalization_for_scale_rewards as norm

    assert norm("group", "uniform") == "group_std"
    assert norm("group", "value_head") == "group_or_batch_std"
    assert norm("batch", "value_head") == "batch_std" and norm(False, "uniform") == "none"
    with pytest.raises(ValueError, match="scale_rewards"):
        norm("token", "uniform")
    cfg = RREDCoTGRPOConfig(output_dir=str(tmp_path), use_cpu=True, scale_rewards="batch")
    assert cfg.credit_config.normalization == "batch_std"
    with pytest.warns(UserWarning, match="overrides scale_rewards='none'"):
        cfg = RREDCoTGRPOConfig(
            output_dir=str(tmp_path),
            use_cpu=True,
            scale_rewards="none",
            credit={"normalization": "batch_std"},
        )
    assert cfg.credit_config.normalization == "batch_std"  # the explicit choice wins


@pytest.mark.parametrize("sharding", ["zero3", "flat_shard"])
def test_head_width_does_not_depend_on_sharding(char_tokenizer, sharding):
    """ZeRO-3 empties every local parameter (full size in ``ds_numel``); other sharding leaves a
    slice: the auto width must be the unsharded model's, not 8 units."""
    from rredcot.models import build_tiny_llama

    def width(model):
        cfg = CreditConfig(
            handover=HandoverConfig(mode="off"), value_head=ValueHeadConfig(logprob_features=False)
        )
        return build_credit(
            "value_head", cfg, CreditContext(model, char_tokenizer)
        ).head.hidden_size

    whole = build_tiny_llama(char_tokenizer, seed=0)
    expected = width(whole)
    sharded = build_tiny_llama(char_tokenizer, seed=0)
    for p in sharded.parameters():
        if sharding == "zero3":
            p.ds_numel = p.numel()
        p.data = torch.empty(0)
    assert sum(p.numel() for p in sharded.parameters()) == 0
    got = width(sharded)
    assert expected > 8
    assert abs(got - expected) <= max(1, expected // 50)  # the config's count: within 2%
    if sharding == "zero3":
        assert got == expected  # ds_numel is exact


GSM8K_ROWS = [  # GSM8K's own format: the reference is the number after ####
    {
        "question": "Tom has 3 apples and buys 2 more. How many apples does he have?",
        "answer": "Tom has 3 + 2 = <<3+2=5>>5 apples.\n#### 5",
    },
    {
        "question": "A box holds 4 pens. How many pens are in 2 boxes?",
        "answer": "2 boxes hold 2 * 4 = <<2*4=8>>8 pens.\n#### 8",
    },
]


@pytest.mark.real_model
@pytest.mark.slow
def test_shipped_model_by_alias_or_gguf_path_on_gsm8k_rows(tmp_path):
    """The shipped SmolLM2 by its alias or its .gguf file, as `rredcot train` takes them, on
    GSM8K rows with their native `answer` column: one CPU step, rewards from the number after
    ####, and probes of the parsed answer."""
    from datasets import Dataset

    from rredcot.integrations.trl import reference_answer, resolve_model
    from rredcot.models import DEFAULT_REAL_MODEL, resolve_model_dir, shipped_model_path
    from rredcot.tasks import get_task

    gguf = shipped_model_path(DEFAULT_REAL_MODEL)
    cached = resolve_model_dir(DEFAULT_REAL_MODEL)
    assert resolve_model(DEFAULT_REAL_MODEL) == resolve_model(str(gguf)) == cached
    assert resolve_model(str(tmp_path)) == str(tmp_path)  # a directory: TRL's to load
    task = get_task("gsm8k")
    assert [reference_answer(task, r["answer"]) for r in GSM8K_ROWS] == ["5", "8"]
    reward = task_reward("gsm8k")
    assert reward(["q", "q"], ["so 5", "so 6"], answer=[GSM8K_ROWS[0]["answer"]] * 2) == [1.0, 0.0]

    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["question"]}], **r} for r in GSM8K_ROWS]
    )
    args = RREDCoTGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        credit_method="answer_likelihood",
        task="gsm8k",
    )
    trainer = SpyTrainer(
        model=str(gguf), reward_funcs=reward, args=args, train_dataset=dataset.select([0])
    )
    assert trainer.model.config._name_or_path == cached  # not the hub
    assert 134_000_000 < sum(p.numel() for p in trainer.model.parameters()) < 135_000_000
    trainer.train()
    batch = trainer.last_batch
    assert [p.answer for p in batch.problems] == ["5", "5"]  # parsed from the native column
    assert trainer.last_credit.metrics["credit/probe_packed"] == 1.0  # packed under bf16 autocast


# ---------------------------------------------------------------------------------------------
# the adapter runs the trainer's stages, once per generation batch


def step_scores_spread(prompt, completion, ends):
    return [0.1 + 0.8 * ((k * 7 + len(completion)) % 5) / 4 for k in range(len(ends))]


TRL_CREDIT = {  # what each method needs beyond make_trainer's settings
    "process_reward": {"process_reward": {"function": f"{__name__}:step_scores_spread"}},
}


@pytest.mark.parametrize("method", credit_names())
def test_trl_credit_equals_the_trainers(tiny_model_dir, arithmetic_dataset, tmp_path, method):
    """Every registered method: the advantages TRL's loss receives equal what rredcot train's
    step gives the same batch (its scoring pass ``fill_forward``, then rows -> estimate ->
    credit_output, from the method's state before the batch); a method TRL cannot run is refused
    by the config, naming the ones it can."""
    from rredcot.integrations.trl import TRL_METHODS

    if method not in TRL_METHODS:
        with pytest.raises(ValueError, match="not supported in TRL.*use one of: auto, value_head"):
            RREDCoTGRPOConfig(output_dir=str(tmp_path), use_cpu=True, credit_method=method)
        return

    class TrainerSide(SpyTrainer):
        def _credit(self, batch, rows, loss_mask, mode):
            method = self.credit_method
            twin = copy.deepcopy(method, memo={id(method.context): method.context})
            plain = batch.replace(hidden_states=None, old_logprobs=None)
            # cut as rredcot train cuts its rows: with the group's shared prefixes laid out
            plain = plain.with_segments(plain.boundaries, plain.segment_char_starts)
            with torch.random.fork_rng():  # a head built lazily is built alike on both sides
                if twin.needs_hidden_states:
                    plain = fill_forward(
                        self.model, plain, twin.hidden_layers, temperature=self.temperature
                    )
                credit_rows = twin.rows(plain)
                estimate = twin.estimate(credit_rows)
                out = twin.credit_output(
                    credit_rows, estimate, plain.segment_ids, plain.response_mask
                )
            ours = super()._credit(batch, rows, loss_mask, mode)
            self.trainer_side = [*getattr(self, "trainer_side", []), out.advantages * loss_mask]
            return ours

    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path,
        method=method,
        cls=TrainerSide,
        credit=TRL_CREDIT.get(method, {}),
    )
    trainer.train()
    assert len(trainer.records) == len(trainer.trainer_side) == 2
    for rec, expected in zip(trainer.records, trainer.trainer_side):
        torch.testing.assert_close(rec["ours"], expected.float(), rtol=1e-4, atol=1e-5)
        assert float(rec["ours"].abs().max()) > 0.1  # rewards varied: not a vacuous comparison
    if method != "uniform":  # segment credit, not GRPO's one advantage per completion
        grpo = rec["trl"].unsqueeze(1) * rec["mask"].float()
        assert float((rec["ours"] - grpo).abs().max()) > 1e-3


@pytest.mark.parametrize(
    "source, settings",
    [
        ("loss_forward", {}),  # TRL's defaults: one micro-batch per generation batch
        ("own_forward", {"gradient_accumulation_steps": 2}),  # two micro-batches, no TRL pass
        ("trl_pass", {"steps_per_generation": 2}),  # TRL runs its old-log-prob pass
    ],
)
def test_credit_is_computed_once_per_generation_batch(
    tiny_model_dir, arithmetic_dataset, tmp_path, source, settings
):
    """However TRL splits a generation batch into micro-batches, the method's estimate, its
    credit and its update run once per generation batch, and every micro-batch's loss gets the
    rows of that one credit."""
    trainer = make_trainer(tiny_model_dir, arithmetic_dataset, tmp_path, max_steps=2, **settings)
    assert trainer._hidden_source("train") == source
    method = trainer.credit_method
    calls = {"estimate": 0, "credit_output": 0, "update": 0}

    def counted(name):
        original = getattr(method, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        return call

    for name in calls:
        setattr(method, name, counted(name))
    losses = []
    original_loss = trainer._compute_loss

    def loss(model, inputs):
        out = original_loss(model, inputs)
        losses.append(inputs["advantages"].detach().clone())
        return out

    trainer._compute_loss = loss
    trainer.train()
    batches = len(trainer.records)
    micro = trainer.args.steps_per_generation
    assert batches == 2 * trainer.args.gradient_accumulation_steps // micro
    assert calls == {"estimate": batches, "credit_output": batches, "update": batches}
    assert method.guard.num_updates == batches
    assert len(losses) == batches * micro
    for rec, parts in zip(trainer.records, zip(*[iter(losses)] * micro)):
        seen = torch.cat(parts)  # TRL's shuffled rows: the same rows, in its order
        assert seen.shape == rec["ours"].shape
        ours = sorted(map(tuple, rec["ours"].tolist()))
        assert sorted(map(tuple, seen.tolist())) == ours
    extra = [
        h["rredcot/extra_forward"]
        for h in trainer.state.log_history
        if "rredcot/extra_forward" in h
    ]
    assert extra and set(extra) == {1.0 if source == "own_forward" else 0.0}


def test_auto_chooses_on_the_first_batch_and_resume_keeps_it(
    tiny_model_dir, arithmetic_dataset, tmp_path
):
    """credit_method="auto" (the default): the first generation batch's own rewards choose the
    method by rredcot train's rule, once; the choice and the chosen method's config are written
    beside each checkpoint, and a resumed run uses them without choosing again."""
    from rredcot.integrations.saved import read_settings
    from rredcot.methods.auto import choose_credit, group_outcomes

    class Counting(SpyTrainer):
        def _choose_credit(self, rows, batch):
            self.chosen_from = (rows.rewards.clone(), rows.group_ids.clone())
            self.choices = getattr(self, "choices", 0) + 1
            return super()._choose_credit(rows, batch)

    right = set(arithmetic_dataset["prompt"][::2])

    def half_right(prompts, completions, **kwargs) -> list[float]:
        """1 for every completion of half the prompts, 0 for the others' (a group all right or
        all wrong): a batch of all four prompts has half its groups all wrong."""
        return [float(p in right) for p in prompts]

    def auto_trainer(out, **kw):
        return make_trainer(
            tiny_model_dir,
            arithmetic_dataset,
            out,
            method="auto",
            cls=Counting,
            credit={},
            reward_funcs=[half_right, digit_share],
            reward_weights=[1.0, 0.0],
            per_device_train_batch_size=16,  # the four prompts, four completions each
            **kw,
        )

    assert RREDCoTGRPOConfig(output_dir=str(tmp_path), use_cpu=True).credit_method == "auto"
    trainer = auto_trainer(tmp_path, save_strategy="steps", save_steps=1, max_steps=2)
    assert trainer.credit_method is None and trainer.credit_choice is None
    trainer.train()
    assert trainer.choices == 1
    rewards, group_ids = trainer.chosen_from
    figures = group_outcomes(rewards.cpu(), group_ids.cpu())
    assert 0 < figures["all_wrong"] < 1  # the rule had something to weigh
    expected = choose_credit(figures, has_references=True)  # arithmetic: gold chains
    choice = trainer.credit_choice
    assert (choice.method, choice.settings) == (expected.method, expected.settings)
    assert trainer.credit_method.name == choice.method
    for dotted, value in choice.settings.items():  # its settings over the run's credit config
        target = trainer.credit_method.config
        for part in dotted.split("."):
            target = getattr(target, part)
        assert target == value

    saved = read_settings(tmp_path / "checkpoint-1")
    assert saved.credit_method == choice.method and saved.credit_choice == choice.to_json()
    assert saved.credit == trainer.credit_method.config
    raw = json.loads((tmp_path / "checkpoint-1" / "rredcot_credit.json").read_text())
    assert raw["credit_choice"]["reason"] == choice.reason

    resumed = auto_trainer(tmp_path, max_steps=3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert not hasattr(resumed, "choices")  # the checkpoint's choice, not a new one
    assert resumed.credit_choice == choice
    assert resumed.credit_method.name == choice.method
    assert resumed.credit_method.config == trainer.credit_method.config
    assert resumed.state.global_step == 3 and len(resumed.records) == 1


def test_credit_output_on_a_process_rows(tiny_policy, char_tokenizer, arithmetic_task):
    """credit_output over every row with ``local``: the segment stage and the scale see every
    row, the token stage one process's rows; equal to those rows of the whole batch's credit.
    Whitening needs every token and refuses a part."""
    batch = make_rollout_batch(tiny_policy, char_tokenizer, arithmetic_task, segmenter="tokens:5")
    batch = batch.replace(rewards=(torch.arange(batch.size) % 3 / 2).float())  # groups vary
    ctx = CreditContext(policy=tiny_policy, tokenizer=char_tokenizer)
    method = build_credit("uniform", CreditConfig(), ctx)
    rows = method.rows(batch)
    estimate = method.estimate(rows)
    whole = method.credit_output(rows, estimate, batch.segment_ids, batch.response_mask)
    half = slice(batch.size // 2 - 1, batch.size)  # groups cut across the "processes"
    part = method.credit_output(
        rows, estimate, batch.segment_ids[half], batch.response_mask[half], local=half
    )
    assert float(whole.advantages.abs().max()) > 0
    torch.testing.assert_close(part.advantages, whole.advantages[half])
    torch.testing.assert_close(part.segment_advantages, whole.segment_advantages[half])
    assert torch.equal(part.value_mask, whole.value_mask[half])
    whiten = build_credit("uniform", CreditConfig(normalization="whiten"), ctx)
    with pytest.raises(ValueError, match="whiten"):
        whiten.credit_output(
            rows, estimate, batch.segment_ids[half], batch.response_mask[half], local=half
        )

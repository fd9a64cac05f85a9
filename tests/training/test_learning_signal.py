"""Tests that fail when the training is wrong, not only when it crashes.

- The reward of a task a random policy can learn in a few steps rises under the trainer's updates
  and falls when the advantages are negated (so a sign flip anywhere in the loss path is caught).
- The values behind a step's credit come from the value head *before* it trained on that step's
  outcomes (outcome leakage is caught).
- The head's TD(lambda_v) loss uses the EMA target network and lambda_v exactly as written by hand.
- Scoring matches sampling: at T != 1 the old log-probs are those of the tempered distribution,
  dropout is off in both passes (ratio exactly 1 on-policy), and with several epochs the clip acts.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

import credit_reference
from helpers import train_step_with_grads
from rredcot.algebra import normalization
from rredcot.config import TrainConfig
from rredcot.tasks import Verdict, register_task
from rredcot.tasks.arithmetic import ArithmeticTask
from rredcot.training.trainer import Trainer


class _DigitFirstTask(ArithmeticTask):
    """Reward 1 when the completion starts with a digit: a random policy gets it ~1/4 of the
    time, and one gradient direction (more digits first) raises it."""

    def verify(self, problem, completion):
        return Verdict(float(completion[:1].isdigit()), None, None, "digit first")


register_task("test_digit_first")(_DigitFirstTask)


def _config(init, out, **overrides) -> TrainConfig:
    fields = dict(
        init=str(init),
        out=str(out),
        task="test_digit_first",
        task_args={"num_steps": 2},
        credit_method="uniform",
        steps=12,
        prompts_per_step=8,
        lr=1e-2,
        eval_size=1,
        eval_every=0,
        checkpoint_every=100,
        progress=False,
    )
    cfg = TrainConfig(**{**fields, **overrides})
    cfg.sampling.num_generations = 8
    cfg.sampling.max_new_tokens = 2
    return cfg


def _rewards(run) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["reward_mean"] for r in records if "reward_mean" in r]


@pytest.mark.slow
def test_reward_rises_under_the_updates_and_falls_when_advantages_are_negated(init_dir, tmp_path):
    Trainer(_config(init_dir, tmp_path / "up"), log=lambda *_: None).train()
    up = _rewards(tmp_path / "up")
    # test_negated_uniform: GRPO's advantages negated (helpers.NegatedUniform)
    cfg = _config(init_dir, tmp_path / "down", credit_method="test_negated_uniform")
    Trainer(cfg, log=lambda *_: None).train()
    down = _rewards(tmp_path / "down")
    assert up[0] == down[0]  # same first batch: same policy, same seed
    start = up[0]
    assert 0.05 < start < 0.6
    assert sum(up[-3:]) / 3 > start + 0.25, up
    assert sum(down[-3:]) / 3 < start - 0.05, down


def test_value_head_credit_uses_values_from_before_the_head_saw_the_outcomes(init_dir, tmp_path):
    cfg = _config(init_dir, tmp_path / "run", credit_method="value_head", steps=3)
    # Credit = the head's values alone, over several segments, so that they show in advantages.
    cfg.credit.handover.mode = "off"
    cfg.credit.lam = 0.0
    cfg.credit.segmenter = "tokens:2"
    cfg.sampling.max_new_tokens = 8
    trainer = Trainer(cfg, log=lambda *_: None)
    method = trainer.method
    seen: list[tuple] = []
    original = trainer._optimise

    def spy(batch, advantages, *rest):
        seen.append((batch, advantages.clone(), copy.deepcopy(method.state_dict())))
        return original(batch, advantages, *rest)

    trainer._optimise = spy
    for step in (1, 2, 3):
        before = copy.deepcopy(method.state_dict())
        trainer.step = step
        trainer.train_step(step)
        batch, advantages, at_optimise = seen[-1]
        # The head state at credit time is the state before this step's update ...
        assert all(
            torch.equal(a, b) for a, b in zip(before["head"].values(), at_optimise["head"].values())
        )
        # ... and the credit equals the credit of a fresh head with that state.
        fresh = type(method)(cfg.credit, method.context)
        fresh.load_state_dict(before)
        assert torch.allclose(fresh.compute(batch).advantages, advantages, atol=1e-6)
        # The head did learn from the batch afterwards, so credit before != credit after.
        assert not torch.allclose(method.compute(batch).advantages, advantages, atol=1e-6)


def test_td_lambda_loss_uses_the_ema_target_and_lambda_as_written_by_hand(init_dir, tmp_path):
    cfg = _config(init_dir, tmp_path / "run", credit_method="value_head", steps=1)
    cfg.credit.value_head.td_lambda = 0.5
    cfg.credit.value_head.ema = 0.9
    cfg.credit.segmenter = "tokens:2"  # several boundaries per trace: TD targets differ from R
    cfg.sampling.max_new_tokens = 8
    trainer = Trainer(cfg, log=lambda *_: None)
    method = trainer.method
    torch.manual_seed(3)
    batch, _ = trainer.rollout(trainer.prompts_for_step(1))
    batch = batch.replace(rewards=(torch.arange(batch.size) % 2).float())  # both outcomes present
    # Move the head away from its EMA target so that using the wrong network shows.
    credit_reference.learn(method, batch)
    credit_reference.learn(method, batch)
    head_params = [p.detach().clone() for p in method.head.parameters()]
    target_params = [p.detach().clone() for p in method.target.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(head_params, target_params))

    feats, mask, _ = method.boundary_features(batch)
    live = (batch.response_mask.sum(-1) > 0).to(feats.device)  # what the head trains on
    feats, mask, rewards = feats[live], mask[live], batch.rewards.to(feats.device)[live].float()
    entry = {"features": feats, "mask": mask, "rewards": rewards}
    with torch.no_grad():
        logits = method.head(feats)
        vbar = torch.sigmoid(method.target(feats))
    lam = 0.5
    total, count = 0.0, 0
    for row in range(feats.shape[0]):
        n = int(mask[row].sum()) - 1
        for k in range(n):  # G_k = (1-lam) sum_{m>=1} lam^(m-1) V̄(s_{k+m}) + lam^(n-k-1) R
            g = sum((1 - lam) * lam ** (m - 1) * float(vbar[row, k + m]) for m in range(1, n - k))
            g += lam ** (n - k - 1) * float(rewards[row])
            total += float(
                F.binary_cross_entropy_with_logits(logits[row, k], torch.tensor(g), reduction="sum")
            )
            count += 1
    assert count > feats.shape[0]  # boundaries before s_n, not just one per trace
    with torch.no_grad():
        assert math.isclose(float(method.fit.loss(entry)), total / count, rel_tol=1e-5)

    # One update step moves the target by EMA: target' = 0.9 target + 0.1 head'.
    method.options.replay = 0
    method.options.epochs = 1
    method.replay.clear()
    credit_reference.learn(method, batch)
    for t_old, p_new, t_new in zip(
        target_params, method.head.parameters(), method.target.parameters()
    ):
        assert torch.allclose(t_new, 0.9 * t_old + 0.1 * p_new.detach(), atol=1e-6)


def test_old_logprobs_score_the_tempered_distribution(init_dir, tmp_path):
    cfg = _config(init_dir, tmp_path / "run", steps=1)
    cfg.sampling.temperature = 0.5
    trainer = Trainer(cfg, log=lambda *_: None)
    torch.manual_seed(0)
    batch, _ = trainer.rollout(trainer.prompts_for_step(1))
    P = batch.prompt_len
    with torch.no_grad():
        logits = trainer.policy(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).logits
    # Left padding shifts positions; rows of the first prompt group all have the same prompt,
    # so compare the first row, whose prompt is the longest or padded consistently.
    tempered = F.log_softmax(logits[:, P - 1 : -1].float() / 0.5, dim=-1)
    expected = tempered.gather(-1, batch.input_ids[:, P:].unsqueeze(-1)).squeeze(-1)
    mask = batch.response_mask.bool()
    unpadded = batch.attention_mask.all(dim=1)  # rows without left padding: positions agree
    assert unpadded.any()
    rows = unpadded.nonzero().flatten()
    assert torch.allclose(
        batch.old_logprobs[rows][mask[rows]], expected[rows][mask[rows]], atol=1e-5
    )
    plain = F.log_softmax(logits[:, P - 1 : -1].float(), dim=-1)
    plain = plain.gather(-1, batch.input_ids[:, P:].unsqueeze(-1)).squeeze(-1)
    assert not torch.allclose(batch.old_logprobs[rows][mask[rows]], plain[rows][mask[rows]])


def test_dropout_is_off_in_both_passes_so_the_on_policy_ratio_is_one(tmp_path, char_tokenizer):
    from rredcot.models import build_tiny_llama

    model = build_tiny_llama(char_tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    model.config.attention_dropout = 0.5
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    init = tmp_path / "init"
    model.save_pretrained(init)
    char_tokenizer.save_pretrained(init)
    cfg = _config(init, tmp_path / "run", steps=2)
    Trainer(cfg, log=lambda *_: None).train()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in records[1:]:
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert r["clip_fraction"] == 0.0


def test_with_several_epochs_the_clip_acts_and_kl_does_not_count_as_clipping(init_dir, tmp_path):
    cfg = _config(init_dir, tmp_path / "run", steps=2, epochs_per_batch=4, minibatches=2)
    cfg.kl_coef = 0.5
    Trainer(cfg, log=lambda *_: None).train()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    clipped = [r["clip_fraction"] for r in records[1:]]
    assert all(0.0 < c < 0.9 for c in clipped), clipped


def test_on_policy_kl_run_reports_no_clipping(init_dir, tmp_path):
    cfg = _config(init_dir, tmp_path / "run", steps=2)
    cfg.kl_coef = 0.5
    Trainer(cfg, log=lambda *_: None).train()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["clip_fraction"] for r in records[1:]] == [0.0, 0.0]


class _EveryThirdBroken(ArithmeticTask):
    """Reward 1 for even-length completions, NaN for every third call (a broken reward)."""

    calls = 0

    def verify(self, problem, completion):
        type(self).calls += 1
        if type(self).calls % 3 == 0:
            return Verdict(float("nan"), None, None, "broken")
        return Verdict(float(len(completion) % 2 == 0), None, None, "parity")


def test_skipped_samples_do_not_enter_the_group_mean_and_std(tiny_policy, char_tokenizer):
    from rredcot.sampling.rollout import build_rollout_batch
    from rredcot.segment import get_segmenter

    task = _EveryThirdBroken(num_steps=2)
    _EveryThirdBroken.calls = 0
    torch.manual_seed(0)
    problems = task.train_problems(3, seed=0)
    batch, stats = build_rollout_batch(
        tiny_policy,
        char_tokenizer,
        task,
        problems,
        get_segmenter("newline"),
        num_generations=6,
        max_new_tokens=8,
    )
    assert stats["rollout/skipped_samples"] == 6  # every third of 18 samples
    assert batch.size == 12 and len(batch.verdicts) == 12
    assert all(math.isfinite(v.reward) for v in batch.verdicts)
    mean, _ = normalization.group_mean_std(batch.rewards, batch.group_ids)
    for g in batch.group_ids.unique():
        rows = batch.group_ids == g
        assert torch.allclose(mean[rows], batch.rewards[rows].mean())


def test_sampling_ignores_the_model_generation_config_unless_asked(tiny_policy, char_tokenizer):
    from rredcot.sampling.rollout import sample

    prompts = ["1+2=?\n", "3*4=?\n"]

    def draw(**kw):
        torch.manual_seed(0)
        ids, _, _, _ = sample(
            tiny_policy, char_tokenizer, prompts, num_generations=4, max_new_tokens=12, **kw
        )
        return ids

    plain = draw()
    tiny_policy.generation_config.repetition_penalty = 50.0
    tiny_policy.generation_config.top_k = 1
    assert torch.equal(draw(), plain)
    assert tiny_policy.generation_config.top_k == 1  # restored after sampling
    assert not torch.equal(draw(use_model_generation_config=True), plain)


@pytest.mark.parametrize("method", ["uniform", "value_head"])
def test_single_forward_step_equals_the_two_pass_step(init_dir, tmp_path, method):
    """On-policy, the loss forward alone gives the loss and gradients of scoring pass + loss."""
    grads, records = {}, {}
    for single in (True, False):
        cfg = _config(init_dir, tmp_path / f"run{single}", credit_method=method, steps=1)
        cfg.single_forward = single
        cfg.credit.handover.mode = "off"
        cfg.credit.lam = 0.5
        cfg.credit.segmenter = "tokens:2"
        cfg.sampling.max_new_tokens = 8
        trainer = Trainer(cfg, log=lambda *_: None)
        assert trainer.single_pass() is single
        records[single], grads[single] = train_step_with_grads(trainer)
    assert records[True]["forward/scoring_pass"] == 0.0
    assert records[False]["forward/scoring_pass"] == 1.0
    assert records[True]["policy_loss"] == pytest.approx(records[False]["policy_loss"], abs=1e-6)
    assert records[True]["advantage_abs_mean"] == pytest.approx(
        records[False]["advantage_abs_mean"], abs=1e-6
    )
    for a, b in zip(grads[True], grads[False]):
        assert torch.allclose(a, b, atol=1e-6)
    assert any(g.abs().max() > 0 for g in grads[True])


def test_entropy_segmentation_runs_inside_training_from_the_loss_forward(init_dir, tmp_path):
    for single in (True, False):
        cfg = _config(init_dir, tmp_path / f"run{single}", steps=1)
        cfg.single_forward = single
        cfg.credit.segmenter = "entropy:top=0.3,min=1"
        cfg.sampling.max_new_tokens = 8
        trainer = Trainer(cfg, log=lambda *_: None)
        batch, _ = trainer.rollout(trainer.prompts_for_step(1))  # scoring pass: segmented
        assert max(len(b) - 1 for b in batch.boundaries) > 1
        record = trainer.train_step(1)
        assert record["rollout/mean_segments"] > 1.0  # cut at entropy peaks inside the step
        assert math.isfinite(record["policy_loss"])


@pytest.mark.parametrize("single", [True, False], ids=["single_forward", "epochs_minibatches"])
def test_rows_with_zero_advantage_are_left_out_of_the_loss_forward_with_the_same_update(
    init_dir, tmp_path, single
):
    """Rows whose advantages are all zero add nothing to the loss or its gradient: leaving them
    out of the forward gives the same loss and gradients (float rounding apart)."""
    grads, records = {}, {}
    for skip in (True, False):
        cfg = _config(init_dir, tmp_path / f"run{skip}", steps=1, seed=3)
        cfg.sampling.num_generations = 2  # small groups: some of them agree
        cfg.skip_zero_advantage_rows = skip
        if not single:
            cfg.epochs_per_batch, cfg.minibatches = 2, 2
        trainer = Trainer(cfg, log=lambda *_: None)
        assert trainer.single_pass() is single
        records[skip], grads[skip] = train_step_with_grads(trainer)
    assert records[False]["zero_variance_groups"] > 0  # the batch has rows to leave out
    assert records[True]["update/rows_forwarded"] < 1.0
    assert records[False]["update/rows_forwarded"] == 1.0
    assert records[True]["policy_loss"] == pytest.approx(records[False]["policy_loss"], abs=1e-6)
    for a, b in zip(grads[True], grads[False]):
        assert torch.allclose(a, b, atol=1e-6)
    assert any(g.abs().max() > 0 for g in grads[True])


def test_a_batch_with_no_gradient_still_takes_the_optimiser_step(init_dir, tmp_path):
    """Every group agreeing (zero advantages everywhere): no row is forwarded, the gradients are
    zeros rather than missing, so AdamW's momentum and weight decay move the weights exactly as
    with the full forward."""
    weights = {}
    for skip in (True, False):
        cfg = _config(init_dir, tmp_path / f"run{skip}", steps=2, seed=3)
        cfg.skip_zero_advantage_rows = skip
        cfg.threads = 1  # the same rounding in both runs (threads=0 follows the machine's load)
        trainer = Trainer(cfg, log=lambda *_: None)
        trainer.step = 1
        trainer.train_step(1)  # a step with a gradient, so that AdamW has momentum
        zero = trainer.method.credit_output

        def no_credit(*args, credit_output=zero):
            out = credit_output(*args)
            return dataclasses.replace(out, advantages=torch.zeros_like(out.advantages))

        trainer.method.credit_output = no_credit
        before = [p.detach().clone() for p in trainer.policy.parameters()]
        record, grads = train_step_with_grads(trainer, step=2)
        assert all(g is not None and not g.any() for g in grads)
        assert record["update/rows_forwarded"] == (0.0 if skip else 1.0)
        weights[skip] = [p.detach().clone() for p in trainer.policy.parameters()]
        assert not all(torch.equal(a, b) for a, b in zip(before, weights[skip]))  # momentum moved
    for a, b in zip(weights[True], weights[False]):
        assert torch.allclose(a, b, atol=1e-7)


def _credit_ending_early(trainer) -> None:
    """Hand-built credit: row i credited (alternating signs) on its first 2 + 2i response
    tokens, every third row (i % 3 == 1) on none."""
    credit_output = trainer.method.credit_output

    def ends_early(*args):
        out = credit_output(*args)
        mask = args[-1].to(out.advantages.dtype)
        B, T = mask.shape
        column = torch.arange(T, dtype=mask.dtype)
        ends = torch.tensor([0 if i % 3 == 1 else 2 + 2 * i for i in range(B)])
        sign = torch.tensor([(-1.0) ** i for i in range(B)])
        adv = sign[:, None] * (1 + 0.1 * column) * (column < ends[:, None]) * mask
        return dataclasses.replace(out, advantages=adv.to(out.advantages.dtype))

    trainer.method.credit_output = ends_early


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean", "dr_grpo"])
@pytest.mark.parametrize("layout", ["one_forward", "micro_batches", "epochs_minibatches"])
def test_rows_cut_after_their_last_credited_token_give_the_full_update(
    init_dir, tmp_path, loss_agg, layout
):
    """Tokens after a row's last non-zero advantage add nothing to the loss or its gradient:
    cutting them from the loss forward (and the rows with none) gives the full update's
    gradient, with each aggregation's normaliser of the whole rows."""
    from helpers import micro_config

    grads, records = {}, {}
    for skip in (True, False):
        cfg = micro_config(init_dir, tmp_path / f"run{skip}", steps=1, loss_agg=loss_agg)
        cfg.skip_zero_advantage_rows = skip
        cfg.max_grad_norm = 0.0
        if layout == "micro_batches":
            cfg.micro_batch_tokens = 64
        if layout == "epochs_minibatches":
            cfg.epochs_per_batch, cfg.minibatches = 2, 2
        trainer = Trainer(cfg, log=lambda *_: None)
        _credit_ending_early(trainer)
        records[skip], grads[skip] = train_step_with_grads(trainer)
        trainer.release()
    assert records[True]["update/tokens_forwarded"] < records[True]["update/rows_forwarded"] < 1
    assert records[False]["update/tokens_forwarded"] == 1.0
    assert records[True]["policy_loss"] == pytest.approx(records[False]["policy_loss"], abs=1e-6)
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(g.abs().max() > 0 for g in grads[True])


def test_a_tail_floor_cuts_rows_at_their_last_large_advantage(init_dir, tmp_path):
    """Credit with small non-zero tails (as value credit after a wrong trace's error): with
    advantage_tail_floor the update is that of the credit with its tails zeroed, and forwards
    fewer tokens than the exact update (floor 0), which forwards every credited row whole."""
    from helpers import micro_config

    def with_tails(trainer, tail: float) -> None:
        _credit_ending_early(trainer)
        ends_early = trainer.method.credit_output

        def tails(*args):
            out = ends_early(*args)
            mask = args[-1].to(out.advantages.dtype)
            small = tail * (out.advantages == 0) * mask
            return dataclasses.replace(out, advantages=out.advantages + small)

        trainer.method.credit_output = tails

    grads, records = {}, {}
    for name, tail, floor in (("floored", 1e-4, 0.01), ("exact", 1e-4, 0.0), ("zero", 0.0, 0.0)):
        cfg = micro_config(init_dir, tmp_path / name, steps=1, max_grad_norm=0.0)
        cfg.advantage_tail_floor = floor
        trainer = Trainer(cfg, log=lambda *_: None)
        with_tails(trainer, tail)
        records[name], grads[name] = train_step_with_grads(trainer)
        trainer.release()
    assert records["exact"]["update/tokens_forwarded"] == 1.0  # tails keep every row whole
    cut = records["floored"]["update/tokens_forwarded"]
    assert cut == records["zero"]["update/tokens_forwarded"] < 1.0
    for a, b in zip(grads["floored"], grads["zero"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(
        not torch.allclose(a, b, rtol=1e-5, atol=1e-9)
        for a, b in zip(grads["exact"], grads["zero"])
    )


def test_with_a_kl_term_no_row_is_cut(init_dir, tmp_path):
    """The KL term reads every token: nothing is cut or left out."""
    from helpers import micro_config

    cfg = micro_config(init_dir, tmp_path / "run", steps=1, kl_coef=0.05)
    trainer = Trainer(cfg, log=lambda *_: None)
    _credit_ending_early(trainer)
    record, _ = train_step_with_grads(trainer)
    trainer.release()
    assert record["update/rows_forwarded"] == 1.0
    assert record["update/tokens_forwarded"] == 1.0


def test_a_step_bills_the_rows_and_tokens_it_trains_on(init_dir, tmp_path):
    """compute/step: every sampled token once (no scoring pass: uniform credit, one pass), and
    3 for each real token forwarded with grad: row i's prompt and its first 2 + 2i response
    tokens (one row per micro-batch), nothing for the rows with no credit."""
    from helpers import micro_config

    cfg = micro_config(init_dir, tmp_path / "run", steps=1, micro_batch_tokens=1)
    trainer = Trainer(cfg, log=lambda *_: None)
    _credit_ending_early(trainer)
    seen = []
    with_references = trainer._with_references

    def keep(batch, *rest):
        seen.append(with_references(batch, *rest))
        return seen[-1]

    trainer._with_references = keep
    record, _ = train_step_with_grads(trainer)
    trainer.release()
    batch = seen[0]
    P, lengths = batch.prompt_len, batch.response_mask.sum(1)
    trained = sum(
        float(batch.attention_mask[i, :P].sum()) + min(2 + 2 * i, int(lengths[i]))
        for i in range(batch.size)
        if i % 3 != 1
    )
    assert record["forward/scoring_pass"] == 0.0
    assert record["compute/step"] == pytest.approx(float(batch.attention_mask.sum()) + 3 * trained)


def test_agreeing_rows_drawn_to_a_budget_are_reweighted_or_skipped(init_dir, tmp_path):
    """agreeing_update_fraction < 1: each agreeing group's credited row reaches the update
    either scaled by 1 / (its keep probability) or not at all (left out of the forward); the
    others as they were. The step records the share kept and forwards fewer tokens."""
    from helpers import micro_config
    from rredcot.training.row_policies import agreeing_rows, sample_rows_to_budget

    seen, records = {}, {}
    for fraction in (1.0, 0.4):
        cfg = micro_config(init_dir, tmp_path / f"run{fraction}", steps=1, max_grad_norm=0.0)
        cfg.agreeing_update_fraction = fraction
        trainer = Trainer(cfg, log=lambda *_: None)
        _credit_ending_early(trainer)
        optimise = trainer._optimise

        def spy(batch, advantages, *rest, _f=fraction, _o=optimise):
            seen[_f] = (batch, advantages.clone())
            return _o(batch, advantages, *rest)

        trainer._optimise = spy
        records[fraction], _ = train_step_with_grads(trainer)
        trainer.release()
    batch, full = seen[1.0]
    _, drawn = seen[0.4]
    eligible = agreeing_rows(batch.rewards, batch.group_ids)
    assert eligible.any()
    _, keep = sample_rows_to_budget(full, batch.response_mask, eligible, 0.4)
    for row in range(batch.size):
        if not drawn[row].any():
            assert eligible[row] or not full[row].any()
        else:
            torch.testing.assert_close(drawn[row], full[row] / keep[row].float())
    kept = records[0.4]["update/agreeing_rows_kept"]
    assert 0 < kept < 1 and "update/agreeing_rows_kept" not in records[1.0]
    assert records[0.4]["update/tokens_forwarded"] < records[1.0]["update/tokens_forwarded"]

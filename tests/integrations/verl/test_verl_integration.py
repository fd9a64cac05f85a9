"""rredcot as a verl advantage estimator, checked against verl's own DataProto and core_algos."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo import core_algos

import credit_reference
import rredcot.integrations.verl as rv
from helpers import ROOT
from prm_scores import REWARDS as SCORES
from prm_scores import TEXTS
from rredcot.algebra import credit, normalization
from rredcot.config import CreditConfig
from rredcot.integrations.verl import estimator, state
from rredcot.training import row_policies

pytestmark = pytest.mark.verl

UIDS = np.array(["p0", "p0", "p0", "p1", "p1", "p1"], dtype=object)


def make_data(tokenizer, with_values: bool = True, seed: int = 0) -> DataProto:
    """A verl batch: right-padded responses ending in EOS, the score on the last token."""
    ids = [
        tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for t in TEXTS
    ]
    T = max(len(r) for r in ids) + 3
    responses = torch.full((len(ids), T), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(ids), T, dtype=torch.long)
    rewards = torch.zeros(len(ids), T)
    for row, r in enumerate(ids):
        responses[row, : len(r)] = torch.tensor(r)
        mask[row, : len(r)] = 1
        rewards[row, len(r) - 1] = SCORES[row]
    tensors = {"responses": responses, "response_mask": mask, "token_level_rewards": rewards}
    if with_values:
        gen = torch.Generator().manual_seed(seed)
        tensors["values"] = torch.rand(len(ids), T, generator=gen) * mask
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": UIDS})


def algo_config(**rredcot_settings) -> dict:
    return {"adv_estimator": rv.ESTIMATOR, "rredcot": rredcot_settings}


def test_registered_in_verls_registry():
    assert core_algos.get_adv_estimator_fn(rv.ESTIMATOR) is rv.compute_rredcot_advantage
    assert core_algos.ADV_ESTIMATOR_REGISTRY["rredcot"] is rv.compute_rredcot_advantage


@pytest.mark.slow
def test_verl_imports_it_through_external_modules():
    """What every Ray worker does: VERL_USE_EXTERNAL_MODULES makes ``import verl`` load us."""
    code = (
        "import sys, verl\n"
        "from verl.trainer.ppo.core_algos import get_adv_estimator_fn\n"
        "fn = get_adv_estimator_fn('rredcot')\n"
        "print(fn.__module__)"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "rredcot.integrations.verl"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "rredcot.integrations.verl.estimator"


def test_uniform_matches_verls_grpo(char_tokenizer):
    data = make_data(char_tokenizer, with_values=False)
    cfg = algo_config(credit_method="uniform")
    rv.compute_advantage_for_data(data, char_tokenizer, cfg)
    expected, _ = core_algos.compute_grpo_outcome_advantage(
        data.batch["token_level_rewards"], data.batch["response_mask"], UIDS
    )
    mask = data.batch["response_mask"].bool()
    ours = data.batch["advantages"]
    # verl adds eps 1e-6 to the group std, rredcot (like TRL) 1e-4: equal to ~1e-4 relative.
    torch.testing.assert_close(ours[mask], expected[mask], rtol=5e-4, atol=1e-5)
    assert (ours[~mask] == 0).all() and ours[mask].abs().max() > 0.5
    torch.testing.assert_close(data.batch["returns"], ours)


def test_one_token_segments_reproduce_verls_gae():
    """With every token its own segment, segment GAE over the critic's values is token GAE."""
    gen = torch.Generator().manual_seed(1)
    B, T, lam = 5, 9, 0.8
    lengths = torch.tensor([9, 4, 7, 1, 6])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    values = torch.rand(B, T, generator=gen) * mask
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    segment_ids = torch.where(mask.bool(), torch.arange(T).expand(B, T), -1)

    expected_adv, expected_ret = core_algos.compute_gae_advantage_return(
        rewards, values, mask, gamma=1.0, lam=lam
    )
    cfg = algo_config(
        lam=lam,
        normalization="whiten",
        anchor="none",
        value_head=dict(td_lambda=lam),
        handover=dict(mode="off"),  # the critic's own credit from the first step
    )
    adv, ret = rv.compute_rredcot_advantage(
        rewards, mask, index=np.arange(B), config=cfg, segment_ids=segment_ids, values=values
    )
    m = mask.bool()
    torch.testing.assert_close(adv[m], expected_adv[m], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ret[m], expected_ret[m], rtol=1e-5, atol=1e-6)


def test_critic_credit_is_per_segment(char_tokenizer):
    data = make_data(char_tokenizer)
    off = {"mode": "off"}  # the critic's credit at full weight (no hand-over from GRPO)
    raw = {"rredcot": {"normalization": "none", "anchor": "none", "handover": off}}
    rv.compute_advantage_for_data(data, char_tokenizer, raw)
    adv, ret = data.batch["advantages"], data.batch["returns"]
    values, mask = data.batch["values"], data.batch["response_mask"].bool()

    lam = CreditConfig().lam  # the default
    for row, text in enumerate(TEXTS):
        lines = text.split("\n")
        # newline segments; the answer line merges into the last step (separate_answer=False)
        seg_lens = [len(x) + 1 for x in lines[:-2]] + [len(lines[-2]) + 1 + len(lines[-1]) + 1]
        starts = [0, *np.cumsum(seg_lens)[:-1].tolist()]
        v = [float(values[row, s]) for s in starts] + [SCORES[row]]
        r = [v[k + 1] - v[k] for k in range(len(starts))]
        a = [sum(lam ** (j - k) * r[j] for j in range(k, len(r))) for k in range(len(r))]
        for k, (s, n) in enumerate(zip(starts, seg_lens)):
            torch.testing.assert_close(adv[row, s : s + n], torch.full((n,), a[k]))
            torch.testing.assert_close(ret[row, s : s + n], torch.full((n,), SCORES[row]))
        assert (adv[row, ~mask[row]] == 0).all()
    # the default normalisation divides by each prompt group's outcome std, or by the batch's
    # where a group's outcomes agree
    data2 = make_data(char_tokenizer)
    rv.compute_advantage_for_data(
        data2, char_tokenizer, {"rredcot": {"anchor": "none", "handover": off}}
    )
    scores = torch.tensor(SCORES)
    _, inverse = np.unique(np.asarray(UIDS), return_inverse=True)
    _, group_std = normalization.group_mean_std(scores, torch.as_tensor(inverse))
    std = torch.where(group_std < 0.1, scores.std().clamp_min(0.1), group_std)
    torch.testing.assert_close(data2.batch["advantages"], adv / (std[:, None] + 1e-4))
    # by default the critic's values are anchored on the group's mean reward, like the value
    # head's: every trace gets GRPO's total credit R - mean R_group (lam = 1: on segment 1)
    data3 = make_data(char_tokenizer)
    rv.compute_advantage_for_data(
        data3, char_tokenizer, {"rredcot": {"normalization": "none", "lam": 1.0, "handover": off}}
    )
    mean, _ = normalization.group_mean_std(scores, torch.as_tensor(inverse))
    torch.testing.assert_close(data3.batch["advantages"][:, 0], scores - mean)


def _grpo_advantages(data) -> torch.Tensor:
    """GRPO's token advantages of a verl batch: ``R - mean R_group`` on every response token,
    with rredcot's default normalisation (the group's outcome std, the batch's where a group's
    outcomes agree)."""
    R = data.batch["token_level_rewards"].sum(dim=1)
    _, inverse = np.unique(np.asarray(UIDS), return_inverse=True)
    mean, group_std = normalization.group_mean_std(R, torch.as_tensor(inverse))
    std = torch.where(group_std < 0.1, R.std().clamp_min(0.1), group_std)
    return ((R - mean) / (std + 1e-4))[:, None] * data.batch["response_mask"]


def _critic_credit_before_the_handover(data, tokenizer, lam: float) -> torch.Tensor:
    """The critic's credit as the estimator computed it before it had the hand-over: its
    values at the segment starts anchored on the group mean, plus the dense rewards received
    so far, segment GAE, default normalisation."""
    batch = data.batch
    mask = batch["response_mask"]
    seg = rv.segment_responses(
        batch["responses"], mask, tokenizer, rv.make_segmenter(CreditConfig())
    )
    raw, raw_mask = rv.critic_boundary_values(
        batch["values"], rv.boundaries_from_segment_ids(seg, mask)
    )
    R = batch["token_level_rewards"].sum(dim=1)
    _, inverse = np.unique(np.asarray(UIDS), return_inverse=True)
    groups = torch.as_tensor(inverse)
    mean, _ = normalization.group_mean_std(R, groups)
    prefix = rv.dense_prefix_rewards(
        batch["token_level_rewards"], seg, rv.num_segments_of(seg, mask)
    )  # no holes: the segment ids are their filled ids
    anchored = credit.anchor_values(raw, raw_mask, mean) + prefix[:, : raw.shape[1]]
    estimate = credit.Values(anchored, raw_mask, lam=lam)
    return credit_reference.token_credit(
        estimate, R, groups, seg, mask.float(), "group_or_batch_std"
    ).advantages


def test_critic_hands_over_from_grpo(char_tokenizer, monkeypatch):
    """The critic goes through the hand-over of every rredcot value source: GRPO's credit on the
    first step, the critic's as it earns trust on later steps' outcomes; with the hand-over off,
    the critic's anchored credit at full weight, as before. Its returns never change."""
    monkeypatch.setattr(state, "_METHODS", {})
    lam = 0.5
    # hand-over off: today's critic credit (anchored values, weight 1), bit for bit
    off = {"rredcot": {"lam": lam, "handover": {"mode": "off"}}}
    data_off = make_data(char_tokenizer)
    rv.compute_advantage_for_data(data_off, char_tokenizer, off)
    expected = _critic_credit_before_the_handover(data_off, char_tokenizer, lam)
    assert torch.equal(data_off.batch["advantages"], expected)
    assert not torch.allclose(expected, _grpo_advantages(data_off), atol=1e-3)
    dense = make_data(char_tokenizer)  # a step reward and a KL penalty inside the traces
    dense.batch["token_level_rewards"][0, 2] += 0.5
    dense.batch["token_level_rewards"][3] -= 0.01 * dense.batch["response_mask"][3]
    rv.compute_advantage_for_data(dense, char_tokenizer, off)
    torch.testing.assert_close(
        dense.batch["advantages"], _critic_credit_before_the_handover(dense, char_tokenizer, lam)
    )

    # the default (reliability): the first step is GRPO's, then one update of the reliability
    on = {"rredcot": {"lam": lam}}
    data = make_data(char_tokenizer)
    rv.compute_advantage_for_data(data, char_tokenizer, on)
    torch.testing.assert_close(data.batch["advantages"], _grpo_advantages(data))
    torch.testing.assert_close(data.batch["returns"], data_off.batch["returns"], rtol=0, atol=0)
    method = state.method_for("critic", rv.credit_settings(on)[1], on)
    assert isinstance(method, rv.CriticCredit) and method.guard.num_updates == 1
    with pytest.raises(ValueError, match="verl's critic"):
        method.boundary_values(None)

    # a critic whose values predict the outcomes earns trust: the weight rises above 0 and the
    # credit departs from GRPO towards the critic's, A = A_grpo + w (A_critic - A_grpo)
    state._METHODS.clear()
    scores = torch.tensor(SCORES)
    mask = make_data(char_tokenizer).batch["response_mask"]
    predictive = (0.1 + 0.8 * scores)[:, None].expand_as(mask).clone()
    predictive[:, 0] = 0.5  # V(s_0): what it thinks of the prompt (the anchor replaces it)
    predictive = predictive * mask
    weights = []
    for step in range(4):
        data = make_data(char_tokenizer)
        data.batch["values"] = predictive.clone()
        method = state.method_for("critic", rv.credit_settings(on)[1], on)
        w = method.guard.weight
        weights.append(w)
        rv.compute_advantage_for_data(data, char_tokenizer, on)
        assert method.guard.num_updates == step + 1
        grpo = _grpo_advantages(data)
        own = _critic_credit_before_the_handover(data, char_tokenizer, lam)
        torch.testing.assert_close(data.batch["advantages"], grpo + w * (own - grpo))
    assert weights[0] == 0.0 and all(b > a for a, b in zip(weights[:-1], weights[1:]))
    # slope >= 1 clips to 1 each step: the EMA (decay 0.9) gives 1 - 0.9^k
    assert weights[-1] == pytest.approx(1 - 0.9**3)
    assert not torch.allclose(data.batch["advantages"], grpo, atol=1e-3)


def test_what_the_estimator_keeps_between_calls(char_tokenizer, monkeypatch):
    """What the module doc says it keeps: one method per settings across calls (its guard's
    updates accumulate), nothing after reset_methods(), and the segments only inside
    rredcot_segments."""
    monkeypatch.setattr(state, "_METHODS", {})
    on = {"rredcot": {"lam": 0.5}}
    for _ in range(2):
        rv.compute_advantage_for_data(make_data(char_tokenizer), char_tokenizer, on)
    (method,) = state._METHODS.values()
    assert method.guard.num_updates == 2
    rv.reset_methods()
    assert state._METHODS == {}
    rv.compute_advantage_for_data(make_data(char_tokenizer), char_tokenizer, on)
    (fresh,) = state._METHODS.values()
    assert fresh is not method and fresh.guard.num_updates == 1
    with rv.rredcot_segments(torch.zeros(2, 3, dtype=torch.long)):
        assert estimator._ACTIVE.get() is not None
    assert estimator._ACTIVE.get() is None


def test_segments_survive_verls_batch_ops(char_tokenizer):
    """Segment ids computed on a DataProto stay aligned through verl's select/concat."""
    data = make_data(char_tokenizer)
    _, cfg = rv.credit_settings(None)
    seg = rv.segment_responses(
        data.batch["responses"], data.batch["response_mask"], char_tokenizer, rv.make_segmenter(cfg)
    )
    data.batch["rredcot_segment_ids"] = seg
    part = DataProto.concat([data.select_idxs([3, 4]), data.select_idxs([0])])
    torch.testing.assert_close(part.batch["rredcot_segment_ids"], seg[[3, 4, 0]])
    bounds = rv.boundaries_from_segment_ids(seg, data.batch["response_mask"])
    assert bounds[0] == [0, 6, 18]  # "2+3=5\n" | "5*4=20\nA:20" + EOS (answer merged)
    assert bounds[2] == [0, 10]  # "2+3=5\nA:5" + EOS: the answer joins the only step
    assert credit.boundaries_to_segment_ids(bounds, seg.shape[1]).equal(seg)


def test_errors_name_the_fix(char_tokenizer):
    data = make_data(char_tokenizer)
    kwargs = dict(
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=data.batch["response_mask"],
        index=UIDS,
    )
    with pytest.raises(ValueError, match="rredcot_sync"):
        rv.compute_rredcot_advantage(**kwargs, config=algo_config())
    with (
        pytest.raises(ValueError, match="critic.enable=True"),
        rv.rredcot_segments(torch.zeros_like(data.batch["responses"])),
    ):
        rv.compute_rredcot_advantage(**kwargs, config=algo_config())
    with pytest.raises(ValueError, match="valid in verl: critic, uniform"):
        rv.credit_settings(algo_config(credit_method="value_head"))
    with pytest.raises(ValueError, match="valid keys"):
        rv.credit_settings(algo_config(lamda=0.5))
    assert estimator._ACTIVE.get() is None  # the context never leaks past its block


def test_example_config_composes_with_verls_own():
    """examples/verl/rredcot_gsm8k.yaml on top of verl's ppo_trainer config, as main_ppo reads it."""
    from hydra import compose, initialize_config_dir

    here = ROOT / "examples" / "verl"
    with initialize_config_dir(config_dir=str(here), version_base=None):
        cfg = compose("rredcot_gsm8k", overrides=["+algorithm.rredcot.min_chars=8"])
    assert cfg.algorithm.adv_estimator == rv.ESTIMATOR
    assert cfg.trainer.v1.trainer_mode == rv.TRAINER_MODE and cfg.critic.enable
    method, credit_cfg = rv.credit_settings(cfg.algorithm)
    assert method == "critic" and credit_cfg.min_chars == 8 and credit_cfg.lam == 0.5
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 64  # verl's defaults merged under
    assert "ppo_epochs" in cfg.actor_rollout_ref.actor
    with initialize_config_dir(config_dir=str(here), version_base=None):
        cfg = compose("rredcot_gsm8k", overrides=["+algorithm.rredcot.handover.mode=off"])
    assert rv.credit_settings(cfg.algorithm)[1].handover.mode == "off"  # the critic at weight 1
    assert CreditConfig().handover.mode == "reliability"  # the default: handed over from GRPO


def test_multi_turn_mask_with_holes(char_tokenizer):
    """A tool output in the middle of a response (mask 0) is part of the text and of the states,
    gets no advantage, and does not break the segments."""
    data = make_data(char_tokenizer, with_values=True)
    mask = data.batch["response_mask"].clone()
    mask[1, 3:7] = 0  # row 1: a 4-token tool output inside its first lines
    mask[4, 0:2] = 0  # row 4: starts with masked tokens
    data.batch["response_mask"] = mask
    segment_ids = rv.segment_responses(
        data.batch["responses"], mask, char_tokenizer, rv.make_segmenter(CreditConfig())
    )
    full = rv.segment_responses(
        data.batch["responses"],
        make_data(char_tokenizer).batch["response_mask"],
        char_tokenizer,
        rv.make_segmenter(CreditConfig()),
    )
    keep = mask.bool()
    assert torch.equal(segment_ids, full)  # the same cuts as the whole text, holes included
    off = {"normalization": "none", "handover": {"mode": "off"}}  # the critic's own credit
    rv.compute_advantage_for_data(data, char_tokenizer, {"rredcot": off})
    adv = data.batch["advantages"]
    assert torch.isfinite(adv).all() and (adv[~keep] == 0).all()
    bounds = rv.boundaries_from_segment_ids(segment_ids, mask)
    assert (
        bounds[1]
        == rv.boundaries_from_segment_ids(full, make_data(char_tokenizer).batch["response_mask"])[1]
    )
    for row, b in enumerate(bounds):
        for s, e in zip(b[:-1], b[1:]):
            seg = adv[row, s:e][keep[row, s:e]]
            if seg.numel():
                assert torch.allclose(seg, seg[0].expand_as(seg))


def test_dense_rewards_stay_in_their_segments(char_tokenizer):
    """A process reward and a per-token KL penalty inside the trace are credited to the segments
    they fall in (reward-to-go), not summed into one outcome."""
    data = make_data(char_tokenizer, with_values=False)
    rewards = data.batch["token_level_rewards"].clone()
    rewards[0, 2] = 0.5  # row 0: a step reward inside its first line "2+3=5\n"
    rewards[3, :] -= 0.01 * data.batch["response_mask"][3]  # row 3: KL penalty on every token
    data.batch["token_level_rewards"] = rewards
    cfg = {"rredcot": {"credit_method": "uniform", "normalization": "none"}}
    rv.compute_advantage_for_data(data, char_tokenizer, cfg)
    adv = data.batch["advantages"]
    R = rewards.sum(dim=1)
    _, inverse = np.unique(np.asarray(UIDS), return_inverse=True)
    mean, _ = normalization.group_mean_std(R, torch.as_tensor(inverse))
    seg = rv.segment_responses(
        data.batch["responses"],
        data.batch["response_mask"],
        char_tokenizer,
        rv.make_segmenter(CreditConfig()),
    )
    for row in (0, 3):
        bounds = rv.boundaries_from_segment_ids(
            seg[row : row + 1], data.batch["response_mask"][row : row + 1]
        )[0]
        last = int(data.batch["response_mask"][row].sum()) - 1
        dense = rewards[row].clone()
        dense[last] = 0
        received = 0.0
        for s, e in zip(bounds[:-1], bounds[1:]):
            # lam = 1 (uniform): A_k = R - mean - dense rewards of the segments before k
            expected = float(R[row] - mean[row]) - received
            torch.testing.assert_close(adv[row, s:e], torch.full((e - s,), expected))
            received += float(dense[s:e].sum())
    # rows without dense rewards are GRPO's
    torch.testing.assert_close(adv[1, 0], R[1] - mean[1])


def _probe_source(char_tokenizer):
    """A verl batch with prompts (as rollouts have) and reference answers."""
    data = make_data(char_tokenizer, with_values=False)
    prompts_text = ["Compute 2+3*4.\n"] * 3 + ["Compute 7-1+2*2.\n"] * 3
    ids = [char_tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompts_text]
    P = max(len(x) for x in ids)
    prompts = torch.full((len(ids), P), char_tokenizer.pad_token_id, dtype=torch.long)
    pmask = torch.zeros(len(ids), P, dtype=torch.long)
    for i, x in enumerate(ids):
        prompts[i, P - len(x) :] = torch.tensor(x)
        pmask[i, P - len(x) :] = 1
    data.batch["prompts"] = prompts
    data.batch["attention_mask"] = torch.cat([pmask, data.batch["response_mask"]], dim=1)
    data.non_tensor_batch["reward_model"] = np.array(
        [{"ground_truth": a} for a in ["20", "20", "20", "16", "16", "16"]], dtype=object
    )
    return data


def test_answer_likelihood_through_actor_log_probs(char_tokenizer, tiny_policy, monkeypatch):
    """The driver builds the probes as a DataProto; an actor's log-prob pass over it (here the
    tiny policy, as verl's compute_log_prob would run it) gives the core's answer-likelihood
    values; the estimator runs them through the method's own algebra."""
    from rredcot.integrations._batch import rollout_batch_from_tensors
    from rredcot.methods.answer_likelihood import answer_values
    from rredcot.tasks import get_task
    from rredcot.tasks.base import Problem

    data = _probe_source(char_tokenizer)
    task = get_task("arithmetic", num_steps=2)
    segmenter = rv.make_segmenter(CreditConfig())
    probes = rv.build_probe_data(data, char_tokenizer, task, segmenter, divisor=4)
    assert len(probes) % 4 == 0  # same rows, so same forwards, on every one of 4 ranks
    # what the actor's compute_log_prob does: log-probs of `responses` given the prompt
    b = probes.batch
    with torch.no_grad():
        logits = tiny_policy(
            input_ids=b["input_ids"],
            attention_mask=b["attention_mask"],
            position_ids=b["position_ids"],
        ).logits.float()
    R = b["responses"].shape[1]
    logp = torch.log_softmax(logits[:, -R - 1 : -1], dim=-1)
    token_lp = logp.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    seg = rv.segment_responses(
        data.batch["responses"], data.batch["response_mask"], char_tokenizer, segmenter
    )
    n = rv.num_segments_of(seg, data.batch["response_mask"])
    values = rv.probe_values(probes, token_lp, n)

    P = data.batch["prompts"].shape[1]
    batch = rollout_batch_from_tensors(
        prompt_ids=data.batch["prompts"],
        prompt_mask=data.batch["attention_mask"][:, :P],
        completion_ids=data.batch["responses"],
        completion_mask=data.batch["response_mask"],
        rewards=torch.tensor(SCORES),
        group_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
        tokenizer=char_tokenizer,
        segmenter=segmenter,
        problems=[Problem("", a) for a in ["20", "20", "20", "16", "16", "16"]],
    )
    core, core_mask, _ = answer_values(tiny_policy, char_tokenizer, task, batch, packing="unpacked")
    probed = core_mask.clone()
    probed[torch.arange(len(n)), n] = False
    torch.testing.assert_close(values[probed], core[probed].float(), rtol=1e-4, atol=1e-7)
    assert ((values[probed] > 0) & (values[probed] < 1)).all()

    cfg = {
        "rredcot": {
            "credit_method": "answer_likelihood",
            "task": "arithmetic",
            "task_args": {"num_steps": 2},
            "lam": 0.5,
            "normalization": "none",
        }
    }
    monkeypatch.setattr(state, "_METHODS", {})
    rv.compute_advantage_for_data(data, char_tokenizer, cfg, boundary_values=values)
    adv = data.batch["advantages"].clone()
    assert torch.isfinite(adv).all() and adv.abs().max() > 0
    # the hand-over, as in the core: GRPO on the first step, then learnt from its outcomes
    grpo = torch.tensor(SCORES) - torch.tensor(
        [sum(SCORES[:3]) / 3] * 3 + [sum(SCORES[3:]) / 3] * 3
    )
    mask = data.batch["response_mask"].bool()
    for row in range(6):
        assert torch.allclose(adv[row][mask[row]], grpo[row].expand(int(mask[row].sum())))
    (method,) = state._METHODS.values()
    assert method.guard.num_updates == 1
    off = {"rredcot": {**cfg["rredcot"], "handover": {"mode": "off"}}}
    rv.compute_advantage_for_data(data, char_tokenizer, off, boundary_values=values)
    assert not torch.allclose(data.batch["advantages"], adv)  # the probes' own credit
    with pytest.raises(ValueError, match="build_probe_data"):
        rv.compute_advantage_for_data(_probe_source(char_tokenizer), char_tokenizer, cfg)


def test_the_estimators_segmenter_keeps_the_named_tasks_answer_line():
    from rredcot.tasks import get_task_class

    text = "He has 8 + 5 = 13 apples.\nHe eats 2, so 13 - 2 = 11.\nThe answer is 11."
    cfg = CreditConfig(segmenter="newline", separate_answer=True, min_chars=15)
    named = rv.make_segmenter(cfg, {"rredcot": {"task": "word_problems"}})
    assert named.answer_pattern == get_task_class("word_problems").answer_line_pattern
    assert text[slice(*named.split(text)[-1])] == "The answer is 11."
    # no task named: the default answer line, which does not know "The answer is"
    plain = rv.make_segmenter(cfg, {"rredcot": {}})
    assert text[slice(*plain.split(text)[-1])] == "He eats 2, so 13 - 2 = 11.\nThe answer is 11."


def test_process_reward_scores_on_the_driver(char_tokenizer, monkeypatch):
    """process_reward in verl: compute_advantage_for_data decodes and segments the batch as the
    estimator does, the user's function scores every boundary on the driver, and the credit is
    the core method's (here by hand: lam 0, segment k gets V(s_k) - V(s_{k-1}))."""
    import prm_scores

    monkeypatch.setattr(state, "_METHODS", {})
    settings = {
        "credit_method": "process_reward",
        "process_reward": {"function": "prm_scores:chain_scores"},
        "lam": 0.0,
        "normalization": "none",
        "handover": {"mode": "off"},
    }
    data = _probe_source(char_tokenizer)
    prm_scores.CALLS.clear()
    rv.compute_advantage_for_data(data, char_tokenizer, {"rredcot": settings})
    assert [c[0] for c in prm_scores.CALLS] == ["Compute 2+3*4.\n"] * 3 + ["Compute 7-1+2*2.\n"] * 3
    assert [c[1] for c in prm_scores.CALLS] == TEXTS
    adv = data.batch["advantages"]
    seg = rv.segment_responses(
        data.batch["responses"],
        data.batch["response_mask"],
        char_tokenizer,
        rv.make_segmenter(CreditConfig()),
    )
    g0, g1 = 1 / 3, 2 / 3
    for row, want in enumerate(prm_scores.CHAIN_CREDIT):
        got = [float(adv[row][seg[row] == k][0]) for k in range(len(want))]
        assert got == pytest.approx(want, abs=1e-6), row
        assert (adv[row][seg[row] < 0] == 0).all()

    # the hand-over: GRPO on the first step, then the measured slope (update after the credit)
    reliable = {**settings, "handover": {"mode": "reliability"}, "lam": 1.0}
    state._METHODS.clear()  # the driver keeps one method per settings, across steps
    data = _probe_source(char_tokenizer)
    data.non_tensor_batch["raw_prompt"] = np.array(
        [[{"role": "user", "content": f"q{i}"}] for i in range(6)], dtype=object
    )
    prm_scores.CALLS.clear()
    rv.compute_advantage_for_data(data, char_tokenizer, {"rredcot": reliable})
    assert [c[0] for c in prm_scores.CALLS] == [f"q{i}" for i in range(6)]  # verl's raw chat
    grpo = torch.tensor(SCORES) - torch.tensor([g0] * 3 + [g1] * 3)
    mask = data.batch["response_mask"].bool()
    for row in range(6):
        assert torch.allclose(
            data.batch["advantages"][row][mask[row]], grpo[row].expand(int(mask[row].sum()))
        )
    (method,) = state._METHODS.values()
    assert method.guard.num_updates == 1 and method.guard.reliability > 0
    with pytest.raises(ValueError, match="process_reward_values"):
        rv.compute_rredcot_advantage(
            token_level_rewards=data.batch["token_level_rewards"],
            response_mask=data.batch["response_mask"],
            index=UIDS,
            config={"rredcot": reliable},
            segment_ids=seg,
        )


@pytest.mark.parametrize("method", ["critic", "uniform"])
def test_advantage_tail_floor_drops_the_small_tail_as_rredcot_train(char_tokenizer, method):
    """``algorithm.rredcot.advantage_tail_floor``: the advantages are the estimator's without it
    with each row's tail after its last ``|A| >= floor`` set to 0 (rredcot train's
    ``row_policies.drop_small_tails``); the critic's returns are unchanged; a bad floor is refused."""
    off = {"mode": "off"}
    base = {"credit_method": method, "normalization": "none", "anchor": "none", "handover": off}
    full, cut = make_data(char_tokenizer), make_data(char_tokenizer)
    rv.reset_methods()
    rv.compute_advantage_for_data(full, char_tokenizer, algo_config(**base))
    adv = full.batch["advantages"]
    floor = float(adv.abs()[adv != 0].median())  # between the rows' smallest and largest credit
    rv.reset_methods()
    rv.compute_advantage_for_data(
        cut, char_tokenizer, algo_config(**base, advantage_tail_floor=floor)
    )
    mask = full.batch["response_mask"]
    expected = row_policies.drop_small_tails(adv, mask.float(), floor)
    torch.testing.assert_close(cut.batch["advantages"], expected)
    assert not torch.equal(expected, adv)  # something was dropped: not a vacuous check
    if method == "critic":
        torch.testing.assert_close(cut.batch["returns"], full.batch["returns"])
    with pytest.raises(ValueError, match="advantage_tail_floor"):
        rv.tail_floor_setting(algo_config(advantage_tail_floor=-1))

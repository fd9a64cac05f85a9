"""Issue 40's reference baselines inside TRL's GRPOTrainer (``references``): the supervised term
and LUFFY's reference row on hand-worked batches, and the settings the adapter refuses."""

from __future__ import annotations

import pytest
import torch
from trl import GRPOTrainer

from metrics_doc import undocumented
from rredcot.integrations.trl import RREDCoTGRPOConfig, RREDCoTGRPOTrainer
from rredcot.tasks import get_task
from rredcot.tasks.base import Problem
from trl_trainers import make_trainer

pytestmark = pytest.mark.trl

TASK = get_task("arithmetic", num_steps=2)


def first_prompt_correct_reward(first_prompt: str):
    """A reward of 1 for every completion of ``first_prompt`` (its group has correct samples),
    0 elsewhere (all-wrong groups)."""

    def reward(prompts, completions, **kwargs) -> list[float]:
        return [1.0 if p == first_prompt else 0.0 for p in prompts]

    return reward


class LossSpy(RREDCoTGRPOTrainer):
    """Records each training micro-batch's loss beside TRL's own loss of the same inputs, and
    each generation batch's prompts (row order as TRL generated them)."""

    def _apply_credit(self, inputs, output):
        self.generated = getattr(self, "generated", []) + [
            ([x["prompt"] for x in inputs], output["prompt_ids"], output["prompt_mask"])
        ]
        return super()._apply_credit(inputs, output)

    def _compute_loss(self, model, inputs):
        trl = GRPOTrainer._compute_loss(self, model, inputs)
        ours = super()._compute_loss(model, inputs)
        if self.model.training:
            self.losses = getattr(self, "losses", []) + [(float(trl), float(ours))]
        return ours


def hand_reference_logprobs(model, prompt_ids, prompt_mask, gold: str, tokenizer) -> torch.Tensor:
    """``log pi(y*_t | x, y*_<t)`` of the reference ``gold`` + EOS after one unpadded prompt,
    by a plain forward of the model (temperature 1)."""
    prompt = prompt_ids[prompt_mask.bool()].tolist()
    target = tokenizer(gold, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt + target])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(target)[:, None])[:, 0]


def hand_aggregate(nll_rows: list[torch.Tensor], loss_type: str, max_len: int) -> float:
    """The NLL of the reference rows aggregated as TRL's ``loss_type`` aggregates its loss."""
    if loss_type == "grpo":  # each row's token mean, averaged over rows
        return float(torch.stack([r.mean() for r in nll_rows]).mean())
    if loss_type == "dapo":  # a mean over every token
        return float(torch.cat(nll_rows).sum() / sum(len(r) for r in nll_rows))
    if loss_type == "dr_grpo":  # rows x max_completion_length
        return float(torch.cat(nll_rows).sum() / (len(nll_rows) * max_len))
    raise AssertionError(loss_type)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_sft_adds_the_failed_groups_reference_nll_to_trls_loss(
    tiny_model_dir,
    arithmetic_dataset,
    tmp_path,
    loss_type,
):
    first = arithmetic_dataset[0]["prompt"]
    sft_coef = 0.3
    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path,
        method="uniform",
        cls=LossSpy,
        reward_funcs=[first_prompt_correct_reward(first)],
        reward_weights=[1.0],
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        steps_per_generation=2,  # one generation batch of 16 rows (4 groups), 2 micro-batches
        max_steps=1,
        loss_type=loss_type,
        references={"mode": "sft", "sft_coef": sft_coef},
    )
    model = trainer.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.train()

    # by hand, with the weights the loss saw (one optimiser step, after both micro-batches)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(before)
    prompts, prompt_ids, prompt_mask = trainer.generated[0]
    answers = {row["prompt"]: row["answer"] for row in arithmetic_dataset}
    G = 4
    nll_rows, tokens, failed = [], 0, []
    for row in range(0, len(prompts), G):
        if prompts[row] == first:
            continue  # a group with correct samples gets no reference
        failed.append(prompts[row])
        gold = TASK.gold_completion(Problem(prompts[row], answers[prompts[row]]))
        lp = hand_reference_logprobs(
            model, prompt_ids[row], prompt_mask[row], gold, trainer.processing_class
        )
        nll_rows.append(-lp)
        tokens += len(lp)
    model.load_state_dict(trained)
    assert len(failed) == 3 and first in prompts
    expected = sft_coef * hand_aggregate(nll_rows, loss_type, 24)

    assert len(trainer.losses) == 2  # the two micro-batches of the generation batch
    shares = [ours - trl for trl, ours in trainer.losses]
    assert all(abs(s) > 1e-4 for s in shares)  # the rows are shared over both micro-batches
    assert sum(shares) == pytest.approx(expected, rel=1e-4, abs=1e-6)
    refs = trainer._state.references.rows
    assert [p.prompt for p in refs.problems] == failed

    logged = {k: v for h in trainer.state.log_history for k, v in h.items()}
    assert logged["rredcot/references/tokens"] == tokens
    assert logged["rredcot/reference_tokens_trained"] == tokens
    assert logged["rredcot/references/groups"] == 3.0
    assert logged["rredcot/references/failed_groups"] == 3.0
    assert logged["rredcot/references/sft_nll"] == pytest.approx(expected / sft_coef, rel=1e-4)
    assert trainer.reference_tokens_trained == tokens
    ours = {k for k in logged if k.startswith("rredcot/")}
    assert undocumented(ours, prefix="rredcot/") == []  # every key is in docs/metrics.md


def test_references_off_adds_nothing_to_trls_loss(
    tiny_model_dir,
    arithmetic_dataset,
    tmp_path,
):
    trainer = make_trainer(
        tiny_model_dir, arithmetic_dataset, tmp_path, method="uniform", cls=LossSpy, max_steps=1
    )
    trainer.train()
    assert trainer.losses and all(trl == ours for trl, ours in trainer.losses)
    logged = {k for h in trainer.state.log_history for k in h}
    assert not any("reference" in k for k in logged)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"references": {"mode": "sft"}}, "references.mode='sft' needs task"),
        (
            {"task": "arithmetic", "references": {"mode": "bread"}},
            "references.mode='bread' is not supported in TRL",
        ),
        (
            {"task": "arithmetic", "references": {"mode": "sft"}, "loss_type": "luspo"},
            "does not support loss_type='luspo'",
        ),
        (
            {"task": "arithmetic", "references": {"mode": "luffy"}, "loss_type": "bnpo"},
            "does not support loss_type='bnpo'",
        ),
        (
            {"task": "arithmetic", "references": {"mode": "luffy"}, "beta": 0.04},
            "references.mode='luffy' needs beta=0",
        ),
        ({"task": "arithmetic", "references": {"mode": "sfft"}}, "references.mode='sfft'"),
        ({"task": "arithmetic", "references": {"coef": 1}}, "valid keys in references"),
        ({"task": "arithmetic", "references": '{"mode": "sft", "sft_coef": 0}'}, "sft_coef"),
    ],
)
def test_reference_settings_the_adapter_cannot_run_are_refused(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message) as err:
        RREDCoTGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **settings)
    assert "\n" not in str(err.value)


def test_a_json_references_setting_is_read(tmp_path):
    cfg = RREDCoTGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        task="arithmetic",
        references='{"mode": "sft", "groups": "all", "sft_coef": 0.5}',
    )
    refs = cfg.references_config
    assert (refs.mode, refs.groups, refs.sft_coef) == ("sft", "all", 0.5)


def test_data_without_references_is_refused_before_training(tiny_model_dir, tmp_path):
    from datasets import Dataset

    no_gold = Dataset.from_list([{"prompt": "hello there", "answer": "1"}] * 4)
    with pytest.raises(ValueError, match="needs reference solutions, but task 'arithmetic'"):
        make_trainer(tiny_model_dir, no_gold, tmp_path, references={"mode": "sft"})
    no_answers = Dataset.from_list([{"prompt": "hello there"}] * 4)
    with pytest.raises(ValueError, match="training set lacks"):
        make_trainer(
            tiny_model_dir,
            no_answers,
            tmp_path,
            references={"mode": "sft"},
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
            reward_weights=[1.0],
        )


class LuffySpy(RREDCoTGRPOTrainer):
    """Records each generation batch as the credit left it, and each training micro-batch's loss
    beside TRL's own loss of the same inputs with the reference rows masked out."""

    def _apply_credit(self, inputs, output):
        output = super()._apply_credit(inputs, output)
        self.generated = getattr(self, "generated", []) + [
            {
                "prompts": [x["prompt"] for x in inputs],
                "prompt_ids": output["prompt_ids"],
                "prompt_mask": output["prompt_mask"],
                "completion_ids": output["completion_ids"].clone(),
                "completion_mask": output["completion_mask"].clone(),
                "reference": output["rredcot_reference"].clone(),
                "advantages": output["advantages"].clone(),
                "rewards_per_func": self._state.rewards_per_func.clone(),
            }
        ]
        return output

    def _compute_loss(self, model, inputs):
        on_policy = dict(inputs)
        keep = (~inputs["rredcot_reference"]).unsqueeze(1).float()
        on_policy["tool_mask"] = inputs["completion_mask"].float() * keep
        trl = GRPOTrainer._compute_loss(self, model, on_policy)
        ours = super()._compute_loss(model, inputs)
        if self.model.training:
            self.losses = getattr(self, "losses", []) + [(float(trl), float(ours))]
        return ours


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_luffy_reference_row_takes_a_rollouts_place_with_the_shaped_ratio(
    tiny_model_dir,
    arithmetic_dataset,
    tmp_path,
    loss_type,
):
    from rredcot.integrations.trl import task_reward

    first = arithmetic_dataset[0]["prompt"]
    gamma = 0.1
    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path,
        method="uniform",
        cls=LuffySpy,
        reward_funcs=[task_reward("arithmetic", num_steps=2), first_prompt_correct_reward(first)],
        reward_weights=[1.0, 1.0],
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        steps_per_generation=2,  # one generation batch of 16 rows (4 groups), 2 micro-batches
        max_steps=1,
        loss_type=loss_type,
        references={"mode": "luffy", "shaping_gamma": gamma},
    )
    model = trainer.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.train()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(before)

    rec = trainer.generated[0]
    prompts, G = rec["prompts"], 4
    answers = {row["prompt"]: row["answer"] for row in arithmetic_dataset}
    eos = trainer.processing_class.eos_token_id
    # the untrained policy is wrong everywhere: the failed groups' rewards are [0, 0, 0, 1] once
    # the reference (verified correct) replaces their last rollout; GRPO's advantage of the
    # reference is (1 - 0.25) / (std 0.5 + 1e-4)
    a_ref = 0.75 / (0.5 + 1e-4)
    terms, tokens, refs = [], 0, []
    for row in range(0, len(prompts), G):
        last = row + G - 1
        if prompts[row] == first:
            assert not rec["reference"][row : row + G].any()  # correct samples: no reference
            continue
        refs.append(last)
        assert rec["reference"][row : row + G].tolist() == [False, False, False, True]
        assert rec["rewards_per_func"][row : row + G, 0].tolist() == [0.0, 0.0, 0.0, 1.0]
        gold = TASK.gold_completion(Problem(prompts[row], answers[prompts[row]]))
        target = trainer.processing_class(gold, add_special_tokens=False)["input_ids"] + [eos]
        n = len(target)
        assert rec["completion_ids"][last, :n].tolist() == target
        assert int(rec["completion_mask"][last].sum()) == n
        adv = rec["advantages"][last, :n]
        torch.testing.assert_close(adv, torch.full_like(adv, a_ref), rtol=1e-5, atol=1e-6)
        pi = hand_reference_logprobs(
            model, rec["prompt_ids"][row], rec["prompt_mask"][row], gold, trainer.processing_class
        ).exp()
        terms.append(-a_ref * pi / (pi + gamma))  # LUFFY: -A f(pi), f(pi) = pi / (pi + gamma)
        tokens += n
    model.load_state_dict(trained)
    assert len(refs) == 3

    B_micro, accumulation = 8, 2
    if loss_type == "grpo":  # each row's token mean over the micro-batch's rows
        expected = sum(float(t.mean()) for t in terms) / (B_micro * accumulation)
    else:  # dapo: over the generation batch's tokens, the reference's included
        expected = sum(float(t.sum()) for t in terms) / float(rec["completion_mask"].sum())
    assert len(trainer.losses) == 2
    added = sum(ours - trl for trl, ours in trainer.losses)
    assert added == pytest.approx(expected, rel=1e-4, abs=1e-7)
    logged = {k: v for h in trainer.state.log_history for k, v in h.items()}
    assert logged["rredcot/references/tokens"] == tokens
    assert logged["rredcot/references/groups"] == 3.0
    assert 0 < logged["rredcot/references/shaped_ratio"] < 1
    assert undocumented({k for k in logged if k.startswith("rredcot/")}, prefix="rredcot/") == []


def test_luffy_with_credit_from_the_loss_forward(
    tiny_model_dir,
    arithmetic_dataset,
    tmp_path,
):
    """A value head whose credit is formed in the one loss forward (TRL's defaults) gives the
    reference row its advantages there, as it gives the sampled rows theirs."""
    from rredcot.integrations.trl import task_reward

    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path,
        reward_funcs=[task_reward("arithmetic", num_steps=2)],
        reward_weights=[1.0],
        max_steps=1,
        references={"mode": "luffy"},
    )
    trainer.train()
    rec = trainer.records[0]
    assert rec["deferred"]  # the credit waited for the loss forward
    reference = trainer.last_batch.completions[-1]
    assert reference == TASK.gold_completion(trainer.last_batch.problems[-1])
    assert float(trainer.last_batch.rewards[-1]) == 1.0  # the reward function's, on the reference
    ours = rec["ours"][-1]
    assert torch.isfinite(rec["ours"]).all() and float(ours.sum()) > 0  # it was credited

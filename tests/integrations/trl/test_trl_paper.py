"""The paper's pieces inside TRL's GRPOTrainer: credit.form=reweight, continuation_likelihood,
newline+merge segmentation."""

from __future__ import annotations

import pytest
import torch

from trl_trainers import make_trainer

pytestmark = pytest.mark.trl


def test_reweight_with_continuation_likelihood_keeps_trls_signs_and_totals(
    tiny_model_dir,
    arithmetic_dataset,
    tmp_path,
):
    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path,
        method="continuation_likelihood",
        max_steps=1,
        credit={"form": "reweight"},  # make_trainer's tokens:4 segments
    )
    trainer.train()
    rec = trainer.records[0]
    trl, ours, mask = rec["trl"], rec["ours"], rec["mask"].to(torch.float32)
    assert torch.isfinite(ours).all()
    grpo = trl.unsqueeze(1) * mask
    assert bool((ours * grpo >= -1e-7).all())  # the sign is TRL's on every token
    # sigma averages 1 over each completion's tokens: each row keeps TRL's total
    torch.testing.assert_close(ours.sum(1), grpo.sum(1), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(ours, grpo), "reweighting moved nothing"
    logged = [h for h in trainer.state.log_history if "rredcot/credit/extra_forward_tokens" in h]
    assert logged and logged[0]["rredcot/credit/extra_forward_tokens"] > 0


def test_reweight_before_the_handover_is_trls_grpo(
    tiny_model_dir,
    arithmetic_dataset,
    tmp_path,
):
    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path,
        method="continuation_likelihood",
        max_steps=1,
        credit={"form": "reweight", "handover": {"mode": "reliability"}},
    )
    trainer.train()
    rec = trainer.records[0]
    expected = rec["trl"].unsqueeze(1) * rec["mask"].to(torch.float32)
    torch.testing.assert_close(rec["ours"], expected, rtol=1e-5, atol=1e-5)
    assert bool((rec["trl"].abs() > 1e-3).any())


def test_entropy_segmenters_cut_with_the_policys_entropies(
    tiny_model_dir,
    arithmetic_dataset,
    tmp_path,
):
    """The entropy strategies (newline+merge among them) get the policy's next-token entropies
    from an extra no-grad forward: the cuts equal those of a fresh forward's entropies."""
    from rredcot.sampling.forward import policy_forward
    from rredcot.sampling.rollout import segment_batch

    trainer = make_trainer(
        tiny_model_dir,
        arithmetic_dataset,
        tmp_path,
        method="uniform",
        max_steps=1,
        learning_rate=0.0,  # the policy after the step is the one that cut
        credit={"segmenter": "entropy:top=0.2,min=2"},
    )
    trainer.train()
    batch = trainer.records[0]["batch"]
    assert max(len(b) for b in batch.boundaries) > 2, "no entropy cut: the check is vacuous"
    with torch.no_grad():
        fwd = policy_forward(
            trainer.model.eval(),
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_len,
            with_entropy=True,
            shared_prompt=False,
        )
    again = segment_batch(batch, trainer._tokenizer, trainer.segmenter, fwd.entropy)
    assert again.boundaries == batch.boundaries

"""Where uniform (GRPO) credit's update lands on a wrong trace, measured on sampled batches.

Uniform credit gives every token of a wrong trace the same negative advantage, including the
correct steps before its first slip. How much of the update that "blame" carries depends on the
policy's confidence: the gradient of ``log p(y)`` with respect to the logits is ``e_y - p``,
whose size is about ``1 - p(y)``, so a token the policy already emits with ``p ~ 1`` barely
moves. This script samples batches from a checkpoint with the run's sampling settings, labels
each wrong trace's first wrong step with the task's verifier, and prints for the tokens before
it (the correct prefix), in the segment that holds it (the slip) and after it:

- their share of the wrong traces' tokens;
- their share of ``sum |A| * (1 - p(y))`` over those tokens (uniform credit: the same ``|A|``
  per trace, so this is the share of the update's logit-gradient mass they receive);
- the mean ``1 - p(y)`` on each side.

The figures are the library's (``rredcot.diagnose``: ``grpo_gradient_mass``, ``token_kinds``);
``rredcot diagnose`` reports them, with intervals, for any policy and task. This script keeps the
batches of the published figure (``benchmarks/results/long_chain/gradient_share_warmstart.json``:
the trainer's prompt stream and segmentation, the answer line merged into the last step, so the
answer counts as "after the slip" unless it is the slip).

    python benchmarks/long_chain_gradient_share.py --init ~/.cache/rredcot/warmstart-arithmetic-... \
        --num-steps 12 --batches 4 --seed 7
"""

from __future__ import annotations

import argparse
import json

import torch

from rredcot.config import TrainConfig
from rredcot.config.io import resolve_config
from rredcot.diagnose import (
    KIND,
    chunk_from_batch,
    grpo_gradient_mass,
    per_unit_sums,
    token_probabilities,
)
from rredcot.training.trainer import Trainer

REGIONS = ("correct_prefix", "slip_segment", "after_slip")
# the library's segment kinds of a labelled wrong trace -> this script's regions
REGION_OF_KIND = {
    KIND["correct_prefix"]: 0,
    KIND["first_error"]: 1,
    KIND["after_error"]: 2,
    KIND["wrong_answer"]: 2,  # the answer line is merged into the last step here
}


def region_shares(policy, batches, segmenter, temperature: float) -> dict:
    """GRPO's logit-gradient mass ``|A| (1 - p)`` on the wrong traces of mixed groups whose first
    wrong line the verifier labels: the token share, update share and mean ``1 - p`` of the
    correct prefix, the segment of the first slip and what follows it (``headroom.py`` reports
    the same on any task)."""
    tokens = mass = uncertainty = 0.0
    wrong = labelled = 0
    for batch in batches:
        token_p, entropy = token_probabilities(policy, batch, temperature)
        chunk = chunk_from_batch(batch, 0, token_p, entropy, segmenter)
        is_wrong = batch.rewards.cpu() < 1.0
        # wrong traces of groups with differing rewards (an all-wrong group gets no update at
        # all) whose first wrong line the verifier labels
        rows = is_wrong & chunk.mixed & torch.tensor([e is not None for e in chunk.error_segments])
        region = torch.full_like(chunk.kinds, -1)
        for kind, r in REGION_OF_KIND.items():
            region[chunk.kinds == kind] = r
        region[~rows] = -1
        mask = batch.response_mask.cpu().float()
        unit = torch.zeros(batch.size, dtype=torch.long)
        tokens = tokens + per_unit_sums(region, mask, unit, 1, 3)[0]
        gradient = grpo_gradient_mass(chunk.advantages, token_p.cpu(), mask)
        mass = mass + per_unit_sums(region, gradient, unit, 1, 3)[0]
        uncertainty = uncertainty + per_unit_sums(region, (1 - token_p.cpu()) * mask, unit, 1, 3)[0]
        wrong += int(is_wrong.sum())
        labelled += int(rows.sum())
    if labelled == 0:
        nan = dict.fromkeys(REGIONS, float("nan"))
        return {"wrong_traces": wrong, "labelled_in_mixed_groups": 0, "token_share": nan,
                "update_share": nan, "mean_1_minus_p": nan}  # fmt: skip
    return {
        "wrong_traces": wrong,
        "labelled_in_mixed_groups": labelled,
        "token_share": {n: float(tokens[i] / tokens.sum()) for i, n in enumerate(REGIONS)},
        "update_share": {n: float(mass[i] / mass.sum()) for i, n in enumerate(REGIONS)},
        "mean_1_minus_p": {
            n: float(uncertainty[i] / max(tokens[i], 1)) for i, n in enumerate(REGIONS)
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--init", required=True, help="checkpoint to sample from")
    ap.add_argument("--num-steps", default="12", help="arithmetic chain length")
    ap.add_argument("--batches", type=int, default=4, help="batches of 16 prompts x 8 samples")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    cfg = resolve_config(
        TrainConfig,
        None,
        {
            "init": args.init,
            "seed": args.seed,
            "out": "/tmp/rredcot-gradient-share",
            "overwrite": True,
            "threads": 1,
            "progress": False,
            "eval_size": 1,
        },
        {"num_steps": args.num_steps},
    )
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    batches = [
        trainer.rollout(trainer.prompts_for_step(step), forward=False)[0]
        for step in range(1, args.batches + 1)
    ]
    report = {
        "init": args.init,
        "num_steps": args.num_steps,
        "seed": args.seed,
        **region_shares(trainer.policy, batches, trainer.segmenter, cfg.sampling.temperature),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

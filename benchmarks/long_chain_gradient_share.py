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

    python benchmarks/long_chain_gradient_share.py --init ~/.cache/rredcot/warmstart-arithmetic-... \
        --num-steps 12 --batches 4 --seed 7
"""

from __future__ import annotations

import argparse
import json

import torch

from rredcot.config import TrainConfig, resolve_config
from rredcot.methods.oracle import first_error_segment
from rredcot.trainer import Trainer


def token_confidence(policy, batch) -> torch.Tensor:
    """``p(y_t)`` of each sampled response token under ``policy``: ``(B, T)``."""
    with torch.no_grad():
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    P, T = batch.prompt_len, batch.response_len
    logp = torch.log_softmax(logits[:, P - 1 : P - 1 + T].float(), dim=-1)
    return logp.gather(-1, batch.input_ids[:, P : P + T].unsqueeze(-1)).squeeze(-1).exp()


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
    regions = ("correct_prefix", "slip_segment", "after_slip")
    tokens = dict.fromkeys(regions, 0.0)
    mass = dict.fromkeys(regions, 0.0)
    uncertainty = dict.fromkeys(regions, 0.0)
    wrong = labelled = 0
    for step in range(1, args.batches + 1):
        batch, _ = trainer.rollout(trainer.prompts_for_step(step), forward=False)
        conf = token_confidence(trainer.policy, batch)
        r, g = batch.rewards, batch.group_ids
        for row in range(batch.size):
            if r[row] >= 1.0:
                continue
            wrong += 1
            group = r[g == g[row]]
            if group.std() == 0:  # an all-wrong group: GRPO gives it no update at all
                continue
            label = batch.verdicts[row].first_error_step
            if label is None or label < 0:
                continue
            k = first_error_segment(
                batch.completions[row], batch.segment_char_starts[row], label
            )  # 1-based segment of the first slip
            bounds = batch.boundaries[row]
            cuts = (
                0,
                bounds[k - 1],
                bounds[min(k, len(bounds) - 1)],
                int(batch.response_mask[row].sum()),
            )
            adv = float((r[row] - group.mean()).abs() / group.std())
            u = 1.0 - conf[row]
            labelled += 1
            for name, a, b in zip(regions, cuts, cuts[1:]):
                tokens[name] += b - a
                mass[name] += adv * float(u[a:b].sum())
                uncertainty[name] += float(u[a:b].sum())
    total_tokens, total_mass = sum(tokens.values()), sum(mass.values())
    report = {
        "init": args.init,
        "num_steps": args.num_steps,
        "seed": args.seed,
        "wrong_traces": wrong,
        "labelled_in_mixed_groups": labelled,
        "token_share": {n: tokens[n] / total_tokens for n in regions},
        "update_share": {n: mass[n] / total_mass for n in regions},
        "mean_1_minus_p": {n: uncertainty[n] / max(tokens[n], 1) for n in regions},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

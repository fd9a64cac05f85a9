"""How much a testbed leaves credit assignment to win, measured before anything is tuned.

Samples ``--batches`` training batches (``--prompts`` prompts x ``--samples`` completions, the
run's sampling settings) from a checkpoint on any task and prints, as JSON:

- ``mean_reward``; ``agreeing_groups`` (share of groups whose rewards all agree: GRPO learns
  nothing from them) split into ``all_wrong_groups`` and ``all_right_groups``;
- ``right_lines_before_error``: over wrong traces with a step label, the mean number of right
  lines before the first wrong one, and the share of wrong traces with at least one;
- GRPO's logit-gradient mass on the wrong traces of mixed groups (the logic of
  ``long_chain_gradient_share.py``, ``rredcot diagnose`` on the diagnose branch): the share that
  lands on the correct prefix before the first slip, on the slip's segment and after it, with the
  mean ``1 - p(y)`` of each.

    python benchmarks/headroom.py --task graph_paths --batches 4 --seed 7
    python benchmarks/headroom.py --task arithmetic --task-arg num_steps=12 --init DIR
    python benchmarks/headroom.py --task word_problems --init smollm2-135m-instruct \\
        --temperature 1.0 --batches 2 --prompts 8

Without ``--init`` the task's default policy is used (the tiny warm-start where the task has
one, built and cached; ``--preset`` picks a named warm-start such as ``low``).
"""

from __future__ import annotations

import argparse
import json
import statistics

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


def gradient_share(policy, batches) -> dict:
    """Where GRPO's logit-gradient mass ``sum |A| (1 - p(y))`` lands on the wrong traces of mixed
    groups: token shares, update shares and mean ``1 - p(y)`` of the correct prefix, the segment
    holding the first slip, and what follows it (``long_chain_gradient_share.py``'s figures)."""
    regions = ("correct_prefix", "slip_segment", "after_slip")
    tokens = dict.fromkeys(regions, 0.0)
    mass = dict.fromkeys(regions, 0.0)
    uncertainty = dict.fromkeys(regions, 0.0)
    wrong = labelled = 0
    for batch in batches:
        conf = token_confidence(policy, batch)
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
            k = first_error_segment(batch.completions[row], batch.segment_char_starts[row], label)
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
    return {
        "wrong_traces": wrong,
        "labelled_in_mixed_groups": labelled,
        "token_share": {n: tokens[n] / max(total_tokens, 1e-12) for n in regions},
        "update_share": {n: mass[n] / max(total_mass, 1e-12) for n in regions},
        "mean_1_minus_p": {n: uncertainty[n] / max(tokens[n], 1) for n in regions},
    }


def group_agreement(batches) -> dict[str, float]:
    """Shares of prompt groups whose rewards are all 0, all 1, or all equal."""
    wrong = right = total = 0
    for batch in batches:
        for g in batch.group_ids.unique():
            r = batch.rewards[batch.group_ids == g]
            total += 1
            wrong += int(bool((r == 0).all()))
            right += int(bool((r == r.max()).all() and r.max() > 0))
    return {
        "agreeing_groups": (wrong + right) / total,
        "all_wrong_groups": wrong / total,
        "all_right_groups": right / total,
        "groups": total,
    }


def right_lines_before_error(batches) -> dict[str, float]:
    """Over wrong traces whose first wrong line is known: right lines before it."""
    counts = [
        v.first_error_step
        for b in batches
        for row, v in enumerate(b.verdicts)
        if b.rewards[row] < 1.0 and v.first_error_step is not None and v.first_error_step >= 0
    ]
    if not counts:
        return {"mean": float("nan"), "share_with_one_or_more": float("nan"), "traces": 0}
    return {
        "mean": statistics.fmean(counts),
        "share_with_one_or_more": sum(c > 0 for c in counts) / len(counts),
        "traces": len(counts),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--task", default="arithmetic")
    ap.add_argument(
        "--task-arg", action="append", default=[], metavar="KEY=VALUE", help="task parameter"
    )
    ap.add_argument("--init", default=None, help="checkpoint (default: the task's default policy)")
    ap.add_argument("--preset", default=None, help="named tiny warm-start (model.tiny_warmstart)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0: the task's suggestion")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    task_args = dict(pair.split("=", 1) for pair in args.task_arg)
    overrides = {
        "task": args.task,
        "seed": args.seed,
        "out": "/tmp/rredcot-headroom",
        "overwrite": True,
        "threads": 1,
        "progress": False,
        "eval_size": 1,
        "prompts_per_step": args.prompts,
        "sampling.num_generations": args.samples,
        "sampling.temperature": args.temperature,
        "sampling.max_new_tokens": args.max_new_tokens,
    }
    if args.init:
        overrides["init"] = args.init
    if args.preset:
        overrides["model.tiny_warmstart"] = args.preset
    cfg = resolve_config(TrainConfig, None, overrides, task_args)
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    batches = [
        trainer.rollout(trainer.prompts_for_step(step), forward=False)[0]
        for step in range(1, args.batches + 1)
    ]
    report = {
        "task": args.task,
        "task_args": task_args,
        "init": str(trainer.source),
        "temperature": args.temperature,
        "max_new_tokens": cfg.sampling.max_new_tokens,
        "seed": args.seed,
        "traces": sum(b.size for b in batches),
        "mean_reward": float(torch.cat([b.rewards for b in batches]).mean()),
        **group_agreement(batches),
        "right_lines_before_error": right_lines_before_error(batches),
        **gradient_share(trainer.policy, batches),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""``rredcot explain``: the flags, and the command that prints (and optionally writes as HTML)
where the credit went, for the demo or for a checkpoint's own samples."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rredcot.config import refuse_bad_seed, refuse_blank_path
from rredcot.errors import UserError
from rredcot.explain.pictures import demo_sections, render_html, render_terminal


def add_explain_parser(sub) -> None:
    p = sub.add_parser("explain", help="Show where the credit goes, segment by segment.")
    p.add_argument(
        "--demo", action="store_true", help="Walk through the idea on an arithmetic trace."
    )
    p.add_argument(
        "--error-step", type=int, default=1, help="Demo: 0-based step that gets the error."
    )
    p.add_argument("--lam", type=float, default=0.0, help="Segment GAE lambda for the demo.")
    p.add_argument(
        "--checkpoint", default=None, help="A policy checkpoint (warm-start or run dir)."
    )
    p.add_argument(
        "--prompt", default=None, help="Prompt text to sample from (default: a task problem)."
    )
    p.add_argument(
        "--method",
        default=None,
        help="Credit method to show (default: the --run's own method, else value_head).",
    )
    p.add_argument(
        "--run",
        default=None,
        help="A run whose trained credit method (value head), credit settings and task to use: "
        "a `rredcot train` run directory, or a TRL output_dir or checkpoint-N of "
        "RREDCoTGRPOTrainer (value_head.pt, rredcot_credit.json). Alone, its policy is used too.",
    )
    p.add_argument(
        "--credit.process_reward.function",
        "--credit.process-reward.function",
        dest="process_reward_function",
        default=None,
        metavar="SPEC",
        help="The process-reward function (module:callable or file.py:callable) to import and "
        "call. A function that a --run's config.yaml or rredcot_credit.json names is never "
        "imported unless you name it here yourself (read it first).",
    )
    p.add_argument("--html", default=None, help="Also write a self-contained HTML page here.")
    p.add_argument("--samples", type=int, default=8, help="Completions sampled (group size).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--task",
        dest="task_name",
        default=None,
        help="Task name (default: the checkpoint's task, else arithmetic).",
    )
    p.add_argument(
        "--answer", default=None, help="Reference answer of --prompt (to verify the samples)."
    )
    p.add_argument("--no-color", action="store_true", help="Plain terminal output.")


def check_output_file(path: str, flag: str) -> None:
    """Refuse an output file path that cannot be written, before any work is done."""
    refuse_blank_path(path, flag.lstrip("-"), "file")
    target = Path(path)
    if target.is_dir():
        raise UserError(f"{flag} {path}: a directory; give a file name such as {target / 'x.html'}")
    if not target.parent.is_dir():
        what = "is a file" if target.parent.exists() else "does not exist"
        raise UserError(f"{flag} {path}: its folder {target.parent} {what}; pick another path")
    if not os.access(target.parent, os.W_OK) or (
        target.exists() and not os.access(target, os.W_OK)
    ):
        raise UserError(f"{flag} {path}: not writable by you; pick another path")


def run_explain(args: argparse.Namespace, task_args: dict) -> int:
    color = None if not args.no_color else False
    refuse_bad_seed(args.seed, "--seed")
    if args.html is not None:
        check_output_file(args.html, "--html")
    if args.demo or not (args.checkpoint or args.run):
        if not args.demo:
            print(
                "no --checkpoint or --run given: showing the demo (rredcot explain --demo)\n",
                file=sys.stderr,
            )
        sections = demo_sections(args.error_step, seed=args.seed, lam=args.lam)
    else:
        # lazy: CLI start-up (explain_model imports torch; `--demo` and `--help` start without it)
        from rredcot.explain.model import explain_checkpoint

        sections = explain_checkpoint(args, task_args)
    for title, prompt, segments in sections:
        print(f"prompt: {prompt.rstrip()}")
        print(render_terminal(title, segments, color=color))
        print()
    if args.html:
        with open(args.html, "w", encoding="utf-8") as fh:
            fh.write(render_html(sections))
        print(f"wrote {args.html}")
    return 0

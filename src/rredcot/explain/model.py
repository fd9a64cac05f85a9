"""``rredcot explain --checkpoint DIR``: where a credit method puts the credit on traces that a
trained policy actually samples.

The checkpoint may be a model directory (a warm-start from ``rredcot sft``, or
``checkpoints/step_N/policy``), a checkpoint directory (``checkpoints/step_N``) or a run directory
(its latest checkpoint). One group of completions is sampled for the prompt, the chosen method
computes its credit exactly as the trainer would (``fill_forward`` then ``compute``), and one
correct and one incorrect trace (or the first trace, if all agree) are shown segment by segment.

The helpers here are shared with the benchmarks: :func:`resolve_checkpoint` (which directory holds
what), :func:`load_method_state` (a run's trained value head), :func:`segment_credits` (one row of
a batch as :class:`~rredcot.explain.pictures.SegmentCredit` entries for the terminal and HTML views).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from rredcot.algebra import credit
from rredcot.algebra.normalization import group_mean_std
from rredcot.config import CreditConfig, SamplingConfig
from rredcot.config.io import load_yaml
from rredcot.errors import UserError
from rredcot.explain.pictures import SegmentCredit
from rredcot.integrations.saved import (
    CREDIT_STATE_FILE,
    SETTINGS_FILE,
    latest_trl_checkpoint,
    read_settings,
)
from rredcot.machine import refuse_beyond_memory, refuse_bytes_beyond_memory
from rredcot.methods.auto import check_method_name
from rredcot.methods.base import CreditContext, CreditOutput, build_credit
from rredcot.models import load_policy, resolve_model_dir
from rredcot.safe_fs import read_json_file
from rredcot.sampling.batch import RolloutBatch
from rredcot.sampling.forward import fill_forward
from rredcot.sampling.rollout import build_rollout_batch, prompt_special_tokens, render_prompt
from rredcot.segment import segmenter_from_config
from rredcot.tasks import get_task
from rredcot.tasks.arithmetic import chain_results, format_prompt, parse_prompt
from rredcot.tasks.base import Problem, read_task_data
from rredcot.training import runio

DEFAULT_TASK = "arithmetic"


# ---------------------------------------------------------------------------------------------
# checkpoints


@dataclass
class ResolvedCheckpoint:
    policy_dir: Path  # loadable by models.load_policy
    checkpoint_dir: Path | None  # checkpoints/step_N (holds trainer_state.pt), if any
    run_dir: Path | None  # the run directory (holds config.yaml), if any


def resolve_checkpoint(path: str | Path) -> ResolvedCheckpoint:
    """Find the policy, the trainer checkpoint and the run behind ``path``.

    Accepts a model directory (``config.json``), a trainer checkpoint (``policy/`` and
    ``trainer_state.pt``), a run directory (``checkpoints/``, its latest checkpoint is used), or
    a GGUF file or shipped model (``smollm2-135m-instruct``): their dequantised copy.
    """
    p = Path(resolve_model_dir(path)).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {str(p)!r} does not exist")

    def run_of(ckpt: Path) -> Path | None:
        run = ckpt.parent.parent
        return run if (run / "config.yaml").exists() else None

    if (p / "config.json").exists():
        ckpt = p.parent if (p.parent / "trainer_state.pt").exists() else None
        return ResolvedCheckpoint(p, ckpt, run_of(ckpt) if ckpt else None)
    if (p / "policy").is_dir() and (p / "trainer_state.pt").exists():
        reason = runio.verify_checkpoint(p)
        if reason is not None:
            raise UserError(
                f"checkpoint {p} cannot be used: {reason}; pass an older checkpoint, or the run "
                "directory (its newest valid checkpoint is used)"
            )
        return ResolvedCheckpoint(p / "policy", p, run_of(p))
    trl_ckpt = latest_trl_checkpoint(p)
    if trl_ckpt is not None:  # a TRL output_dir before its final save_model
        return ResolvedCheckpoint(trl_ckpt, None, None)
    if (p / runio.CHECKPOINTS).is_dir():
        ckpt = runio.latest_checkpoint(p)
        if ckpt is None:
            raise FileNotFoundError(f"run directory {str(p)!r} has no complete checkpoint yet")
        return ResolvedCheckpoint(ckpt / "policy", ckpt, p)
    raise FileNotFoundError(
        f"{str(p)!r} is neither a model directory (config.json), a trainer checkpoint "
        "(policy/ + trainer_state.pt) nor a run directory (checkpoints/); pass the output of "
        "`rredcot sft` or `rredcot train`"
    )


def trl_settings_dir(path: str | Path | None) -> Path | None:
    """The directory of a TRL run of the adapter that holds its saved settings
    (``rredcot_credit.json``): ``path`` itself (an ``output_dir`` after ``save_model``, or a
    ``checkpoint-N``), else the newest ``checkpoint-N`` in it that has them; None otherwise."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if (p / SETTINGS_FILE).is_file():
        return p
    ckpt = latest_trl_checkpoint(p)
    return ckpt if ckpt is not None and (ckpt / SETTINGS_FILE).is_file() else None


def checkpoint_task(resolved: ResolvedCheckpoint) -> tuple[str, dict] | None:
    """The task (name, parameters) the checkpoint was trained on, when it says so: the run's
    ``config.yaml``, a TRL run's ``rredcot_credit.json`` or the warm-start's ``warmstart.json``."""
    trl = read_settings(resolved.policy_dir)
    if trl is not None and trl.task:
        return trl.task, dict(trl.task_args)
    if resolved.run_dir is not None:
        cfg = load_yaml(resolved.run_dir / "config.yaml")
        return cfg.task, dict(cfg.task_args)
    info = resolved.policy_dir / "warmstart.json"
    if info.exists():
        data = read_json_file(info, "warm-start record")  # size and nesting within limits
        if isinstance(data, dict) and data.get("task"):
            return data["task"], dict(data.get("task_args") or {})
    return None


def choose_task(
    resolved: ResolvedCheckpoint,
    name: str | None,
    task_args: dict,
    saved: tuple[str, dict] | None = None,
):
    """``name`` (default: the checkpoint's task, else arithmetic) with the checkpoint's task
    parameters under the ones given on the command line; ``saved`` (a run's task and parameters)
    takes the checkpoint's place."""
    saved = saved or checkpoint_task(resolved)
    chosen = name or (saved[0] if saved else DEFAULT_TASK)
    params = dict(saved[1]) if saved and saved[0] == chosen else {}
    params.update(task_args)
    return get_task(chosen, **params)


def read_method_state(run_or_checkpoint: str | Path) -> tuple[dict, Path] | None:
    """``(state, where)`` of a credit method's saved state (the value head), read as plain data
    only: a TRL run's ``value_head.pt`` (its ``{"credit_method", "state"}`` record), else a
    rredcot run's latest checkpoint (or the given checkpoint) ``trainer_state.pt
    ["credit_method"]``; ``None`` where there is no checkpoint."""
    p = Path(run_or_checkpoint).expanduser()
    trl = trl_settings_dir(p)
    if trl is not None and (trl / CREDIT_STATE_FILE).is_file():
        saved = runio.load_plain(trl / CREDIT_STATE_FILE)
        if not isinstance(saved, dict) or not {"credit_method", "state"} <= set(saved):
            raise UserError(
                f"{trl / CREDIT_STATE_FILE} holds no credit method's state (a dict with "
                "credit_method and state, as RREDCoTGRPOTrainer writes it); use a complete copy"
            )
        return saved, trl
    ckpt, skipped = (p, []) if (p / "trainer_state.pt").exists() else runio.find_checkpoint(p)
    if ckpt is None and skipped:
        why = "; ".join(f"{path.name}: {reason}" for path, reason in skipped)
        raise UserError(f"--run {str(p)!r}: no checkpoint can be used ({why})")
    if ckpt is None:
        return None
    state = runio.load_trainer_state(ckpt / "trainer_state.pt")["credit_method"]
    return {"credit_method": None, "state": state}, ckpt


def load_method_state(method, run_or_checkpoint: str | Path, saved=None) -> Path:
    """Load a credit method's state (the value head) from a rredcot or TRL run (or from
    ``saved``, what :func:`read_method_state` read). Returns the checkpoint used."""
    saved = saved or read_method_state(run_or_checkpoint)
    if saved is None:
        raise FileNotFoundError(
            f"--run {str(run_or_checkpoint)!r}: no checkpoint with trainer_state.pt there; pass a "
            "run directory written by `rredcot train`"
        )
    record, where = saved
    if record["credit_method"] not in (None, method.name):
        raise UserError(
            f"{where / CREDIT_STATE_FILE} holds the state of {record['credit_method']!r}, "
            f"not {method.name!r}; pass --method {record['credit_method']}"
        )
    method.load_state_dict(record["state"])
    return where


def run_credit_config(run_dir: str | Path | None):
    """``(credit_method, CreditConfig, SamplingConfig)`` of a run (``rredcot train``'s
    ``config.yaml`` or a TRL run's ``rredcot_credit.json``), or None without one."""
    trl = trl_settings_dir(run_dir)
    if trl is not None:
        saved = read_settings(trl)
        return saved.credit_method, saved.credit, saved.sampling
    if run_dir is None or not (Path(run_dir) / "config.yaml").exists():
        return None

    cfg = load_yaml(Path(run_dir) / "config.yaml")
    return cfg.credit_method, cfg.credit, cfg.sampling


# ---------------------------------------------------------------------------------------------
# one trace as segments


def segment_texts(batch: RolloutBatch, row: int) -> list[str]:
    """The text of each segment of ``row`` (from the segments' first characters)."""
    text = batch.completions[row]
    starts = list(batch.segment_char_starts[row]) if batch.segment_char_starts else []
    n = len(batch.boundaries[row]) - 1
    if len(starts) != n:
        raise ValueError(f"row {row}: {n} segments but {len(starts)} segment starts")
    ends = starts[1:] + [len(text)]
    return [text[a:b] for a, b in zip(starts, ends)]


def segment_credits(
    batch: RolloutBatch,
    row: int,
    segment_advantages: torch.Tensor,
    values: torch.Tensor | None = None,
    value_mask: torch.Tensor | None = None,
) -> list[SegmentCredit]:
    """Row ``row`` as one :class:`SegmentCredit` per segment.

    Args:
        segment_advantages: ``(B, S)`` the credit ``A_k`` to show.
        values, value_mask: ``(B, S+1)`` ``V(s_k)`` where the method has values; then ``r_k`` is
            ``V(s_k) - V(s_{k-1})`` with ``V(s_n) := R``. Without values ``r_k`` is shown as the
            segment's own credit (attribution methods split ``R - V(s_0)`` directly).
    """
    texts = segment_texts(batch, row)
    n = len(texts)
    adv = segment_advantages[row, :n].detach().double().cpu().tolist()
    if values is None:
        return [SegmentCredit(t, None, None, a, a) for t, a in zip(texts, adv)]
    v = values[row : row + 1].detach().double().cpu()
    m = value_mask[row : row + 1].cpu()
    r = batch.rewards[row : row + 1].detach().double().cpu()
    seg_rewards, _ = credit.redistribute(v, m, r)
    full = v[0, : n + 1].clone()
    full[n] = r[0]
    return [
        SegmentCredit(t, float(full[k]), float(full[k + 1]), float(seg_rewards[0, k]), adv[k])
        for k, t in enumerate(texts)
    ]


def output_credits(batch: RolloutBatch, out: CreditOutput, row: int) -> list[SegmentCredit]:
    """A method's :class:`CreditOutput` for one row, as the trainer uses it."""
    return segment_credits(batch, row, out.segment_advantages, out.values, out.value_mask)


def normaliser_note(method, batch: RolloutBatch, row: int) -> str:
    """What the method's normalisation divides ``row``'s segment credit ``A_k`` by, in words
    (the token advantage is ``A_k / normaliser``)."""
    mode = method.normalization
    r = batch.rewards.double()
    _, std = group_mean_std(r, batch.group_ids)
    group = float(std[row])
    batch_std = float(r.std()) if r.numel() > 1 else 0.0
    if mode == "group_std":
        return f"normaliser: group std {group:.3f} + 1e-4"
    if mode == "group_or_batch_std":
        floor = method.config.agreeing_std
        if group >= floor:
            return f"normaliser: group std {group:.3f} + 1e-4"
        return (
            f"normaliser: group std {group:.3f} < credit.agreeing_std {floor:g} (rewards agree): "
            f"GRPO's share (0 here) by it, the value credit by max(batch std, {floor:g}) = "
            f"{max(batch_std, floor):.3f}"
        )
    if mode == "batch_std":
        return f"normaliser: max(batch std {batch_std:.3f}, 0.1) + 1e-4"
    if mode == "whiten":
        return "normaliser: whitened over the batch's tokens"
    return "normaliser: none"


def pick_rows(batch: RolloutBatch) -> list[int]:
    """One correct and one incorrect row (first of each), or the first row if all agree;
    rows with no segments are passed over."""
    live = [i for i in range(batch.size) if len(batch.boundaries[i]) > 1]
    correct = [i for i in live if float(batch.rewards[i]) >= 1.0]
    wrong = [i for i in live if float(batch.rewards[i]) < 1.0]
    rows = correct[:1] + wrong[:1]
    return rows or live[:1]


# ---------------------------------------------------------------------------------------------
# the command


def _reference_answer(task, prompt: str) -> tuple[str, str]:
    """A free prompt's reference answer where the task can work it out (arithmetic chains);
    returns (prompt, answer) with the prompt normalised to the task's format, or (prompt, "")."""
    if task.name == "arithmetic":
        for text in (prompt, prompt.strip() + "\n"):
            chain = parse_prompt(text)
            if chain is not None:
                return format_prompt(*chain), str(chain_results(*chain)[-1])
    return prompt, ""


def explain_checkpoint(
    args: argparse.Namespace, task_args: dict
) -> list[tuple[str, str, list[SegmentCredit]]]:
    """Sample ``args.samples`` completions for one prompt from the checkpoint's policy, compute
    ``args.method``'s credit and return ``(title, prompt, segments)`` sections for a correct and
    an incorrect trace (or one trace when all agree)."""
    if args.samples < 1:
        raise ValueError(f"--samples {args.samples}: sample at least one completion")
    refuse_beyond_memory(f"--samples {args.samples}", args.samples, 1, "lower it")
    resolved, run_dir, saved, task = _explain_sources(args, task_args)
    if getattr(args, "method", None) is None:  # the run's own method, else the value head
        args.method = saved[0] if saved is not None else "value_head"
    check_method_name(args.method, allow_auto=False)  # names and data before the model loads
    example = None if args.prompt else _saved_example(run_dir)
    if example is None:  # a TRL run's saved example needs none of the task's data (the hub)
        read_task_data(task)
    own_run = saved is not None and saved[0] == args.method
    credit_cfg, sampling = CreditConfig(), SamplingConfig()
    if own_run:
        credit_cfg, sampling = saved[1], saved[2]
    elif saved is not None:
        sampling = saved[2]
    credit_cfg = _allowed_function(credit_cfg, args, run_dir)
    # read before the model loads: a refused trainer_state.pt stops the command at once
    method_state = read_method_state(run_dir) if own_run else None
    problem = _explain_problem(args, task, example)
    max_new_tokens = sampling.max_new_tokens or task.suggested_max_new_tokens() or 64
    where = "--prompt" if args.prompt else "the prompt"
    if not args.prompt and example is not None:
        where = f"the example of {_settings_file(run_dir)}"
    check_prompt_fits(resolved.policy_dir, problem, args.samples, max_new_tokens, where)
    attn = "eager" if args.method == "attention" else None
    policy, tokenizer = load_policy(str(resolved.policy_dir), attn_implementation=attn)
    segmenter = segmenter_from_config(credit_cfg, task.answer_line_pattern)
    method = build_credit(
        args.method,
        credit_cfg,
        CreditContext(
            policy=policy, tokenizer=tokenizer, task=task, segmenter=segmenter, sampling=sampling
        ),
    )
    note = ""
    if method.state_dict():  # a learned method (the value head)
        if own_run:
            ckpt = load_method_state(method, run_dir, method_state)
            note = f" (head from {ckpt})"
        else:
            note = _untrained_note(args.method, run_dir, saved)
    torch.manual_seed(args.seed)
    batch, _ = build_rollout_batch(
        policy,
        tokenizer,
        task,
        [problem],
        segmenter,
        num_generations=args.samples,
        max_new_tokens=max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
    )
    batch = fill_forward(
        policy, batch, hidden_layers=method.hidden_layers if method.needs_hidden_states else None
    )
    out = method.compute(batch)
    sections = _explain_sections(args.method, note, method, batch, out, problem.prompt)
    if not sections:
        raise ValueError("every sampled completion was empty or skipped; nothing to show")
    return sections


def check_prompt_fits(policy_dir: Path, problem: Problem, rows: int, max_new: int, where: str):
    """Refuse, before the model loads, a prompt that does not fit the model's context with
    ``max_new`` new tokens, or whose ``rows`` samples cannot fit this machine's memory (their
    KV cache, and one row's attention scores and logits: a lower bound of what sampling and
    scoring them needs); reads only the model's config and tokenizer."""
    try:
        config = AutoConfig.from_pretrained(str(policy_dir))
        tokenizer = AutoTokenizer.from_pretrained(str(policy_dir))
    except (OSError, ValueError, KeyError):  # load_policy says what is wrong with the model
        return
    text = render_prompt(problem, tokenizer)
    special = prompt_special_tokens(tokenizer)
    prompt = len(tokenizer(text, add_special_tokens=special)["input_ids"])
    length = prompt + max_new
    limit = getattr(config, "max_position_embeddings", None)
    if limit and length > limit:
        raise UserError(
            f"{where} is {prompt:,} tokens, {length:,} positions with {max_new} new tokens: more "
            f"than the model's {limit:,}; give a shorter prompt (--prompt) or a model with a "
            "longer context"
        )
    get = lambda name, default=1: int(getattr(config, name, None) or default)  # noqa: E731
    heads, layers = get("num_attention_heads"), get("num_hidden_layers")
    kv_width = get("num_key_value_heads", heads) * (
        get("head_dim", 0) or get("hidden_size") // heads
    )
    need = 4 * (rows * length * 2 * layers * kv_width + heads * length**2)
    need += 4 * length * get("vocab_size")
    refuse_bytes_beyond_memory(
        f"{where} ({prompt:,} tokens) x --samples {rows}",
        need,
        "their KV cache, one row's attention scores and logits",
        "give a shorter prompt or fewer --samples",
    )


def _explain_sources(args: argparse.Namespace, task_args: dict):
    """``(resolved checkpoint, run directory, the run's saved credit settings, task)`` of
    ``--checkpoint`` and ``--run`` (a rredcot run or a TRL output_dir)."""
    run_arg = getattr(args, "run", None)
    trl_dir = trl_settings_dir(run_arg or args.checkpoint)
    checkpoint = args.checkpoint or (str(trl_dir) if trl_dir is not None else run_arg)
    if checkpoint is None:
        raise UserError("pass --checkpoint DIR (a policy) or --run DIR (a run of rredcot or TRL)")
    resolved = resolve_checkpoint(checkpoint)
    run_dir = trl_dir or (Path(run_arg) if run_arg else resolved.run_dir)
    saved = run_credit_config(run_dir)
    saved_task = None
    if trl_dir is not None:
        trl = read_settings(trl_dir)
        saved_task = (trl.task, trl.task_args) if trl.task else None
    task = choose_task(resolved, getattr(args, "task_name", None), task_args, saved_task)
    return resolved, run_dir, saved, task


def _allowed_function(credit_cfg: CreditConfig, args: argparse.Namespace, run_dir) -> CreditConfig:
    """``credit_cfg`` with the process-reward function this command may import: the one named
    by ``--credit.process_reward.function`` on the command line. A function that only the run's
    saved settings name is never imported: it is refused here, naming it and that flag."""
    given = getattr(args, "process_reward_function", None)
    saved = credit_cfg.process_reward.function
    if saved and not given:
        raise UserError(
            f"{_settings_file(run_dir)} names credit.process_reward.function={saved!r}, code "
            "that explain would import and run; read that file, then name it yourself to allow "
            f"it: --credit.process_reward.function {saved} (or show another --method)"
        )
    if not given:
        return credit_cfg
    options = dataclasses.replace(credit_cfg.process_reward, function=given, model=None)
    return dataclasses.replace(credit_cfg, process_reward=options)


def _settings_file(run_dir) -> Path:
    """The file that holds a run's credit settings (a TRL run's, else ``config.yaml``)."""
    trl = trl_settings_dir(run_dir)
    return trl / SETTINGS_FILE if trl is not None else Path(run_dir) / "config.yaml"


def _untrained_note(method_name: str, run_dir: Path | None, saved) -> str:
    """The title note of a learned method that no run of its own trained; warns on stderr why,
    and what its credit then is."""
    if run_dir is None:
        why = "no --run given"
    elif saved is None:
        why = (
            f"--run {str(run_dir)!r} holds no rredcot run (neither config.yaml of "
            "`rredcot train` nor rredcot_credit.json of a TRL run)"
        )
    else:
        why = f"the run {str(run_dir)!r} trained {saved[0]!r}, not {method_name!r}"
    what = (
        "hand-over weight is 0, so its credit is uniform's"
        if method_name == "answer_likelihood"
        else "head is untrained and its values are meaningless"
    )
    print(
        f"warning: {why}, so the {method_name} {what}; pass --run RUN_DIR of a "
        "`rredcot train` run or a TRL output_dir of this method",
        file=sys.stderr,
    )
    return " (no hand-over yet)" if method_name == "answer_likelihood" else " (untrained head)"


def _saved_example(run_dir) -> dict | None:
    """The training row a TRL run saved (``rredcot_credit.json``'s ``example``), if any."""
    trl = trl_settings_dir(run_dir) if run_dir is not None else None
    settings = read_settings(trl) if trl is not None else None
    return settings.example if settings is not None else None


def _explain_problem(args: argparse.Namespace, task, example: dict | None = None) -> Problem:
    """``--prompt`` (with ``--answer``, else the answer the task works out, else a warning),
    the TRL run's saved training row (``example``), or the task's first evaluation problem for
    ``--seed``."""
    answer = getattr(args, "answer", None)
    if args.prompt:
        text, guess = _reference_answer(task, args.prompt)
        problem = Problem(prompt=text, answer=answer if answer is not None else guess)
        if not problem.answer:
            print(
                "warning: no reference answer for this prompt (pass --answer); rewards and "
                "answer-based credit may be meaningless",
                file=sys.stderr,
            )
        return problem
    if example is not None:
        problem = Problem(example["prompt"], example["answer"])
    else:
        problem = task.eval_problems(1, seed=args.seed)[0]
    if answer is not None:
        problem = Problem(problem.prompt, answer, problem.meta)
    return problem


def _explain_sections(
    method_name: str, note: str, method, batch: RolloutBatch, out: CreditOutput, prompt: str
) -> list[tuple[str, str, list[SegmentCredit]]]:
    """The ``(title, prompt, segments)`` sections of the rows to show. A group whose rewards
    agree: every sample, with R, the normaliser and w (why its credit is what it is); otherwise
    one correct and one wrong sample."""
    blend = out.metrics.get("credit/handover_weight")
    blend_note = "" if blend is None or blend >= 1.0 else f", blended {blend:.2f} with uniform"
    correct = int(sum(float(r) >= 1.0 for r in batch.rewards))
    agree = correct in (0, batch.size)
    rows = [i for i in range(batch.size) if len(batch.boundaries[i]) > 1] if agree else None
    sections = []
    for row in rows or pick_rows(batch):
        verdict = batch.verdicts[row]
        title = (
            f"{method_name}{note}{blend_note}: sample {row + 1} of {batch.size} "
            f"({correct} correct), R = {float(batch.rewards[row]):g}, {verdict.reason}"
        )
        if agree:
            w = 1.0 if blend is None else blend
            title += f"; {normaliser_note(method, batch, row)}; w = {w:.2f}"
        segments = output_credits(batch, out, row)
        starts = batch.boundaries[row][:-1]
        for seg, start in zip(segments, starts):
            seg.scaled = float(out.advantages[row, start])
        sections.append((title, prompt, segments))
    return sections


__all__ = [
    "ResolvedCheckpoint",
    "checkpoint_task",
    "choose_task",
    "explain_checkpoint",
    "load_method_state",
    "normaliser_note",
    "read_method_state",
    "output_credits",
    "pick_rows",
    "resolve_checkpoint",
    "run_credit_config",
    "segment_credits",
    "segment_texts",
]

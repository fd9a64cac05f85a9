"""Process rewards as a value source (docs/method.md, value sources): your own step scores or a
frozen Hugging Face process reward model (PRM) give ``V(s_k)`` at every segment boundary.

**Sources** (``credit.process_reward``, exactly one):

- ``function="module:callable"`` (or ``"path/to/file.py:callable"``): called once per completion
  with at least one segment as ``fn(prompt, completion, ends)``:

  - ``prompt``: the problem's prompt text (``Problem.prompt``: the user text, no chat template);
  - ``completion``: the completion's text as decoded (special tokens skipped);
  - ``ends``: ``list[int]``, the character offset in ``completion`` where each of the ``n``
    segments ends, increasing, ``ends[-1] == len(completion)``; segment ``k`` (1-based) is
    ``completion[ends[k-2]:ends[k-1]]`` (``ends[-1]`` of the empty list is 0) and the prefix
    state ``s_k`` is the prompt plus ``completion[:ends[k-1]]``.

  It returns ``n`` numbers (any sequence, a tensor or an array), each finite and in ``[0, 1]``:
  score ``k`` is ``V(s_k)``, the probability that the trace ends correct given its first ``k``
  segments. The last score is checked but not used (the credit sets ``V(s_n) = R``). Anything
  else is a ``ValueError`` that names the function, the row and the fix. Batch or cache inside
  the function as you like; it is called on the main process's rows in rredcot's trainer, on each
  process's own rows in TRL, on the driver in verl.
- ``model=PATH_OR_HUB_NAME``: a sequence-classification or token-classification model
  (``AutoModelFor{Sequence,Token}Classification.from_pretrained``, with its own tokenizer, which
  must be a fast one), on the run's device, in eval mode with ``requires_grad`` off: the PRM is
  frozen, never trained and not checkpointed (it is reloaded from ``model``). Its input is
  ``prompt + prompt_separator + steps`` (each step as sampled, or with its trailing whitespace
  replaced by ``step_separator``), tokenised with the tokenizer's own special tokens.
  ``sequence_classification`` scores every prefix ``s_k`` (``k < n``) as its own input;
  ``token_classification`` runs each completion once and reads the logits at the last token of
  every step (so it assumes a causal model: a bidirectional encoder would let ``V(s_k)`` see later
  steps). The probability of the positive class (``positive_label`` / ``positive_index``; a sigmoid
  for a single output) is ``V(s_k)``. Inputs are batched up to ``chunk_tokens`` and
  left-truncated to ``max_length`` tokens.

A PRM whose score comes out of a causal LM's next-token logits (Math-Shepherd's ``+``/``-`` after
a step tag, a judge prompt) is a few lines as a ``function``.

**The value of the prompt.** No source scores ``s_0``: ``V(s_0)`` is the group's mean reward
``ḡ``, so with the anchor (``credit.anchor=group``, idempotent here) ``V'(s_k) = V(s_k)`` and
every trace keeps GRPO's total ``R - ḡ``; the scores only decide how it is spread. The hand-over
(:class:`rredcot.methods.value_source.ValueSourceCredit`, shared with answer likelihood): ``w`` starts at 0 (GRPO exactly),
and each ``update`` folds the slope of the fresh outcomes on ``V'(s_{n-1})`` (clipped to
[0, 1], smoothed by ``credit.handover.smoothing``) into it; a batch whose last prefix values
hardly depart from ``ḡ`` (root mean square below ``MIN_DEPARTURE_RMS``) leaves it as it is.
Then segment GAE with ``credit.lam`` (at the default 1 the scores are a baseline and the expected
update is GRPO's; below 1 they move credit) and ``group_or_batch_std`` normalisation.

**Cost**: ``credit/extra_forward_tokens`` counts the PRM's input tokens (padding excluded); a
function costs what it costs, reported as ``credit/prm_calls``. No generation, no policy forward.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor
from transformers import AutoConfig, AutoTokenizer

from rredcot.algebra.normalization import group_mean_std
from rredcot.config import ProcessRewardConfig
from rredcot.methods.base import CreditContext, register_credit
from rredcot.methods.value_source import ValueSourceCredit
from rredcot.sampling.batch import RolloutBatch
from rredcot.sampling.memory import token_chunks

__all__ = [
    "PRMScorer",
    "ProcessRewardCredit",
    "check_scores",
    "load_function",
    "segment_ends",
]

_FLAG = "credit.process_reward"


# ---------------------------------------------------------------------------------------------
# the user's function


def load_function(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` names: ``"package.module:name"`` (imported) or
    ``"path/to/file.py:name"`` (loaded from the file); ``name`` may be dotted
    (``"Class.method"``)."""
    module_part, _, attr = spec.rpartition(":")
    where = f"{_FLAG}.function={spec!r}"
    if not module_part or not attr:
        raise ValueError(f"{where}: write it as 'module:callable' or 'path/to/file.py:callable'")
    try:
        if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
            path = Path(module_part).expanduser()
            if not path.is_file():
                raise ValueError(f"{where}: no file {path}")
            name = f"rredcot_prm_{abs(hash(str(path.resolve())))}"
            loader = importlib.util.spec_from_file_location(name, path)
            if loader is None or loader.loader is None:
                raise ValueError(f"{where}: cannot load {path} as Python")
            module = importlib.util.module_from_spec(loader)
            sys.modules[name] = module
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_part)
    except ImportError as err:
        raise ValueError(
            f"{where}: cannot import {module_part!r} ({err}); put the module on PYTHONPATH or "
            "give the path of its file"
        ) from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{where}: {module_part!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{where}: {attr!r} is a {type(obj).__name__}, not a callable")
    return obj


def segment_ends(batch: RolloutBatch, row: int) -> list[int]:
    """The character offset in ``batch.completions[row]`` where each segment of the row ends
    (the next segment's start; the last one ``len(completion)``)."""
    text = batch.completions[row]
    starts = list(batch.segment_char_starts[row]) if batch.segment_char_starts else []
    n = len(batch.boundaries[row]) - 1
    if len(starts) != n:
        raise ValueError(
            f"process_reward: row {row} has {n} segments but {len(starts)} character starts; "
            "the batch must be segmented (rollout.segment_batch)"
        )
    return [min(int(s), len(text)) for s in starts[1:]] + [len(text)]


def check_scores(scores: Any, n: int, name: str, row: int) -> list[float]:
    """``scores`` as ``n`` floats, each finite and in [0, 1], or a ``ValueError`` naming the
    function ``name``, the ``row`` and the fix."""
    where = f"{_FLAG}.function {name!r} on row {row}"
    contract = (
        f"it must return one score in [0, 1] per segment ({n} here, in order: V(s_1) .. "
        f"V(s_{n}), the probability of a correct outcome after each segment)"
    )
    if isinstance(scores, Tensor):
        scores = scores.detach().cpu().reshape(-1).tolist()
    elif hasattr(scores, "tolist") and not isinstance(scores, (str, bytes)):
        scores = scores.tolist()  # numpy arrays
    if isinstance(scores, (str, bytes)) or not isinstance(scores, Sequence):
        raise ValueError(f"{where} returned a {type(scores).__name__}; {contract}")
    if len(scores) != n:
        raise ValueError(f"{where} returned {len(scores)} scores for {n} segments; {contract}")
    out = []
    for k, s in enumerate(scores, start=1):
        try:
            v = float(s)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: score {k} is {s!r}, not a number; {contract}") from err
        if not math.isfinite(v):
            raise ValueError(f"{where}: score {k} is {v}; {contract}")
        if not 0.0 <= v <= 1.0:
            raise ValueError(
                f"{where}: score {k} is {v}, outside [0, 1]; {contract} (squash a raw "
                "logit with a sigmoid)"
            )
        out.append(v)
    return out


# ---------------------------------------------------------------------------------------------
# a Hugging Face PRM


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KIND_CLASSES = {
    "sequence_classification": "AutoModelForSequenceClassification",
    "token_classification": "AutoModelForTokenClassification",
}


def _kind_from_config(config, name: str) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch.endswith("ForSequenceClassification"):
            return "sequence_classification"
        if arch.endswith("ForTokenClassification"):
            return "token_classification"
    raise ValueError(
        f"{_FLAG}.model={name!r}: cannot tell its kind from config.architectures={archs}; set "
        f"{_FLAG}.kind=sequence_classification or token_classification (a PRM read from a "
        f"causal LM's next-token logits, such as Math-Shepherd, goes in {_FLAG}.function)"
    )


class PRMScorer:
    """A frozen sequence- or token-classification PRM that scores prefixes (module docstring).

    ``scores(prompts, completions, ends) -> (values, forwarded)``: for every row, the
    probability of the positive class at each end offset (one list per row, in order), and the
    tokens run through the model (padding excluded)."""

    def __init__(self, options: ProcessRewardConfig, device: torch.device | str = "cpu") -> None:
        name = options.model
        self.options = options
        self.device = torch.device(device)
        try:
            config = AutoConfig.from_pretrained(name, trust_remote_code=False)
            self.tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"{_FLAG}.model={name!r}: cannot load it ({err}); give a local directory written "
                "by save_pretrained or a hub name"
            ) from err
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError(
                f"{_FLAG}.model={name!r}: its tokenizer is not a fast one; the PRM reads the "
                "token at each step's end through the fast tokenizer's offsets"
            )
        kind = options.kind if options.kind != "auto" else _kind_from_config(config, name)
        self.kind = kind
        cls = getattr(transformers, _KIND_CLASSES[kind])
        dtype = _DTYPES[options.dtype]
        model = cls.from_pretrained(name, dtype=dtype, trust_remote_code=False)
        # .to(dtype) too: older transformers read torch_dtype and ignore dtype
        self.model = model.to(self.device, dtype).eval().requires_grad_(False)
        if self.model.config.pad_token_id is None:
            pad = self.tokenizer.pad_token_id
            self.model.config.pad_token_id = pad if pad is not None else self.tokenizer.eos_token_id
        self.pad_id = self.model.config.pad_token_id
        self.num_labels = int(self.model.config.num_labels)
        self.positive = self._positive_index(options)
        self.max_length = options.max_length or self._model_limit()

    def _positive_index(self, options: ProcessRewardConfig) -> int:
        labels = self.num_labels
        if options.positive_label:
            label2id = {str(k): int(v) for k, v in (self.model.config.label2id or {}).items()}
            if options.positive_label not in label2id:
                raise ValueError(
                    f"{_FLAG}.positive_label={options.positive_label!r} is not a label of "
                    f"{options.model!r}; its labels: {', '.join(sorted(label2id)) or 'none'}"
                )
            return label2id[options.positive_label]
        index = options.positive_index
        if not -labels <= index < labels:
            raise ValueError(
                f"{_FLAG}.positive_index={index} is out of range for {options.model!r}, which "
                f"has {labels} output(s)"
            )
        return index % labels

    def _model_limit(self) -> int:
        limit = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(limit, int) and 0 < limit < 1_000_000:
            return limit
        positions = getattr(self.model.config, "max_position_embeddings", None)
        return int(positions) if positions else 0

    # -- inputs ------------------------------------------------------------------------------
    def _text(self, prompt: str, completion: str, ends: list[int]) -> tuple[str, list[int]]:
        """The model's input text for one completion and the character end of every step in it."""
        sep = self.options.prompt_separator
        head = prompt if (not sep or prompt.endswith(sep)) else prompt + sep
        pieces, starts = [], [0, *ends[:-1]]
        for a, b in zip(starts, ends):
            step = completion[a:b]
            if self.options.step_separator:
                step = step.rstrip() + self.options.step_separator
            pieces.append(step)
        text, out = head, []
        for piece in pieces:
            text += piece
            out.append(len(text))
        return text, out

    def _encode(self, text: str, ends: list[int]) -> tuple[list[int], list[int], bool]:
        """Token ids of ``text``, for every character end the position of the last real token
        that starts before it (the state's last token), and whether the ids were left-truncated
        to max_length."""
        enc = self.tokenizer(text, return_offsets_mapping=True, add_special_tokens=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        real = [i for i, (a, b) in enumerate(offsets) if b > a]
        positions, j = [], -1
        for e in ends:
            while j + 1 < len(real) and offsets[real[j + 1]][0] < e:
                j += 1
            positions.append(real[j] if j >= 0 else max(len(ids) - 1, 0))
        cut = len(ids) - self.max_length if self.max_length and len(ids) > self.max_length else 0
        return ids[cut:], [p - cut for p in positions], cut > 0

    def _items(
        self, prompts: list[str], completions: list[str], ends: list[list[int]]
    ) -> list[tuple[list[int], list[int], list[tuple[int, int]]]]:
        """``(ids, read positions, (row, index))`` per model input."""
        items = []
        for row, (prompt, completion, row_ends) in enumerate(zip(prompts, completions, ends)):
            if not row_ends:
                continue
            text, char_ends = self._text(prompt, completion, row_ends)
            if self.kind == "token_classification":
                ids, pos, cut = self._encode(text, char_ends)
                if not cut:
                    items.append((ids, pos, [(row, k) for k in range(len(pos))]))
                    continue
            for k, e in enumerate(char_ends):  # one input per prefix
                ids, pos, _ = self._encode(text[:e], [e])
                items.append((ids, [max(pos[0], 0)], [(row, k)]))
        return items

    def _chunks(self, lengths: list[int]) -> list[list[int]]:
        if self.pad_id is None:
            return [[i] for i in range(len(lengths))]
        return token_chunks(lengths, self.options.chunk_tokens)

    # -- scoring ------------------------------------------------------------------------------
    @torch.no_grad()
    def scores(
        self, prompts: list[str], completions: list[str], ends: list[list[int]]
    ) -> tuple[list[list[float]], int]:
        out = [[float("nan")] * len(e) for e in ends]
        items = self._items(prompts, completions, ends)
        forwarded = 0
        for chunk in self._chunks([len(it[0]) for it in items]):
            rows = [items[i] for i in chunk]
            L = max(len(ids) for ids, _, _ in rows)
            pad = self.pad_id if self.pad_id is not None else 0
            input_ids = torch.full((len(rows), L), pad, dtype=torch.long)
            mask = torch.zeros(len(rows), L, dtype=torch.long)
            for r, (ids, _, _) in enumerate(rows):
                input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                mask[r, : len(ids)] = 1
            forwarded += int(mask.sum())
            logits = self.model(
                input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)
            ).logits.float()
            probs = self._probabilities(logits).cpu()  # (rows,) or (rows, L): one transfer
            for r, (_, positions, keys) in enumerate(rows):
                for p, (row, k) in zip(positions, keys):
                    out[row][k] = float(probs[r] if probs.dim() == 1 else probs[r, p])
        return out, forwarded

    def _probabilities(self, logits: Tensor) -> Tensor:
        """The positive class's probability from ``(..., num_labels)`` logits."""
        if self.num_labels == 1:
            return torch.sigmoid(logits[..., 0])
        return torch.softmax(logits, dim=-1)[..., self.positive]


# ---------------------------------------------------------------------------------------------
# the credit method


@register_credit("process_reward", options=ProcessRewardConfig)
class ProcessRewardCredit(ValueSourceCredit):
    """Values from your step scores or a frozen PRM, with the value methods' guards (group-mean
    anchor, hand-over by measured reliability, safe normalisation; module docstring).

    ``rows`` scores the batch (:meth:`boundary_values`), ``estimate`` hands credit over by the
    guard's reliability (earned on earlier batches); ``update`` then scores those same values
    against the batch's outcomes."""

    def __init__(self, config, context: CreditContext) -> None:
        super().__init__(config, context)
        options: ProcessRewardConfig = self.options
        options.require_source()
        self.function = load_function(options.function) if options.function else None
        self.scorer = None if self.function else PRMScorer(options, context.device)
        self._stats: dict[str, float] = {}

    # -- values ---------------------------------------------------------------------------------
    def boundary_scores(self, batch: RolloutBatch) -> tuple[list[list[float]], dict[str, float]]:
        """Per row the scores ``V(s_1) .. V(s_{n-1})`` (the function's ``n``-th is checked and
        dropped; the model does not score ``s_n``), and the pass's statistics."""
        n_rows = batch.size
        prompts = [p.prompt for p in batch.problems] if batch.problems else [""] * n_rows
        ends = [segment_ends(batch, row) for row in range(n_rows)]
        if self.function is not None:
            name = self.options.function
            out, calls = [], 0
            for row in range(n_rows):
                if not ends[row]:
                    out.append([])
                    continue
                got = self.function(prompts[row], batch.completions[row], list(ends[row]))
                calls += 1
                out.append(check_scores(got, len(ends[row]), name, row)[:-1])
            return out, {"credit/prm_calls": float(calls), "credit/extra_forward_tokens": 0.0}
        interior = [e[:-1] for e in ends]
        out, forwarded = self.scorer.scores(prompts, batch.completions, interior)
        return out, {
            "credit/prm_calls": 0.0,
            "credit/extra_forward_tokens": float(forwarded),
        }

    def boundary_values(self, batch: RolloutBatch) -> tuple[Tensor, Tensor, dict[str, float]]:
        """``(values (B, S+1), mask (B, S+1), stats)``: ``V(s_0)`` the group's mean reward,
        ``V(s_k)`` the scores for ``0 < k < n``, ``V(s_n) = R``."""
        scores, stats = self.boundary_scores(batch)
        n = batch.num_segments
        S = int(n.max()) if len(n) else 0
        values = torch.zeros(batch.size, S + 1, dtype=torch.float)
        for row, row_scores in enumerate(scores):
            if row_scores:
                values[row, 1 : 1 + len(row_scores)] = torch.tensor(row_scores)
        mean, _ = group_mean_std(batch.rewards, batch.group_ids)
        values[:, 0] = mean.detach().float().cpu()
        rows = torch.arange(batch.size)
        values[rows, n] = batch.rewards.detach().float().cpu()
        mask = torch.arange(S + 1).unsqueeze(0) <= n.unsqueeze(1)
        scored = [v for r in scores for v in r]
        stats["credit/prm_boundaries"] = float(len(scored))
        stats["credit/prm_mean_value"] = sum(scored) / len(scored) if scored else float("nan")
        device = batch.rewards.device
        return values.to(device), mask.to(device), stats

    # -- the hand-over loop's hooks (:class:`ValueSourceCredit`) ---------------------------------
    def prepare_values(self, values: Tensor, mask: Tensor, group_mean: Tensor) -> Tensor:
        """No source scores the prompt: ``V(s_0)`` is the group's mean reward (groups may span
        processes, so it is set from the rewards credit sees, not from the scoring pass)."""
        values = values.clone()
        values[:, 0] = group_mean.to(values.device, values.dtype)
        return values

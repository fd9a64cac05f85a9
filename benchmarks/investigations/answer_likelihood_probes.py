"""Probe probabilities of a tiny model that thinks in tags (issue 14, item 2): the figures quoted in
docs/answer_likelihood.md, from the model and traces of
``tests/methods/test_answer_likelihood.py``.

    PYTHONPATH=src python benchmarks/investigations/answer_likelihood_probes.py

Prints, over 12 gold think traces, the mean value at the boundary right before ``</think>`` and
right after it, for the plain probe (the task's answer line right after the prefix), the
think-closing cue with the reference rendering only, and with the equivalent renderings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "methods")]  # its helpers, and the test module itself

from test_answer_likelihood import (  # noqa: E402
    _column_at,
    _think_batch,
    think_trace,
    train_think_model,
)

from rredcot.methods.answer_likelihood import answer_values  # noqa: E402
from rredcot.methods.answer_probes import ProbeFormat  # noqa: E402
from rredcot.models import build_char_tokenizer  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model, task = train_think_model(tok)
    problems = task.train_problems(12, seed=7)
    texts = [think_trace(task, p) for p in problems]
    batch = _think_batch(tok, task, problems, texts)
    rows = torch.arange(len(problems))
    before = [_column_at(batch, r, t.index("</think>")) for r, t in enumerate(texts)]
    after = [_column_at(batch, r, t.index("The final")) for r, t in enumerate(texts)]
    n = batch.num_segments
    inside = torch.arange(int(n.max()) + 1).unsqueeze(0) <= torch.tensor(before).unsqueeze(1)
    out = {}
    for name, probe in {
        "plain (task cue)": ProbeFormat("task"),
        "think cue, reference only": ProbeFormat("think", renderings=False),
        "think cue, with renderings": ProbeFormat("think", renderings=True),
    }.items():
        values, _, _ = answer_values(model, tok, task, batch, probe=probe)
        out[name] = {
            "V before </think> (mean)": round(float(values[rows, before].mean()), 4),
            "V after </think> (mean)": round(float(values[rows, after].mean()), 4),
            "max V inside the thought": float(values[inside].max()),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

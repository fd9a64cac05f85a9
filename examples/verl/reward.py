"""verl custom reward function: rredcot's GSM8K verifier (the number after ``####``).

verl calls ``compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)``
once per response (``reward.custom_reward_function.path`` points here).
"""

from __future__ import annotations

from rredcot.tasks import get_task
from rredcot.tasks.base import Problem, safe_verify

_TASK = get_task("gsm8k")  # verification needs no data; nothing is downloaded


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    question = (extra_info or {}).get("question", "")
    return float(safe_verify(_TASK, Problem(question, str(ground_truth)), solution_str).reward)

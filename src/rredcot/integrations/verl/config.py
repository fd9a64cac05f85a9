"""The names verl knows rredcot by (:data:`ESTIMATOR`, :data:`TRAINER_MODE`) and the settings
under ``algorithm.rredcot``: the credit method and its :class:`CreditConfig`, the tail floor, the
task and the segmenter. No verl import."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from rredcot.config import CreditConfig
from rredcot.config.io import from_dict
from rredcot.segment import Segmenter, segmenter_from_config
from rredcot.tasks import get_task, get_task_class

__all__ = [
    "ESTIMATOR",
    "INSTALL_VERL",
    "METHODS",
    "SETTINGS",
    "TRAINER_MODE",
    "credit_settings",
    "make_segmenter",
    "tail_floor_setting",
    "task_settings",
]


# what to install where verl is missing (require_extra's `then`, in every module that imports verl)
INSTALL_VERL = (
    "and then pip install --no-deps 'verl>=0.9,<0.10' (or install verl by its own instructions)"
)
ESTIMATOR = "rredcot"
TRAINER_MODE = "rredcot_sync"
METHODS = ("critic", "uniform", "answer_likelihood", "process_reward")
# the keys of algorithm.rredcot that are not CreditConfig fields, with their help
SETTINGS = {
    "credit_method": f"the value source: one of {', '.join(METHODS)} (default critic)",
    "task": "rredcot task name (answer_likelihood's probes are written by its render_answer)",
    "task_args": "parameters of the task, a mapping",
    "advantage_tail_floor": "drop the tail of each row's credit where it is smaller than this "
    "(as rredcot train --advantage_tail_floor): token advantages after a row's last token with "
    "|advantage| >= the floor are set to 0 (a row with none gets 0 everywhere); the critic's "
    "returns are unchanged. 0 (default): off. verl's actor still forwards every token",
}


def _settings_fields(config: Any) -> dict[str, Any]:
    raw = config.get("rredcot", None) if config is not None else None
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raw = dict(raw)  # an OmegaConf DictConfig
    return {str(k): v for k, v in raw.items()}


def credit_settings(config: Any = None) -> tuple[str, CreditConfig]:
    """``(credit_method, CreditConfig)`` from verl's algorithm config (``algorithm.rredcot``).

    ``config`` is verl's ``AlgoConfig``/``DictConfig`` (or a plain dict); its ``rredcot`` entry,
    if any, maps ``credit_method`` (``critic`` by default), ``task``/``task_args`` (for
    ``answer_likelihood``, :func:`task_settings`) and :class:`CreditConfig` fields.
    """
    fields = _settings_fields(config)
    method = str(fields.pop("credit_method", "critic"))
    for key in SETTINGS:
        fields.pop(key, None)
    if method not in METHODS:
        raise ValueError(
            f"algorithm.rredcot.credit_method={method!r}; valid in verl: {', '.join(METHODS)} "
            "(the value head needs the policy's hidden states, which verl's actor does not "
            "return: see docs/scaling.md)"
        )
    return method, from_dict(CreditConfig, fields, where="algorithm.rredcot.")


def tail_floor_setting(config: Any = None) -> float:
    """``algorithm.rredcot.advantage_tail_floor`` (:data:`SETTINGS`; default 0: off), checked to
    be a finite number >= 0."""
    raw = _settings_fields(config).get("advantage_tail_floor", 0.0)
    try:
        floor = float(raw)
    except (TypeError, ValueError):
        floor = float("nan")
    if not math.isfinite(floor) or floor < 0:
        raise ValueError(
            f"algorithm.rredcot.advantage_tail_floor={raw!r} must be a number >= 0 "
            "(0: keep every advantage)"
        )
    return floor


def task_settings(config: Any = None):
    """The rredcot task named by ``algorithm.rredcot.task`` (with ``task_args``), or None. The
    answer-likelihood probes are written by its ``render_answer``."""
    fields = _settings_fields(config)
    name = fields.get("task")
    if not name:
        return None
    args = fields.get("task_args") or {}
    return get_task(str(name), **{str(k): v for k, v in dict(args).items()})


def make_segmenter(cfg: CreditConfig, config: Any = None) -> Segmenter:
    """The estimator's segmenter (``segment.segmenter_from_config``), with the answer line of the
    task ``algorithm.rredcot.task`` names, if any (read from its class: no task is built)."""
    name = _settings_fields(config).get("task")
    pattern = get_task_class(str(name)).answer_line_pattern if name else None
    return segmenter_from_config(cfg, pattern)

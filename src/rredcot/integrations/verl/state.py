"""What the estimator keeps on verl's driver between calls: one credit method per
``(credit_method, settings)``, built from the registry on first use (:func:`method_for`), until
:func:`reset_methods` forgets them. No verl import."""

from __future__ import annotations

from typing import Any

from rredcot.config import CreditConfig
from rredcot.integrations.verl.config import task_settings
from rredcot.methods.base import CreditContext, CreditMethod, build_credit

__all__ = ["method_for", "reset_methods"]


_METHODS: dict[tuple, CreditMethod] = {}


def reset_methods() -> None:
    """Forget the credit methods kept between estimator calls (their earned hand-over weights):
    the next call starts from GRPO's credit, as a new training run does."""
    _METHODS.clear()


def method_for(name: str, cfg: CreditConfig, config: Any) -> CreditMethod:
    """The credit method of these settings, from the registry, kept across steps on the driver:
    verl calls the estimator as a function once per step, and the method's state (a hand-over's
    reliability) must persist between the calls."""
    key = (name, repr(cfg))
    if key not in _METHODS:
        task = task_settings(config)
        if name == "answer_likelihood" and task is None:
            raise ValueError(
                "algorithm.rredcot.credit_method=answer_likelihood needs "
                "+algorithm.rredcot.task=NAME (e.g. gsm8k): its render_answer writes the probes"
            )
        # on the driver: a process reward function runs where verl's driver does, a PRM on its CPU
        context = CreditContext(policy=None, tokenizer=None, task=task)
        _METHODS[key] = build_credit(name, cfg, context)
    return _METHODS[key]

"""rredcot: segment-level credit assignment for RL fine-tuning of chain-of-thought models.

The package by role (docs/architecture.md): ``algebra`` (the credit algebra, pure tensors),
``segment``, ``tasks``, ``sampling`` (the engine: a segmented, verified batch), ``methods`` (value
estimators behind one registry), ``training`` (``rredcot train`` and ``sft``), ``explain``,
``diagnose``, ``bench``, ``integrations`` (TRL, verl), ``config`` and ``cli``."""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

# The modules' paths before the packages by role (0.1.0 of 2026-12-05), and later moves: an old
# import still works, as the module at its new place.
_MOVED = {
    "batch": "sampling.batch",
    "checkpoint": "training.checkpoint",
    "cli_diagnose": "cli.diagnose",
    "cli_explain": "cli.explain",
    "cli_segment": "cli.segment",
    "cli_train": "cli.train",
    "config_io": "config.io",
    "credit": "algebra.credit",
    "credit_choice": "methods.auto",
    "credit_scores": "explain.scores",
    "credit_settings": "methods.settings",
    "decode": "sampling.decode",
    "diagnose_config": "config.diagnose",
    "evaluation": "training.evaluation",
    "integrations.trl.gather": "methods.processes",
    "explain_model": "explain.model",
    "localisation": "algebra.localisation",
    "loss": "algebra.loss",
    "memory": "sampling.memory",
    "normalization": "algebra.normalization",
    "plots": "training.plots",
    "references": "training.references",
    "rollout": "sampling.rollout",
    "runio": "training.runio",
    "seeding": "training.seeding",
    "sft": "training.sft",
    "shared_prefixes": "algebra.shared_prefixes",
    "shared_prompt": "sampling.shared_prompt",
    "tensor_checks": "algebra.tensor_checks",
    "train_setup": "training.setup",
    "trainer": "training.trainer",
    "tree": "sampling.tree",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``rredcot.<old>`` as the module at its new path (the same module object)."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix(__name__ + ".")
        if fullname.startswith(__name__ + ".") and old in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(f"{__name__}.{_MOVED[spec.name.split('.', 1)[1]]}")

    def exec_module(self, module):
        pass


sys.meta_path.append(_MovedModules())

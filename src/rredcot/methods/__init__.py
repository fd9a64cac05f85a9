"""Credit methods behind one registry (:mod:`rredcot.methods.base`: ``register_credit``,
``get_credit``, ``credit_names``).

Torch-free: :data:`BUILTIN_CREDIT_METHODS` (defined in ``rredcot.config``, which writes
``--credit_method``'s help from it) names every built-in method with the module that registers
it, imported on first use (``rredcot train --help`` starts without torch)."""

from rredcot.config import BUILTIN_CREDIT_METHODS

__all__ = ["BUILTIN_CREDIT_METHODS"]

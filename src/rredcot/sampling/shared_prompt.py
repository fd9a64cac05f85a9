"""The shared-prompt forward's path before it joined :mod:`rredcot.sampling.forward` (where
``shared_prompt_forward`` and ``shared_prompt_unsupported_reason`` are these ``forward`` and
``unsupported_reason``)."""

from rredcot.sampling.forward import prompt_groups
from rredcot.sampling.forward import shared_prompt_forward as forward
from rredcot.sampling.forward import shared_prompt_unsupported_reason as unsupported_reason

__all__ = ["forward", "prompt_groups", "unsupported_reason"]

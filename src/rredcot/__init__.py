"""rredcot: segment-level credit assignment for RL fine-tuning of chain-of-thought models."""

__version__ = "0.1.0"

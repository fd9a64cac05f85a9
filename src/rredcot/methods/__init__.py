"""Credit methods behind one registry (:mod:`rredcot.methods.base`: ``register_credit``,
``get_credit``, ``credit_names``).

Torch-free: :data:`BUILTIN_CREDIT_METHODS` names every built-in method with the module that
registers it, so that ``rredcot.config`` writes ``--credit_method``'s help from it without
importing a method (``rredcot train --help`` starts without torch)."""

BUILTIN_CREDIT_METHODS: dict[str, str] = {
    "uniform": "rredcot.methods.base",
    "node_values": "rredcot.methods.base",
    "value_head": "rredcot.methods.value_head",
    "answer_likelihood": "rredcot.methods.answer_likelihood",
    "continuation_likelihood": "rredcot.methods.continuation_likelihood",
    "process_reward": "rredcot.methods.process_reward",
    "monte_carlo": "rredcot.methods.monte_carlo",
    "gradient": "rredcot.methods.attribution",
    "attention": "rredcot.methods.attribution",
    "first_last": "rredcot.methods.attribution",
    "oracle": "rredcot.methods.oracle",  # benchmark only: reads the verifier's step labels
}
"""Built-in credit method -> the module that registers it (imported on first use)."""

"""rredcot credit inside TRL's ``GRPOTrainer`` (``pip install 'rredcot[trl]'``).

TRL keeps everything it does well: sampling (transformers or vLLM), reward functions, datasets,
the clipped loss, ``accelerate launch`` / DeepSpeed / FSDP, logging and checkpoints. This adapter
changes the advantages (and, with ``references`` on, adds their terms to the loss). TRL 1.16
computes one advantage per completion at the end of
``GRPOTrainer._generate_and_score_completions``; :class:`RREDCoTGRPOTrainer` lets that method run
unchanged, then replaces ``output["advantages"]`` with rredcot's ``(B, T)`` token advantages, which
TRL's ``_compute_loss`` takes as they are (it unsqueezes only 1-D ones).

Once per generation batch the credit runs the stages of ``rredcot train``'s step
(:mod:`rredcot.methods.base`), with the batch split across processes as TRL splits it:

1. rows: each process decodes and segments its completions (:mod:`rredcot.integrations._batch`),
   their outcome ``R`` being the weighted sum of TRL's reward functions (gathered by TRL, before
   its scaling; ``multi_objective_aggregation="sum_then_normalize"``), and the method measures its
   own rows (``method.rows``); the rows of every process are gathered (groups may span them);
2. ``method.estimate`` over every row;
3-4. ``method.credit_output``: the segment stage and the scale over every row, the token stage on
   this process's rows (``scale_rewards`` maps onto the normalisation:
   :func:`normalization_for_scale_rewards`);
5. in training, ``method.update`` over the gathered rows, after the credit.

The defaults are ``rredcot train``'s: ``credit_method="auto"`` chooses on the first generation
batch's own rollouts, by the same rule (:mod:`rredcot.methods.auto`), and every unset ``credit``
field keeps :class:`rredcot.config.CreditConfig`'s default. The choice is written beside every
checkpoint (``rredcot_credit.json``) and read back on resume, and the method's state (the value
head) as ``value_head.pt``.

The value head's hidden states and log-probs come from a forward that runs anyway where one does,
as in ``rredcot train``: TRL's no-grad old-log-prob pass when it runs one; else, where a
generation batch is one micro-batch (``steps_per_generation=1``; evaluation), its loss forward
(the trainer's single pass: the credit is formed between that forward and the loss); else (several
micro-batches, or the Liger loss) one no-grad forward of the adapter's own, as the trainer's
scoring pass under gradient accumulation (``rredcot/extra_forward`` = 1).

``references`` (issue 40's baselines, :mod:`rredcot.training.references`; needs ``task``; any processes)
trains on the task's reference solutions (``task.gold_completion`` of each row's problem) in the
groups ``references.groups`` chooses (default: no completion with outcome ``R >= 1``), on training
batches only. ``sft``: ``sft_coef`` times the references' NLL, aggregated as ``loss_type``
aggregates (:data:`config.LOSS_AGG_OF_LOSS_TYPE`), is added to the loss in shares over the generation
batch's micro-batches: once per optimiser step with TRL's defaults, as ``rredcot train`` adds it.
``luffy``: LUFFY's own recipe, which fits TRL's ``G`` rows per prompt: the reference takes the
place of the group's last rollout (``rredcot train`` appends it as a ``G + 1``-th row and drops
no sample), its reward is the reward functions' on it, the credit method's advantages are
computed with it, and its tokens are trained with the shaped, unclipped ``-A * f(pi)`` while TRL's
loss covers the other rows. ``bread`` is refused: its branched rollouts need a generation TRL's
step does not run.

The package, by concern: :mod:`.config` (:class:`RREDCoTGRPOConfig`), :mod:`.rewards` (reward
functions from tasks, each completion's ``R``), :mod:`.forward` (hidden states and the adapter's
own forwards), :mod:`.gather` (the rows of every process), :mod:`.references` (sft and luffy),
:mod:`.state` (the credit's state beside TRL's checkpoints) and :mod:`.trainer`
(:class:`RREDCoTGRPOTrainer`; the TRL internals it depends on, :data:`OVERRIDDEN_TRL_METHODS`).
"""

from rredcot.integrations.saved import CREDIT_STATE_FILE
from rredcot.integrations.trl.config import (
    LOSS_AGG_OF_LOSS_TYPE,
    METRICS_PREFIX,
    REFERENCE_LOSS_TYPES,
    TRL_METHODS,
    RREDCoTGRPOConfig,
    normalization_for_scale_rewards,
    resolve_model,
)
from rredcot.integrations.trl.rewards import reference_answer, task_reward
from rredcot.integrations.trl.trainer import OVERRIDDEN_TRL_METHODS, RREDCoTGRPOTrainer

__all__ = [
    "CREDIT_STATE_FILE",
    "LOSS_AGG_OF_LOSS_TYPE",
    "METRICS_PREFIX",
    "OVERRIDDEN_TRL_METHODS",
    "REFERENCE_LOSS_TYPES",
    "TRL_METHODS",
    "RREDCoTGRPOConfig",
    "RREDCoTGRPOTrainer",
    "normalization_for_scale_rewards",
    "reference_answer",
    "resolve_model",
    "task_reward",
]

"""rredcot credit as a verl advantage estimator (``algorithm.adv_estimator=rredcot``).

verl keeps the model, the rollout engines (vLLM/SGLang), FSDP/Megatron sharding, the critic and
Ray. This module adds two things, both loaded in every verl process through
``VERL_USE_EXTERNAL_MODULES=rredcot.integrations.verl``:

1. an advantage estimator registered as ``rredcot`` in verl's registry
   (``verl.trainer.ppo.core_algos.register_adv_est``): :func:`compute_rredcot_advantage`, a
   function over verl's token tensors that runs rredcot's credit algebra (what it keeps between
   calls: see "State" below);
2. the trainer-side hook it needs. verl's ``compute_advantage`` hands a custom estimator only
   ``token_level_rewards``, ``response_mask``, ``index`` (the prompt ``uid``) and the algorithm
   ``config``: no response ids (so no segments) and no critic values. The hook segments the
   responses with :mod:`rredcot.segment` and makes the segment ids (and the critic's values)
   visible to the estimator for the duration of one ``compute_advantage`` call
   (:func:`rredcot_segments`). For verl's default v1 trainer it is the trainer mode
   ``rredcot_sync`` (``trainer.v1.trainer_mode=rredcot_sync``), a ``PPOTrainerSync`` whose
   ``_compute_advantage`` fetches ``responses`` from the TransferQueue and then runs verl's own
   ``_compute_advantage`` inside that context. Code that holds a full ``DataProto`` (the legacy
   ``RayPPOTrainer``, custom loops) calls :func:`compute_advantage_for_data` instead.

Values. Where rredcot's own loop and TRL use the small value head or answer likelihood, verl's
driver holds no model: the value estimate here is **verl's critic** (``critic.enable=True``), a
full value model that verl shards and trains itself. Its per-token values ``values[:, t] =
V(prompt + response[:t])`` give ``V(s_k) = values[:, b_k]`` at every segment start, and the
estimator returns TD(``value_head.td_lambda``) targets at segment starts as the critic's ``returns``
(``value_head.td_lambda = 1``, the default: every token regresses on ``R``). Credit methods:

- ``critic``: segment values from the critic, ``A_k`` by segment GAE with ``lam``, with the guards
  of every rredcot value source (:class:`CriticCredit`): anchored on the group's mean reward and
  handed over from uniform (GRPO) credit by the critic's reliability, measured on each step's
  outcomes after that step's credit (so the first step is GRPO's;
  ``+algorithm.rredcot.handover.mode=off`` uses the critic's credit at full weight);
- ``uniform``: GRPO through rredcot's algebra (no critic needed);
- ``answer_likelihood``: the actor's probability of a correct answer after each prefix, probed
  through its own ``compute_log_prob`` (:func:`build_probe_data`, :func:`probe_values`);
- ``process_reward``: your step scores or a frozen Hugging Face PRM
  (``algorithm.rredcot.process_reward.*``), run on the driver over the decoded prompts and
  responses (:func:`process_reward_values`; :func:`compute_advantage_for_data` calls it), with
  the method's measured hand-over updated after each step's credit.

Settings live under ``algorithm.rredcot`` (fields of :class:`rredcot.config.CreditConfig` plus
the keys of :data:`SETTINGS`: ``credit_method``, ``task``, ``task_args``,
``advantage_tail_floor``), e.g. ``+algorithm.rredcot.segmenter=sentence
+algorithm.rredcot.lam=0.5``.

State. The estimator is not a pure function. In the process that calls it (verl's driver) it
keeps, across calls, one credit method per ``(credit_method, settings)`` in :mod:`.state`'s
``_METHODS``, built from the registry on first use: the guard of a value source (``critic``,
``answer_likelihood``, ``process_reward``) carries its reliability, the next step's hand-over
weight, from one step to the next (``uniform`` learns nothing; its instance is kept too).
:func:`reset_methods` forgets them (a second training run in the same process). The context
variable behind :func:`rredcot_segments` holds one batch's segment ids and values only inside
that ``with`` block, and is reset when it ends.

The package, by concern (each part imports only parts named before it): :mod:`.config` (the
names and the settings under ``algorithm.rredcot``), :mod:`.segments` (segment ids from response
ids, and boundaries from them), :mod:`.state` (the credit methods kept between calls),
:mod:`.estimator` (the registered estimator, :func:`rredcot_segments` and :class:`CriticCredit`),
:mod:`.values` (answer-likelihood probes and process-reward scores computed on the driver) and
:mod:`.trainer` (:func:`compute_advantage_for_data` and the ``rredcot_sync`` trainer mode).
Importing the package registers the estimator, ``CriticCredit`` and the trainer mode, once.
"""

from rredcot.integrations.verl.config import (
    ESTIMATOR,
    METHODS,
    SETTINGS,
    TRAINER_MODE,
    credit_settings,
    make_segmenter,
    tail_floor_setting,
    task_settings,
)
from rredcot.integrations.verl.estimator import (
    CriticCredit,
    compute_rredcot_advantage,
    critic_boundary_values,
    dense_prefix_rewards,
    rredcot_segments,
)
from rredcot.integrations.verl.segments import (
    boundaries_from_segment_ids,
    num_segments_of,
    segment_responses,
)
from rredcot.integrations.verl.state import reset_methods
from rredcot.integrations.verl.trainer import RREDCoTPPOTrainerSync, compute_advantage_for_data
from rredcot.integrations.verl.values import build_probe_data, probe_values, process_reward_values

__all__ = [
    "CriticCredit",
    "ESTIMATOR",
    "METHODS",
    "TRAINER_MODE",
    "compute_advantage_for_data",
    "compute_rredcot_advantage",
    "credit_settings",
    "rredcot_segments",
    "build_probe_data",
    "dense_prefix_rewards",
    "num_segments_of",
    "probe_values",
    "process_reward_values",
    "reset_methods",
    "segment_responses",
    "SETTINGS",
    "tail_floor_setting",
    "task_settings",
    # public names of the former module that its __all__ did not list
    "RREDCoTPPOTrainerSync",
    "boundaries_from_segment_ids",
    "critic_boundary_values",
    "make_segmenter",
]

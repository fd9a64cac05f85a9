"""The trainer side: :func:`compute_advantage_for_data` for code that holds a full
``DataProto`` (the legacy ``RayPPOTrainer``, custom loops), and the v1 trainer mode
``rredcot_sync`` (:data:`RREDCoTPPOTrainerSync`, registered on import where verl's v1 trainer
imports), both segmenting the responses before verl's ``compute_advantage`` runs."""

from __future__ import annotations

import logging
from typing import Any

from torch import Tensor

from rredcot.errors import require_extra
from rredcot.integrations._batch import METRICS_PREFIX
from rredcot.integrations.verl.config import (
    ESTIMATOR,
    INSTALL_VERL,
    TRAINER_MODE,
    credit_settings,
    make_segmenter,
)
from rredcot.integrations.verl.estimator import rredcot_segments
from rredcot.integrations.verl.segments import segment_responses
from rredcot.integrations.verl.values import process_reward_values

core_algos = require_extra(
    "verl.trainer.ppo.core_algos", "verl", "rredcot.integrations.verl", then=INSTALL_VERL
)

__all__ = ["RREDCoTPPOTrainerSync", "compute_advantage_for_data"]

logger = logging.getLogger(__name__)


def compute_advantage_for_data(
    data, tokenizer, config: Any = None, boundary_values: Tensor | None = None
):
    """rredcot advantages for a full verl ``DataProto``, written to ``data.batch["advantages"]``
    and ``["returns"]``: segments ``responses``, reads the critic's ``values`` if present and calls
    the estimator through verl's registry. For the legacy ``RayPPOTrainer`` and custom loops (the
    v1 trainer uses the ``rredcot_sync`` trainer mode instead). ``boundary_values (B, S+1)``:
    the answer-likelihood values from :func:`probe_values`; for ``process_reward`` they are
    computed here when not given (:func:`process_reward_values`)."""
    method, cfg = credit_settings(config)
    if method == "process_reward" and boundary_values is None:
        boundary_values = process_reward_values(data, tokenizer, config)
    batch = data.batch
    if "response_mask" not in batch.keys():  # noqa: SIM118 - TensorDict has no `in`
        raise ValueError("data.batch needs 'response_mask' (verl's compute_response_mask)")
    segment_ids = segment_responses(
        batch["responses"],
        batch["response_mask"],
        tokenizer,
        make_segmenter(cfg, config),
    )
    values = batch["values"] if "values" in batch.keys() else None  # noqa: SIM118
    estimator = core_algos.get_adv_estimator_fn(ESTIMATOR)
    with rredcot_segments(segment_ids, values, boundary_values):
        advantages, returns = estimator(
            token_level_rewards=batch["token_level_rewards"],
            response_mask=batch["response_mask"],
            index=data.non_tensor_batch.get("uid"),
            config=config,
        )
    batch["advantages"] = advantages
    batch["returns"] = returns
    return data


def _register_trainer() -> type | None:
    """Register ``trainer.v1.trainer_mode=rredcot_sync`` when verl's v1 trainer imports (a full
    verl install: TransferQueue, Ray, the rollout servers); a core-only install skips it."""
    try:
        import transfer_queue as tq
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
        from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    except ModuleNotFoundError as err:  # a core-only install (pip install 'rredcot[verl]')
        logger.debug("rredcot: verl's v1 trainer is not installed (%s); no %s", err, TRAINER_MODE)
        return None
    except ImportError as err:  # installed but broken: say so, the estimator still works
        logger.warning("rredcot: cannot import verl's v1 trainer (%s); no %s", err, TRAINER_MODE)
        return None
    if TRAINER_MODE in TRAINER_REGISTRY:
        return TRAINER_REGISTRY[TRAINER_MODE]

    @register_trainer(TRAINER_MODE)
    class RREDCoTPPOTrainerSync(PPOTrainerSync):
        """verl's synchronous v1 trainer; with ``algorithm.adv_estimator=rredcot`` it segments
        the responses before verl's own ``_compute_advantage`` runs."""

        def _compute_advantage(self, batch, metrics):
            if str(self.config.algorithm.adv_estimator) != ESTIMATOR:
                return super()._compute_advantage(batch, metrics)
            method, cfg = credit_settings(self.config.algorithm)
            fields = ["responses", "response_mask"] + (["values"] if method == "critic" else [])
            data = tq.kv_batch_get(
                keys=batch.keys, partition_id=batch.partition_id, select_fields=fields
            ).to_padded_tensor()
            segment_ids = segment_responses(
                data["responses"],
                data["response_mask"],
                self.tokenizer,
                make_segmenter(cfg, self.config.algorithm),
            )
            values = data["values"] if "values" in data.keys() else None  # noqa: SIM118
            metrics[f"{METRICS_PREFIX}mean_segments"] = float(
                (segment_ids.max(dim=1).values + 1).float().mean()
            )
            with rredcot_segments(segment_ids, values):
                return super()._compute_advantage(batch, metrics)

    return RREDCoTPPOTrainerSync


RREDCoTPPOTrainerSync = _register_trainer()

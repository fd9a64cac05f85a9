"""The configuration schema: one dataclass per part of a run, nested as the YAML file and the flags.

Every field carries its help text in ``field(metadata={"help": ...})`` (``help_field``) and each
dataclass validates itself in ``__post_init__``. Torch-free, so that the CLI builds every flag
without importing a method. One module per section; this package's names are the public
interface: import them from ``rredcot.config``.

- ``fields``: ``help_field`` and the checks many configs share (finite numbers, seeds, threads,
  output paths).
- ``model``: ``ModelConfig`` (``model.*``) and ``MODEL_DEFAULTS``.
- ``sampling``: ``SamplingConfig`` (``sampling.*``) and ``TreeSamplingConfig``
  (``sampling.tree.*``).
- ``method_options``: each credit method's own options (``ValueHeadConfig``, ...), registered
  with the method.
- ``credit``: ``CreditConfig`` (``credit.*``), which nests them and the shared sections
  (``HandoverConfig``, ``ReweightConfig``), and ``BUILTIN_CREDIT_METHODS``.
- ``references``: ``ReferencesConfig`` (``references.*``).
- ``train``: ``TrainConfig``, which nests the sections above and checks what spans them, and
  ``RESUMABLE_FIELDS``; ``sft``: ``SFTConfig``.
- ``io`` maps these dataclasses to YAML files and CLI flags and back; ``diagnose`` holds
  ``rredcot diagnose``'s config.
"""

from rredcot.config.credit import (
    BUILTIN_CREDIT_METHODS,
    CreditConfig,
    HandoverConfig,
    ReweightConfig,
)
from rredcot.config.fields import (
    MAX_THREADS,
    SEED_RANGE,
    help_field,
    refuse_bad_seed,
    refuse_bad_threads,
    refuse_blank_path,
    refuse_non_finite,
)
from rredcot.config.method_options import (
    CODE_SETTINGS,
    CONTINUATION_SCOPES,
    HEAD_BYTES_PER_WEIGHT,
    ORACLE_ENDED_UNLABELLED,
    ORACLE_VALUES,
    PROCESS_REWARD_KINDS,
    VALUE_TEACHERS,
    AnswerLikelihoodConfig,
    ContinuationLikelihoodConfig,
    MonteCarloConfig,
    OracleConfig,
    ProcessRewardConfig,
    ValueHeadConfig,
)
from rredcot.config.model import MODEL_DEFAULTS, TINY_WARMSTARTS, ModelConfig
from rredcot.config.references import REFERENCE_GROUPS, REFERENCE_MODES, ReferencesConfig
from rredcot.config.sampling import (
    DECODERS,
    FORK_RULES,
    SHARED_TOKEN_WEIGHTS,
    SamplingConfig,
    TreeSamplingConfig,
)
from rredcot.config.sft import SFTConfig
from rredcot.config.train import RESUMABLE_FIELDS, TASK_HELP, TrainConfig

__all__ = [
    "BUILTIN_CREDIT_METHODS",
    "CODE_SETTINGS",
    "CONTINUATION_SCOPES",
    "DECODERS",
    "FORK_RULES",
    "HEAD_BYTES_PER_WEIGHT",
    "MAX_THREADS",
    "MODEL_DEFAULTS",
    "ORACLE_ENDED_UNLABELLED",
    "ORACLE_VALUES",
    "PROCESS_REWARD_KINDS",
    "REFERENCE_GROUPS",
    "REFERENCE_MODES",
    "RESUMABLE_FIELDS",
    "SEED_RANGE",
    "SHARED_TOKEN_WEIGHTS",
    "TASK_HELP",
    "TINY_WARMSTARTS",
    "VALUE_TEACHERS",
    "AnswerLikelihoodConfig",
    "ContinuationLikelihoodConfig",
    "CreditConfig",
    "HandoverConfig",
    "ModelConfig",
    "MonteCarloConfig",
    "OracleConfig",
    "ProcessRewardConfig",
    "ReferencesConfig",
    "ReweightConfig",
    "SFTConfig",
    "SamplingConfig",
    "TrainConfig",
    "TreeSamplingConfig",
    "ValueHeadConfig",
    "help_field",
    "refuse_bad_seed",
    "refuse_bad_threads",
    "refuse_blank_path",
    "refuse_non_finite",
]

"""``rredcot diagnose``: will finer credit help this run? An answer before anyone pays for it.

Read top to bottom (every figure is defined in docs/diagnose.md):

1. Sample ``P`` held-out prompts x ``G`` completions from a frozen policy at the run's sampling
   settings, verify and segment them (the final answer line always its own segment), and read
   each sampled token's probability ``p(y_t)`` and the policy's entropy at the sampling
   temperature (one no-grad forward, as the loss scores them).
2. **Where GRPO is blind**: the share of groups whose rewards all agree (all wrong, all right),
   at ``G`` and at smaller group sizes ``G'`` computed exactly over every ``G'``-subset of each
   prompt's samples (:func:`agreement_by_group_size`).
3. **Where GRPO's update lands**: on the traces of groups whose rewards differ, each token's
   share of GRPO's logit-gradient mass ``|A| (1 - p(y_t))`` (:func:`grpo_gradient_mass`: the
   gradient of ``log p(y_t)`` with respect to the logits is ``e_y - p``, whose size is about
   ``1 - p(y_t)``), against its share of the tokens, per segment kind (correct prefix, first
   wrong step, after the error, answer line: :func:`token_kinds`, from the verifier's
   ``first_error_step`` where the task has step labels), per segment position and per relative
   position along the trace; the entropy along the trace and the uncertain decisions per trace
   (tokens with ``p(y_t) < uncertain_p``).
4. **What better credit could change**: on a seeded random subset, Monte Carlo values at every
   segment boundary (:func:`rredcot.methods.monte_carlo.mc_values`, cost printed and capped
   first), and from them the share of the per-token advantage's mean square that step-level
   credit removes and the blame GRPO puts on the still-right prefix of wrong traces
   (:func:`step_credit_figures`).
5. Optionally, cheap estimators (a run's value head, answer likelihood, a process reward function
   or model) scored against the Monte Carlo values by the scoring the credit benchmark uses
   (:mod:`rredcot.explain.scores`).
6. A verdict in plain words with its reasons (:func:`verdict`), the figures as JSON and a picture.

Intervals: Clopper-Pearson (``scipy.stats.binomtest``, exact) on the share of agreeing groups at
``G`` (one Bernoulli outcome per prompt); a percentile bootstrap over prompts (the unit that was
sampled independently) on every other share, mean and ratio; over traces for the Monte Carlo
figures (the subset's traces come from different prompts).

The Python API is :func:`diagnose` (a loaded policy) and :func:`diagnose_source` (what the CLI
calls: loads the policy from a path, alias or run directory first); both return a
:class:`DiagnoseReport` (``.to_json()``, ``.summary()``, ``.write(out_dir)``).

The package's modules, each importing only those above it: :mod:`.figures` (the pure figures),
:mod:`.verdict` (the verdict and its reasons), :mod:`.report` (the report, its summary and its
picture), :mod:`.measure` (sampling, Monte Carlo, the estimators; :func:`diagnose`).
"""

from rredcot.config.diagnose import DiagnoseConfig
from rredcot.diagnose.figures import (
    CONFIDENCE,
    KIND,
    KINDS,
    Chunk,
    agreement_by_group_size,
    chunk_from_batch,
    clopper_pearson,
    gradient_figures,
    grpo_advantages,
    grpo_gradient_mass,
    label_shares,
    per_unit_sums,
    ratio_interval,
    row_kind_inputs,
    step_credit_figures,
    token_kinds,
    trace_figures,
)
from rredcot.diagnose.measure import (
    LOGIT_BUDGET,
    diagnose,
    diagnose_source,
    estimator_specs,
    token_probabilities,
)
from rredcot.diagnose.report import DiagnoseReport, plot_report, summary_text
from rredcot.diagnose.verdict import verdict

__all__ = [
    "CONFIDENCE",
    "KIND",
    "KINDS",
    "LOGIT_BUDGET",
    "Chunk",
    "DiagnoseConfig",
    "DiagnoseReport",
    "agreement_by_group_size",
    "chunk_from_batch",
    "clopper_pearson",
    "diagnose",
    "diagnose_source",
    "estimator_specs",
    "gradient_figures",
    "grpo_advantages",
    "grpo_gradient_mass",
    "label_shares",
    "per_unit_sums",
    "plot_report",
    "ratio_interval",
    "row_kind_inputs",
    "step_credit_figures",
    "summary_text",
    "token_kinds",
    "token_probabilities",
    "trace_figures",
    "verdict",
]

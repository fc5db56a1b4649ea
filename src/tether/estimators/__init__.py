"""tether's estimator library: objectives x mismatch corrections x centering.

    loss = aggregate_t( w_mm[t] * l_obj[t] + center[t] )

The objective handles policy staleness (pi_theta against pi_old), the correction handles
numerical mismatch (pi_old against mu), centering is DLC's additive numerical term.
See DESIGN.md section 3 and docs/estimators.md.
"""

# Importing the family modules registers their objectives and corrections.
from tether.estimators import (  # noqa: F401
    cis,
    cispo,
    gspo,
    masking,
    pg,
    ppo,
    sapo,
    stale_is,
    truncation,
    vespo,
)
from tether.estimators.base import (
    AGGREGATIONS,
    SAFETY_BOUND,
    CorrectionTerms,
    LossOutput,
    ObjectiveTerms,
    TokenBatch,
    aggregate,
)
from tether.estimators.ess import ess, ess_seq, ess_token
from tether.estimators.estimator import Estimator, build_estimator
from tether.estimators.presets import PRESETS, Preset, format_presets_table, presets_rows
from tether.estimators.registry import CORRECTIONS, OBJECTIVES, Registry

__all__ = [
    "AGGREGATIONS",
    "CORRECTIONS",
    "OBJECTIVES",
    "PRESETS",
    "SAFETY_BOUND",
    "CorrectionTerms",
    "Estimator",
    "LossOutput",
    "ObjectiveTerms",
    "Preset",
    "Registry",
    "TokenBatch",
    "aggregate",
    "build_estimator",
    "ess",
    "ess_seq",
    "ess_token",
    "format_presets_table",
    "presets_rows",
]

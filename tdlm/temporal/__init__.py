"""The method: temporal attention over a position's own earlier hidden states (Eq. 7-10,
:mod:`tdlm.temporal.attention`), the TDLM wrapper around a frozen backbone (Eq. 2, parallel and step-wise modes,
:mod:`tdlm.temporal.model`), history policies and the temporal cache (Table 2, :mod:`tdlm.temporal.history`), the
storage plans of the step-wise history (:mod:`tdlm.temporal.storage`), the Perceiver latent history
(:mod:`tdlm.temporal.perceiver`) and the adapter's files (:mod:`tdlm.temporal.adapter_files`).
"""

from tdlm.temporal.attention import TemporalAttention, resolve_layers, temporal_parameter_count
from tdlm.temporal.history import HistoryPolicy, TemporalCache
from tdlm.temporal.model import TDLM, TemporalConfig

__all__ = ["TDLM", "HistoryPolicy", "TemporalAttention", "TemporalCache", "TemporalConfig", "resolve_layers",
           "temporal_parameter_count"]

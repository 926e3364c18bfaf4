"""Decoding: the one blockwise loop for every policy (original, threshold, entropy, tdlm, and dInfer's training-free
credit and soft of :mod:`tdlm.decoding.reuse`) and cache mode (:mod:`tdlm.decoding.loop`), and the prediction-history
diagnostic (:mod:`tdlm.decoding.prediction_history`)."""

from tdlm.decoding.loop import CACHE_MODES, POLICIES, STORAGE_PLANS, DecodeConfig, DecodeResult, decode

__all__ = ["CACHE_MODES", "POLICIES", "STORAGE_PLANS", "DecodeConfig", "DecodeResult", "decode"]

"""The Hub layer: adapter repositories with generated model cards (``save_pretrained``, ``push_to_hub``, the card's
evaluation table). It sits above the evaluator, whose results fill the card; the model itself never imports it (the
card is rendered by :mod:`tdlm.temporal.card`, which ``TDLM.save_pretrained`` uses too).

Commands: ``python -m tdlm.hub card|push ...`` (:mod:`tdlm.hub.pretrained`).
"""

from tdlm.hub.pretrained import evaluation_runs, push_to_hub, save_pretrained, upload_adapter_folder, write_model_card
from tdlm.temporal.adapter_files import resolve_adapter as resolve
from tdlm.temporal.card import model_card

__all__ = ["evaluation_runs", "model_card", "push_to_hub", "resolve", "save_pretrained", "upload_adapter_folder",
           "write_model_card"]

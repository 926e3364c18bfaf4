"""Native backbone implementations (LLaDA, Dream) and their loading."""

from tdlm.models.common import Backbone
from tdlm.models.dream import Dream, DreamConfig
from tdlm.models.llada import LLaDA, LLaDAConfig
from tdlm.models.loading import PRESETS, load_backbone, save_backbone, save_pretrained

__all__ = ["Backbone", "Dream", "DreamConfig", "LLaDA", "LLaDAConfig", "PRESETS", "load_backbone", "save_backbone",
           "save_pretrained"]  # save_pretrained: the deprecated name of save_backbone

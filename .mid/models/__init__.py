"""Model families (Llama3 dense, DeepSeek-MoE), size flavors and dry-run planning. No distributed code here."""

from models.deepseek_moe import DeepSeekMoE, DeepSeekMoEArgs, GroupedExperts
from models.llama3 import Llama3, Llama3Args
from models.registry import MODEL_FLAVORS, ModelFlavor, build_model, get_flavor

__all__ = [
    "MODEL_FLAVORS",
    "DeepSeekMoE",
    "DeepSeekMoEArgs",
    "GroupedExperts",
    "Llama3",
    "Llama3Args",
    "ModelFlavor",
    "build_model",
    "get_flavor",
]

"""Registry: which CausalLM class runs a given ModelConfig."""

from __future__ import annotations

from lowbit.errors import LowbitError
from lowbit.runtime.config import ModelConfig
from lowbit.runtime.models.base import CausalLM
from lowbit.runtime.models.gemma3 import Gemma3ForCausalLM
from lowbit.runtime.models.llama import LlamaForCausalLM

FAMILY_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def model_class(config: ModelConfig) -> type[CausalLM]:
    try:
        return FAMILY_CLASSES[config.family]
    except KeyError:
        raise LowbitError(f"unsupported architecture {config.architecture} (family {config.family})") from None


def build_model(config: ModelConfig) -> CausalLM:
    """A model with uninitialised weights on the current default device (the loader uses meta)."""
    return model_class(config)(config)


__all__ = ["CausalLM", "FAMILY_CLASSES", "build_model", "model_class"]

"""Registry: which CausalLM class runs a given ModelConfig."""

from __future__ import annotations

import contextlib

from torch import nn

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
    with _no_weight_init():
        return model_class(config)(config)


# nn.init's random fills, which module constructors call
_INIT_FILLS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "trunc_normal_")


@contextlib.contextmanager
def _no_weight_init():
    """Skip nn.init's random fills while the module tree is built: every weight comes from a
    checkpoint, and on the meta device torch's normal_ imports torch._dynamo on first use (nn.Embedding's
    init cost 1.4-2.1 s of every model load: engine, eval, quantize, serve)."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FILLS}
    for name in _INIT_FILLS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


__all__ = ["CausalLM", "FAMILY_CLASSES", "build_model", "model_class"]

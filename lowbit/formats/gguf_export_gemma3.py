"""What a Gemma-3 text checkpoint needs beyond the shared GGUF keys, and what llama.cpp cannot run.

(Its norms, stored as 1 + w, are written through the architecture's `norm_offset` in gguf_arch,
as the import reads them.) Which layers slide is written as llama.cpp's pattern number when it matches (every 6th layer global),
else as the per-layer list llama.cpp also reads; the local rotary base goes to rope.freq_base_swa.
"""

from __future__ import annotations

from lowbit.errors import LowbitError
from lowbit.formats.gguf_arch import llama_cpp_swa_layers

_LLAMA_CPP_PATTERN = 6  # llama.cpp's default for gemma3: layers 5, 11, 17, ... attend globally


def check_llama_cpp_gemma3(config: dict) -> None:
    """Refuse what llama.cpp's gemma3 graph would compute differently, naming the config field."""
    act = config.get("hidden_activation") or config.get("hidden_act")
    if act != "gelu_pytorch_tanh":
        raise LowbitError(f"hidden_activation {act}: llama.cpp's gemma3 uses the tanh GELU only")
    if config.get("attn_logit_softcapping"):
        raise LowbitError("attn_logit_softcapping is set: llama.cpp's gemma3 does not cap attention logits")
    if config.get("use_bidirectional_attention"):
        raise LowbitError("use_bidirectional_attention: llama.cpp's gemma3 attends causally")
    layers, heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    # llama.cpp scales queries by 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 62-layer 27B
    scalar = int(config["hidden_size"]) // heads if layers == 62 else head_dim
    given = config.get("query_pre_attn_scalar", scalar)
    if given != scalar:
        raise LowbitError(f"query_pre_attn_scalar {given}: llama.cpp's gemma3 scales queries by 1/sqrt({scalar}) "
                          f"for a {layers}-layer model")


def sliding_layers(config: dict) -> list[bool]:
    layers = int(config["num_hidden_layers"])
    if not config.get("sliding_window"):
        return [False] * layers
    types = config.get("layer_types")
    if types:
        return [t == "sliding_attention" for t in types]
    pattern = int(config.get("sliding_window_pattern") or _LLAMA_CPP_PATTERN)
    return llama_cpp_swa_layers(pattern, layers)


def write_gemma3_metadata(writer, config: dict) -> None:
    sliding = sliding_layers(config)
    if any(sliding):
        writer.add_sliding_window(int(config["sliding_window"]))
        if sliding == llama_cpp_swa_layers(_LLAMA_CPP_PATTERN, len(sliding)):
            writer.add_sliding_window_pattern(_LLAMA_CPP_PATTERN)
        else:
            writer.add_sliding_window_pattern([bool(s) for s in sliding])
        writer.add_rope_freq_base_swa(float(config.get("rope_local_base_freq", 10000.0)))
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))

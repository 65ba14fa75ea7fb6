"""compressed-tensors checkpoints (what vLLM and transformers load): export from and import to lowbit.

Per quantized Linear `<m>` (facts from the compressed-tensors package, v0.20):
  pack-quantized (int, 2/3/4/8 bits)
    <m>.weight_packed      int32 [N, ceil(K*b/32)]: codes q + 2^(b-1) (unsigned) as one dense
                           little-endian bit stream per row, element 0 in the lowest bits —
                           lowbit's own byte stream (even element in the low nibble) read as int32
    <m>.weight_scale       [N, G] (channel: [N, 1]) in the scale dtype
    <m>.weight_zero_point  asymmetric only: int32 [ceil(N*b/32), G], zero points packed the same
                           way along the OUTPUT dimension (dim 0)
    <m>.weight_shape       int64 [2] = (N, K)
    <m>.weight_g_idx       int32 [K], GPTQ with activation order only (actorder "group", removed in
                           compressed-tensors 0.19): column j's group; imported as exact float32
                           weights (lowbit's groups are contiguous), never read as j // G
    value = (q - zp) * scale with signed q, zp in [-2^(b-1), 2^(b-1)-1]; lowbit's unsigned
    u = q + 2^(b-1), z = zp + 2^(b-1). Groups must divide K (the package refuses ragged rows).
  float-quantized (fp8 e4m3)
    <m>.weight float8_e4m3fn [N, K]; <m>.weight_scale channel [N, 1], tensor [1] or
    block [ceil(N/b), ceil(K/b)] with "block_structure": [b, b]; value = weight * scale
  nvfp4-pack-quantized
    <m>.weight_packed uint8 [N, K/2] (E2M1, even element in the low nibble), <m>.weight_scale
    float8_e4m3fn [N, K/16], <m>.weight_global_scale float32 [1]. compressed-tensors DIVIDES the
    block scale by the global scale, so it stores the reciprocal of lowbit's (ModelOpt's)
    multiplier; the exporter picks the float32 r nearest 1/g whose own reciprocal rounds back to g.
  mxfp4-pack-quantized
    <m>.weight_packed uint8 [N, K/2], <m>.weight_scale uint8 [N, K/32] E8M0 (2^(s-127))
config.json "quantization_config": quant_method "compressed-tensors", format, config_groups
(targets: "Linear" when every quantized layer shares one scheme, else exact module names),
ignore (Linear modules left dense), quantization_status "compressed".

Mixture-of-experts models keep one Linear per expert, named as the hub checkpoints vLLM loads
name them: Mixtral `model.layers.L.block_sparse_moe.experts.E.w1/w3/w2` (gate/up/down) and its
router `block_sparse_moe.gate`; Qwen2/3-MoE and OLMoE `model.layers.L.mlp.experts.E.gate_proj/
up_proj/down_proj` and `mlp.gate` (lowbit's own spelling). Routers and Qwen2-MoE's
`shared_expert_gate` stay dense and are listed in `ignore` (a quantized router could send a
token to other experts; vLLM builds them unquantized). The importer maps Mixtral's names back.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import torch

from lowbit.errors import LowbitError
from lowbit.formats.checkpoint import Checkpoint, read_safetensors
from lowbit.formats.hf_files import read_config
from lowbit.formats.int32pack import bytes_to_int32, int32_to_bytes
from lowbit.formats.moe_names import to_lowbit, to_mixtral
from lowbit.quant.packing import pack_bits, packed_width, unpack_bits
from lowbit.quant.qtensor import QTensor
from lowbit.quant.spec import FormatSpec, parse_spec

QUANT_METHOD = "compressed-tensors"
_SCALE_TOKEN = {torch.float16: "sfp16", torch.bfloat16: "sbf16", torch.float32: "sfp32"}


# ---------------------------------------------------------------- export


def why_not_exact(qt: QTensor) -> str | None:
    """None when compressed-tensors can hold `qt` exactly, else the reason."""
    spec, (n, k) = qt.spec, qt.shape
    if spec.family == "int":
        if spec.double_quant:
            return f"compressed-tensors holds float scales, not {spec.label}'s 8-bit scale codes"
        if spec.granularity == "group" and k % spec.group_size:
            return f"in_features {k} is not a multiple of group size {spec.group_size} (compressed-tensors groups must divide the row)"
        return None
    if spec.family == "fp8":
        return None if spec.element == "e4m3" else "compressed-tensors stores fp8 weights as e4m3 only"
    if spec.family == "nvfp4":
        if k % 16:
            return f"in_features {k} is not a multiple of 16"
        if reciprocal_global_scale(qt.global_scale) is None:
            return "no float32 reciprocal of the global scale rounds back to it"
        return None
    if spec.family == "mxfp4":
        return None if k % 32 == 0 else f"in_features {k} is not a multiple of 32"
    return f"compressed-tensors has no {spec.name} format"


def requant_spec(spec: FormatSpec, shape: tuple[int, int]) -> FormatSpec:
    """The nearest spec compressed-tensors can hold, for --allow-requant."""
    k = shape[1]
    if spec.family == "int" and spec.granularity == "group":
        g = spec.group_size
        while k % g and g > 16:
            g //= 2
        if k % g:
            return parse_spec(spec.name, -1, scale_dtype=spec.scale_dtype)
        return parse_spec(spec.name, g, scale_dtype=spec.scale_dtype)
    if spec.family == "fp8":
        return parse_spec("fp8-channel")
    if spec.family in ("nvfp4", "mxfp4") and k % 32 == 0:
        return parse_spec(spec.name)
    # nf4 and formats whose blocks cannot tile the row become 4-bit integers per channel or group
    g = spec.group_size or 128
    while g > 16 and k % g:
        g //= 2
    return parse_spec("int4", g if k % g == 0 else -1, scale_dtype="float16")


def reciprocal_global_scale(global_scale: torch.Tensor) -> torch.Tensor | None:
    """float32 r near 1/g with fl(1/r) == g, so a lowbit re-import recovers g exactly."""
    g = torch.as_tensor(global_scale, dtype=torch.float32).reshape(1)
    r0 = (1.0 / g).float()
    bits = struct.unpack("<i", struct.pack("<f", float(r0)))[0]
    for step in (0, 1, -1, 2, -2):
        r = torch.tensor([struct.unpack("<f", struct.pack("<i", bits + step))[0]], dtype=torch.float32)
        if torch.equal((1.0 / r).float(), g):
            return r
    return None


def weights_args(spec: FormatSpec) -> tuple[str, dict]:
    """(compressed-tensors format, "weights" QuantizationArgs dict) for an expressible spec."""
    if spec.family == "int":
        args = {"num_bits": spec.bits, "type": "int", "symmetric": spec.symmetric,
                "group_size": spec.group_size if spec.granularity == "group" else None,
                "strategy": spec.granularity, "dynamic": False}
        return "pack-quantized", args
    if spec.family == "fp8":
        args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                "strategy": spec.granularity, "dynamic": False}
        if spec.granularity == "block":
            args["block_structure"] = [spec.group_size, spec.group_size]
        return "float-quantized", args
    if spec.family == "nvfp4":
        return "nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                                        "strategy": "tensor_group", "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
    if spec.family == "mxfp4":
        return "mxfp4-pack-quantized", {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
                                        "strategy": "group", "dynamic": False, "scale_dtype": "torch.uint8"}
    raise LowbitError(f"compressed-tensors has no {spec.name} format")


def module_tensors(module: str, qt: QTensor) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one quantized module (which must be expressible)."""
    spec, (n, k) = qt.spec, qt.shape
    out: dict[str, torch.Tensor] = {}
    if spec.family == "int":
        codes = qt.qweight if spec.bits < 8 else (qt.qweight.to(torch.int16) + 128).to(torch.uint8)
        out[f"{module}.weight_packed"] = bytes_to_int32(codes)[:, : -(-k * spec.bits // 32)].contiguous()
        out[f"{module}.weight_scale"] = qt.scales
        out[f"{module}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        if not spec.symmetric:
            zstream = pack_bits(qt.zeros.t().contiguous(), spec.bits)  # along N
            out[f"{module}.weight_zero_point"] = bytes_to_int32(zstream)[:, : -(-n * spec.bits // 32)].t().contiguous()
    elif spec.family == "fp8":
        out[f"{module}.weight"] = qt.qweight
        out[f"{module}.weight_scale"] = qt.scales
    elif spec.family == "nvfp4":
        out[f"{module}.weight_packed"] = qt.qweight
        out[f"{module}.weight_scale"] = qt.scales
        out[f"{module}.weight_global_scale"] = reciprocal_global_scale(qt.global_scale)
    elif spec.family == "mxfp4":
        out[f"{module}.weight_packed"] = qt.qweight
        out[f"{module}.weight_scale"] = qt.scales
    return out


def quantization_config(schemes: dict[str, FormatSpec], dense_linears: list[str]) -> dict:
    """config.json's quantization_config for modules → specs; dense Linear modules are ignored."""
    by_args: dict[str, tuple[str, dict, list[str]]] = {}
    for module, spec in schemes.items():
        fmt, args = weights_args(spec)
        key = repr((fmt, sorted(args.items())))
        by_args.setdefault(key, (fmt, args, []))[2].append(module)
    groups = {}
    single = len(by_args) == 1
    for i, (fmt, args, modules) in enumerate(by_args.values()):
        groups[f"group_{i}"] = {
            "targets": ["Linear"] if single else [f"re:^{re.escape(m)}$" for m in modules],
            "weights": args, "input_activations": None, "output_activations": None,
            "format": fmt,
        }
    formats = {g["format"] for g in groups.values()}
    return {
        "quant_method": QUANT_METHOD,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "config_groups": groups,
        "ignore": list(dense_linears),
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
    }


# ---------------------------------------------------------------- mixture of experts

_ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.gate$|\.mlp\.shared_expert_gate$")


def moe_export_layout(config: dict, tensors: dict[str, torch.Tensor], schemes: dict[str, FormatSpec],
                      dense_linears: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, FormatSpec], list[str]]:
    """(tensors, schemes, ignore) of an export with the MoE names vLLM loads: Mixtral's experts
    and router renamed to block_sparse_moe.*, and every router (and shared-expert gate) ignored."""
    rename = to_mixtral if config.get("model_type") == "mixtral" else (lambda name: name)
    tensors = {rename(n): t for n, t in tensors.items()}
    schemes = {rename(m): spec for m, spec in schemes.items()}
    routers = [n[: -len(".weight")] for n in tensors if n.endswith(".weight") and _ROUTER.search(n[: -len(".weight")])]
    for module in routers:
        if module in schemes:
            raise LowbitError(f"{module} is a router: compressed-tensors exports keep routers dense")
    return tensors, schemes, [rename(m) for m in dense_linears] + routers


# ---------------------------------------------------------------- import


def is_compressed_tensors(directory: Path) -> bool:
    try:
        qc = read_config(directory).get("quantization_config") or {}
    except LowbitError:
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def _scheme_for(module: str, qc: dict) -> tuple[str, dict] | None:
    ignore = qc.get("ignore") or []
    if any(_matches(module, t) for t in ignore):
        return None
    for group in (qc.get("config_groups") or {}).values():
        if any(_matches(module, t) for t in group.get("targets", [])):
            return group.get("format") or qc.get("format"), group.get("weights") or {}
    return None


def _matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module or target == "Linear"


def read_compressed_tensors(directory: Path) -> Checkpoint:
    config = read_config(directory)
    qc = config.pop("quantization_config")
    tensors = read_safetensors(directory)
    # Mixtral's expert names (block_sparse_moe.experts.E.w1, ...) become lowbit's per-expert names;
    # the config's targets and ignore are matched against the names as written
    rename = to_lowbit
    ckpt = Checkpoint(config=config, source_dir=directory, kind="compressed-tensors")
    modules = sorted({n.rsplit(".", 1)[0] for n in tensors if n.endswith((".weight_packed", ".weight_scale"))})
    used: set[str] = set()
    for module in modules:
        scheme = _scheme_for(module, qc)
        if scheme is None:
            raise LowbitError(f"{directory}: {module} has quantized tensors but no config group targets it")
        fmt, args = scheme
        parts = {n[len(module) + 1:]: t for n, t in tensors.items() if n.startswith(module + ".") and n[len(module) + 1:].startswith("weight")}
        used.update(f"{module}.{p}" for p in parts)
        qt = import_module(module, fmt, args, parts)
        if isinstance(qt, QTensor):
            ckpt.qtensors[rename(module)] = qt
        else:
            weight, label, reason = qt
            ckpt.dense[f"{rename(module)}.weight"] = weight
            ckpt.unexpressed[rename(module)] = (label, reason)
    for name, t in tensors.items():
        if name not in used:
            ckpt.dense[rename(name)] = t
    return ckpt


def import_module(module: str, fmt: str, args: dict, parts: dict[str, torch.Tensor]):
    """One module's compressed-tensors parts → a lowbit QTensor (or (dense, label, reason))."""
    where = f"{module} ({fmt})"
    try:
        if fmt == "pack-quantized":
            return _import_int(args, parts, where)
        if fmt in ("float-quantized", "naive-quantized") and args.get("type") == "float":
            return _import_fp8(args, parts, where)
        if fmt == "nvfp4-pack-quantized":
            return _import_fp4("nvfp4", parts, where)
        if fmt == "mxfp4-pack-quantized":
            return _import_fp4("mxfp4", parts, where)
    except KeyError as exc:
        raise LowbitError(f"{where}: missing tensor weight part {exc}") from None
    raise LowbitError(f"{where}: lowbit cannot import compressed-tensors format '{fmt}' with {args.get('type')} weights")


def _import_int(args: dict, parts: dict, where: str):
    bits = int(args.get("num_bits", 4))
    n, k = (int(v) for v in parts["weight_shape"].tolist())
    scales = parts["weight_scale"]
    strategy = args.get("strategy") or ("group" if args.get("group_size") else "channel")
    symmetric = bool(args.get("symmetric", True))
    stream = int32_to_bytes(parts["weight_packed"], packed_width(k, bits))
    codes = unpack_bits(stream, bits, k)
    zeros = None
    if not symmetric:
        zp = parts["weight_zero_point"]
        zstream = int32_to_bytes(zp.t().contiguous(), packed_width(n, bits))
        zeros = unpack_bits(zstream, bits, n).t().contiguous()
    name = f"int{bits}" + ("" if symmetric else "-asym")
    group = int(args["group_size"]) if strategy == "group" else -1
    g_idx = parts.get("weight_g_idx")
    if g_idx is not None and group > 0:
        # GPTQ with activation order (llm-compressor's actorder "group", before compressed-tensors
        # 0.19 removed it): column j belongs to group g_idx[j], not j // group
        g_idx = g_idx.long().flatten()
        if g_idx.numel() != k or g_idx.min() < 0 or g_idx.max() >= scales.shape[1]:
            raise LowbitError(f"{where}: weight_g_idx must hold {k} group indices below {scales.shape[1]}")
        if not torch.equal(g_idx, torch.arange(k) // group):
            return (_dense_int(codes, scales, zeros, bits, group, f"{name} g{group}", "", g_idx)[0],
                    f"{name} g{group} act-order", "act-order groups (weight_g_idx) are not contiguous column ranges")
    try:
        spec = parse_spec(f"{name}-{_SCALE_TOKEN[scales.dtype]}", group)
    except (LowbitError, KeyError) as exc:
        return _dense_int(codes, scales, zeros, bits, group, f"{name} g{group}", str(exc))
    if spec.bits == 8:
        qweight = (codes.to(torch.int16) - 128).to(torch.int8)
    else:
        qweight = pack_bits(codes, bits)
    tensors = {"qweight": qweight, "scales": scales.reshape(n, -1)}
    if zeros is not None:
        tensors["zeros"] = zeros
    return QTensor.from_tensors(tensors, {"spec": spec.to_dict(), "shape": [n, k]}, where=where)


def _dense_int(codes, scales, zeros, bits, group, label, reason, g_idx=None):
    """(the float32 weights, label, reason); g_idx: each column's group when not k // group."""
    n, k = codes.shape
    g = k if group <= 0 else group
    mid = zeros.float() if zeros is not None else torch.full_like(scales, float(1 << (bits - 1)), dtype=torch.float32)
    if g_idx is None:
        g_idx = torch.arange(k) // g
    return (codes.float() - mid[:, g_idx]) * scales.float()[:, g_idx], label, reason


def _import_fp8(args: dict, parts: dict, where: str):
    weight, scales = parts["weight"], parts["weight_scale"]
    if weight.dtype != torch.float8_e4m3fn:
        raise LowbitError(f"{where}: expected float8_e4m3fn weights, found {weight.dtype}")
    n, k = weight.shape
    strategy = args.get("strategy")
    if strategy == "block":
        bh, bw = args.get("block_structure") or [128, 128]
        if bh != bw:
            w = _dense_fp8_block(weight, scales, bh, bw)
            return w, f"fp8 {bh}x{bw} blocks", "lowbit's fp8 blocks are square"
        label = f"fp8-block{bh}"
    elif strategy in ("channel", "tensor"):
        label = f"fp8-{strategy}"
        scales = scales.reshape(n, 1) if strategy == "channel" else scales.reshape(1)
    else:
        raise LowbitError(f"{where}: fp8 weight strategy '{strategy}' is not supported")
    spec = parse_spec(f"{label}-{_SCALE_TOKEN.get(scales.dtype, 'sfp32')}")
    return QTensor.from_tensors({"qweight": weight, "scales": scales.to(_dtype(spec))}, {"spec": spec.to_dict(), "shape": [n, k]}, where=where)


def _dense_fp8_block(weight, scales, bh, bw):
    s = scales.float().repeat_interleave(bh, 0)[: weight.shape[0]].repeat_interleave(bw, 1)[:, : weight.shape[1]]
    return weight.float() * s


def _dtype(spec: FormatSpec) -> torch.dtype:
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[spec.scale_dtype]


def _import_fp4(name: str, parts: dict, where: str):
    packed, scales = parts["weight_packed"], parts["weight_scale"]
    n, k = packed.shape[0], packed.shape[1] * 2
    spec = parse_spec(name)
    tensors = {"qweight": packed, "scales": scales}
    if name == "nvfp4":
        tensors["global_scale"] = (1.0 / parts["weight_global_scale"].float().reshape(1)).float()
    return QTensor.from_tensors(tensors, {"spec": spec.to_dict(), "shape": [n, k]}, where=where)

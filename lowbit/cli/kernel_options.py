"""The kernel options `eval`, `generate`, `bench` and `serve` share (`--kernel`, `--int4-activations`,
`--dense-activations`, `--int8-activations`):
their help text, their check (`kernel_settings`, a usage error, exit 2) and what a loaded model's
quantized layers run on (`kernel_summary`, for --json)."""

from __future__ import annotations

import typer

KERNEL_HELP = (
    "Kernel path for every quantized layer, instead of the best one per layer (default; $LOWBIT_KERNEL if set): "
    "reference (dequantize to float32, then matmul: float32 numerics, slow), cpu (the best CPU path), cpu-int4dot, "
    "cpu-int8dot (8-bit codes with int8 activations), cpu-int4, cpu-int8f, cpu-int8, cpu-bf16, cpu-lut, "
    "triton (CUDA). The automatic CPU paths round activations to bf16 (cpu-int4, cpu-int8, cpu-bf16, and cpu-int4dot's "
    "bf16 route) or to int8 (cpu-int4dot and cpu-int8dot, see --int4-activations and --int8-activations); cpu-int8f, "
    "cpu-lut and reference compute in float32. "
    "LOWBIT_NO_NATIVE=1 turns the C kernels off (cpu-int4dot, cpu-int8f, cpu-bf16, cpu-lut): torch's int4/int8 ops or the "
    "reference run instead. A path that cannot run a layer is an error. `lowbit doctor` lists what runs here."
)
INT4_ACTIVATIONS_HELP = (
    "What the int4 decode kernel (cpu-int4dot, up to 16 rows per matmul) rounds activations to: int8 (the default "
    "where the CPU has AVX512-VNNI or AVX2: each row quantized per weight group to int8, max|x|/127, then exact integer sums; "
    "about +0.005 KLD on 4-bit models, docs/benchmarks.md) or bf16 (the default without VNNI: x rounded to bf16, "
    "float32 sums). Prefill (more rows) is the same either way. Default: $LOWBIT_INT4_ACTIVATIONS if set."
)

DENSE_ACTIVATIONS_HELP = (
    "What a float32 model's bf16-stored dense Linears (a bf16 checkpoint's layers, the tied embedding "
    "as head) round their activations to on the CPU: bf16 (the default where the CPU has AVX512-BF16: x rounded "
    "to bf16, bf16 x bf16 products summed in float32, llama.cpp's BF16 arithmetic, 1.2-1.5x faster from 4 rows "
    "on, prefill included; KLD ~1e-4, docs/benchmarks.md) or f32 (the default elsewhere: float32 x, exact "
    "products, float32 sums). `eval --base` computes its reference in f32 either way. "
    "Default: $LOWBIT_DENSE_ACTIVATIONS if set."
)

INT8_ACTIVATIONS_HELP = (
    "What 8-bit integer weights (int8 checkpoints, an int8 head) round their activations to on the CPU: int8 (the "
    "default where the CPU has AVX512-VNNI: each row quantized per weight group to int8, max|x|/127, then exact "
    "integer sums on cpu-int8dot, llama.cpp's Q8_0 arithmetic; faster at prefill and with many sequences, about "
    "+0.002 KLD, docs/benchmarks.md) or f32 (the default elsewhere: float32 x on cpu-int8f, float32 sums). "
    "Default: $LOWBIT_INT8_ACTIVATIONS if set."
)

# The options as each command declares them (`kernel: Optional[str] = KERNEL_OPTION`).
KERNEL_OPTION = typer.Option(None, "--kernel", metavar="PATH", help=KERNEL_HELP, show_default=False)
INT4_ACTIVATIONS_OPTION = typer.Option(None, "--int4-activations", metavar="int8|bf16", help=INT4_ACTIVATIONS_HELP,
                                       show_default=False)
DENSE_ACTIVATIONS_OPTION = typer.Option(None, "--dense-activations", metavar="f32|bf16", help=DENSE_ACTIVATIONS_HELP,
                                        show_default=False)
INT8_ACTIVATIONS_OPTION = typer.Option(None, "--int8-activations", metavar="int8|f32", help=INT8_ACTIVATIONS_HELP,
                                       show_default=False)


def kernel_settings(kernel: str | None, int4_activations: str | None, dense_activations: str | None = None,
                    int8_activations: str | None = None):
    """The KernelSettings for the --kernel / --int4-activations / --dense-activations /
    --int8-activations values (which validate themselves: a bad value is a usage error, exit 2)."""
    from lowbit.kernels.dispatch import KernelSettings

    return KernelSettings(kernel=kernel, int4_activations=int4_activations, dense_activations=dense_activations,
                          int8_activations=int8_activations)


def kernel_summary(model) -> dict:
    """{"requested", "paths": {path: quantized layers}, "int4_activations"} of a loaded model
    (kernels.dispatch.summarize); call it inside the `use_settings` block the model loaded in."""
    from lowbit.kernels.cpu_bf16pack import covered_linears
    from lowbit.kernels.cpu_f32 import InvariantLinear
    from lowbit.kernels.dispatch import summarize
    from lowbit.runtime.quant_linear import QuantLinear

    summary = summarize(m.prepared for m in model.modules() if isinstance(m, QuantLinear))
    # bf16 dense Linears that round x to bf16 (--dense-activations bf16), as the checkpoint names them
    bf16 = sum(1 for m in model.modules() if isinstance(m, InvariantLinear) and m.bf16_x)
    summary["dense_activations"] = "bf16" if bf16 else "f32"
    summary["dense_bf16_activation_linears"] = bf16
    # of those, the ones read packed in 12 bits at decode steps (kernels/cpu_bf16pack.py)
    summary["packed_bf16_linears"] = covered_linears(model)
    return summary


def kernel_line(summary: dict) -> str | None:
    """One human line for a kernel_summary, or None for a model without quantized layers and no
    bf16 dense activations."""
    dense = summary.get("dense_bf16_activation_linears")
    packed = summary.get("packed_bf16_linears")
    with_bf16 = "with bf16 activations" + (f" ({packed} read packed in 12 bits at decode steps)" if packed else "")
    if not summary["paths"]:
        return f"dense Linears: {dense} {with_bf16}" if dense else None
    paths = ", ".join(f"{name} x{count}" for name, count in summary["paths"].items())
    act = summary["int4_activations"]
    return (f"kernels: {paths}" + (f" ({act} activations in the int4 decode kernel)" if act else "")
            + (f"; {dense} dense Linears {with_bf16}" if dense else ""))

"""CPU path for dense float32 and bfloat16 Linears (native/f32_dot.c: AVX-512, or AVX2 + FMA for
float32 activations on CPUs without it).

Batch-invariant: each output (m, n) is computed by the same arithmetic whether its row runs
alone (a plain decode step) or among other rows (a speculative verify of 1 + k tokens, several
sequences in one step, a prefill chunk), which torch's float32 Linear does not promise (one row
takes its matrix-vector route, more rows a packed GEMM). It also reads the weight once for a few
rows, where torch's GEMM route cost ~3x its one-row time at 2-5 rows here; at prefill sizes it
measured 0.9-1.0x torch's float32 GEMM time on SmolLM2's linears (78-512 rows), and 0.7-0.8x
torch's time including the widening of a bf16-stored weight that torch needs first.

A weight whose values are all bfloat16 numbers (a bf16 checkpoint loaded as float32, e.g. the tied
embedding every int4 model keeps dense) is stored as bfloat16 (`use_invariant_linears`): the kernel
widens it exactly, so every output is bit for bit what the float32 copy gave, from half the bytes
(SmolLM2's tied head: 57 MB a token instead of 113 MB).

A bf16 model's Linears (bf16 x and weights, AVX512-BF16) take `bf16_matmul` at up to BF16_MAX_ROWS
rows: exact products in float32 two k at a time (`vdpbf16ps`), float32 sums, y rounded once to
bf16; batch-invariant up to those rows, where torch's bf16 Linear is not, so a bf16 speculative
verify is exact too. It is 1.2-3x faster than torch's bf16 Linear at 1-16 rows on SmolLM2's
shapes, but torch's GEMM is 1.3-2x faster at prefill sizes (78-512 rows), so those go to torch.
"""

from __future__ import annotations

import torch

from lowbit.native import f32_dot

_LIB = None
_BF16 = False  # bf16_available() said yes
BF16_MAX_ROWS = 16
PACKED_MAX_ROWS = 4  # rows of x up to which a packed weight (cpu_bf16pack.py) is read instead of the bf16 one


def available() -> bool:
    global _LIB
    lib = f32_dot.library()
    if lib is not None and lib.lowbit_f32dot_available() == 1:
        _LIB = lib
        return True
    return False


def bf16_available() -> bool:
    """The bf16 x bf16 kernel is built for this CPU (AVX512-BF16)."""
    global _BF16
    _BF16 = available() and _LIB.lowbit_bf16dot_available() == 1
    return _BF16


def bf16_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] bf16 = x [M, K] bf16 · weight [N, K] bf16ᵀ (+ bias, added in float32 before the
    rounding): rows of x and weight contiguous; any M."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if bias is not None and bias.dtype is not torch.float32:
        bias = bias.float()
    rc = (_LIB or f32_dot.library()).lowbit_bf16_matmul(
        weight.data_ptr(), n, k, weight.stride(0), None if bias is None else bias.contiguous().data_ptr(),
        x.data_ptr(), x.stride(0), m, y.data_ptr(), 1, n, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lowbit_bf16_matmul failed with code {rc}")
    return y


def kernel_name(weight_dtype: torch.dtype, bf16_x: bool = False) -> str:
    """The f32_dot.c entry for float32 rows of x against a float32 or bf16 weight (bf16_x: the rows
    rounded to bf16 first, a bf16 weight only); matmul and the decode chain call the same one."""
    if weight_dtype is torch.bfloat16:
        return "lowbit_bf16xw_matmul" if bf16_x else "lowbit_bf16w_matmul"
    return "lowbit_f32_matmul"


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, bf16_x: bool = False) -> torch.Tensor:
    """y [M, N] = x [M, K] · weight [N, K]ᵀ (+ bias): x, bias and y float32 on CPU, weight float32 or
    bfloat16, rows of x and weight contiguous; any M. bf16_x (a bf16 weight, AVX512-BF16): x is
    rounded to bf16 first and the products are bf16 x bf16 (`--dense-activations bf16`)."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    kernel = getattr(_LIB or f32_dot.library(), kernel_name(weight.dtype, bf16_x))
    rc = kernel(
        weight.data_ptr(), n, k, weight.stride(0), None if bias is None else bias.data_ptr(),
        x.data_ptr(), x.stride(0), m, y.data_ptr(), n, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lowbit_f32_matmul failed with code {rc}")
    return y


_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


class InvariantLinear(torch.nn.Linear):
    """An nn.Linear whose float32 CPU forward runs native/f32_dot.c.

    A subclass, so the module keeps its parameters, its Hugging Face name and `isinstance(m,
    nn.Linear)` for everything that walks the model (draft quantization, weight swaps)."""

    bf16_x = False  # round float32 rows of x to bf16 for a bf16 weight (use_invariant_linears sets it)
    packed = None  # the weight packed in 12 bits (kernels/cpu_bf16pack.py), for up to PACKED_MAX_ROWS rows of x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = x.numel() // max(x.shape[-1], 1)
        if (self.packed is not None and 0 < rows <= PACKED_MAX_ROWS and x.dtype is torch.float32 and x.device.type == "cpu"
                and not (torch.is_grad_enabled() and w.requires_grad)):
            # a decode step's rows (or a small verify's): the same outputs from three quarters of
            # the bytes; more rows are compute-bound, where the bf16 weight's tiles are faster
            from lowbit.kernels import cpu_bf16pack

            bias = self.bias
            if bias is None or (bias.dtype is torch.float32 and bias.is_contiguous()):
                return cpu_bf16pack.matmul(x.reshape(rows, x.shape[-1]).contiguous(), self.packed, bias).view(*x.shape[:-1], w.shape[0])
        if (x.dtype is torch.bfloat16 and w.dtype is torch.bfloat16 and _BF16 and 0 < rows <= BF16_MAX_ROWS and x.device.type == "cpu"
                and w.stride(-1) == 1 and not (torch.is_grad_enabled() and w.requires_grad)):
            x2 = x.reshape(rows, x.shape[-1])
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            return bf16_matmul(x2, w, self.bias).view(*x.shape[:-1], w.shape[0])
        if (x.dtype is not torch.float32 or w.dtype not in _WEIGHT_DTYPES or x.device.type != "cpu" or rows == 0
                or w.stride(-1) != 1 or torch.is_grad_enabled() and w.requires_grad):
            if w.dtype is torch.bfloat16 and x.dtype is torch.float32:
                w = w.float()  # a compacted weight (see the module docstring): its exact float32 copy
            return torch.nn.functional.linear(x, w, self.bias)
        x2 = x.reshape(rows, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        bias = self.bias
        if bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous()):
            return torch.nn.functional.linear(x, w, bias)
        return matmul(x2, w, bias, self.bf16_x and w.dtype is torch.bfloat16).view(*x.shape[:-1], w.shape[0])


def use_invariant_linears(model: torch.nn.Module, bf16_weights: bool = False) -> int:
    """Make every float32 nn.Linear of `model` (and every bf16 one, where the CPU has AVX512-BF16)
    an InvariantLinear (in place; the kernel must be available), and store as bfloat16 each float32
    weight whose values all are bfloat16 numbers (a tied embedding along with it: its rows are
    widened back on lookup, exactly). bf16_weights: the model computes in float32 and its bf16
    Linears are such weights already (runtime/loader.py bf16_linears), for this kernel on any CPU.
    The dense activations in effect (`dispatch.dense_activations()`, `--dense-activations`) are
    read here: "bf16" makes each bf16-stored weight round its float32 rows of x to bf16.
    Returns how many Linears were switched."""
    if not available():
        return 0
    from lowbit.kernels.dispatch import dense_activations

    dtypes = (torch.float32, torch.bfloat16) if bf16_available() or bf16_weights else (torch.float32,)
    bf16_x = dense_activations() == "bf16"
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype in dtypes and module.weight.device.type == "cpu":
            # Swapping the class keeps the very same parameters (tied embeddings stay tied).
            module.__class__ = InvariantLinear
            if module.weight.dtype is torch.float32:
                _compact(module)
            module.bf16_x = bf16_x and module.weight.dtype is torch.bfloat16
            count += 1
    return count


def _compact(linear: torch.nn.Linear) -> None:
    w = linear.weight
    if w.requires_grad or not w.is_contiguous():
        return
    # checked chunk by chunk: a whole-matrix round trip held two more copies (Gemma-3's 671 MB
    # float32 embedding peaked 0.7 GB higher for it)
    flat = w.data.reshape(-1)
    for start in range(0, flat.numel(), _COMPACT_CHUNK):
        part = flat[start : start + _COMPACT_CHUNK]
        if not torch.equal(part.to(torch.bfloat16).float(), part):
            return  # a float32 weight of its own: the float32 kernel
    # .data in place: every module holding this Parameter (a tied embedding) sees the bf16 copy
    w.data = w.data.to(torch.bfloat16)


_COMPACT_CHUNK = 1 << 22  # elements per exactness check

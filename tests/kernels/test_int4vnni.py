"""The int8-activation int4 kernel (native/int4_vnni.c) against its float64 oracle, row by row."""

import ctypes

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.kernels import cpu_int4dot, layout, qmatmul
from tests.kernels.cases import oracle, quantized, rel_err

pytestmark = pytest.mark.skipif(not cpu_int4dot.vnni_available(), reason="no AVX512-VNNI or AVX2 build on this machine")
LABELS = ["int4", "int4-g32", "int4-g64", "int4-asym-g32", "int4-asym-g64", "int4-asym", "int4-channel"]  # g32: one int16 stretch a group (AVX2)


def quantize_activations(x: torch.Tensor, qt) -> torch.Tensor:
    """x as the kernel sees it: per weight group (per 32 for a per-channel weight, as Q8_0 blocks
    it), round_half_even(x * (127 / max|x|)) * (max|x| / 127), each step in float32 exactly as the
    C code does it."""
    k = x.shape[1]
    g = layout.group_scales(qt).group_size
    g = 32 if g >= k else g
    out = torch.empty_like(x)
    for k0 in range(0, k, g):
        block = x[:, k0 : k0 + g].float()
        amax = block.abs().amax(1, keepdim=True)
        inv = torch.tensor(127.0) / amax
        a = torch.round(block * inv)
        out[:, k0 : k0 + g] = torch.where(amax > 0, a, 0) * (amax / 127.0)
    return out


def int8_oracle(x, qt):
    return oracle(quantize_activations(x, qt), qt)


def prepared(qt):
    pw = cpu_int4dot.prepare(qt, act="int8")
    assert pw.params["act"] == "int8"
    return pw


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("n,k", [(96, 192), (33, 200), (40, 576), (17, 130), (80, 64)])
def test_equals_float64_matmul_of_int8_activations(label, n, k):
    # Integer sums are exact; what is left is float32 (scale x scale) and the running sum over
    # groups: 1e-5 of max |y| catches any wrong code, zero or scale (errors ~ 1e-2 and up).
    qt = quantized(label, n, k)
    pw = prepared(qt)
    for m in (1, 2, 3, 5, 8, 16):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k).to(dtype)
            assert rel_err(qmatmul(x.float(), pw) if dtype == torch.float32 else qmatmul(x, pw).float(),
                           int8_oracle(x.float(), qt)) < (1e-5 if dtype == torch.float32 else 2**-7), (label, n, k, m, dtype)


def test_activation_rounding_is_what_it_costs():
    # Against bf16 activations the int8 route adds x's int8 rounding: ~1e-2 relative on a
    # 576-wide Linear, not 0 (it is a different kernel) and not large.
    qt = quantized("int4", 64, 576)
    x = torch.randn(4, 576)
    err = rel_err(qmatmul(x, prepared(qt)), oracle(x, qt))
    assert 1e-4 < err < 3e-2


@pytest.mark.parametrize("label", LABELS)
def test_rows_at_once_equal_each_row_alone_bit_for_bit(label):
    qt = quantized(label, 37, 576)
    pw = prepared(qt)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2 * cpu_int4dot.PASS_ROWS + 3, 576).to(dtype)  # past one pass: prefill sizes
        alone = torch.cat([qmatmul(x[i : i + 1], pw) for i in range(x.shape[0])])
        for m in range(1, x.shape[0] + 1):
            assert torch.equal(qmatmul(x[:m], pw), alone[:m]), (label, m)
        # beyond one block of 64 rows (each block's passes run group by group), 4-row passes and a tail
        x = torch.randn(131, 576).to(dtype)
        alone = torch.cat([qmatmul(x[i : i + 1], pw) for i in range(x.shape[0])])
        for m in (67, 131):
            assert torch.equal(qmatmul(x[:m], pw), alone[:m]), (label, m)


def test_joined_weights_equal_their_parts():
    parts = [prepared(quantized(label, n, 192)) for label, n in (("int4-asym-g64", 64), ("int4-asym-g64", 30), ("int4-asym-g64", 30))]
    joined = cpu_int4dot.concat(parts)
    x = torch.randn(3, 192)
    assert torch.equal(qmatmul(x, joined), torch.cat([qmatmul(x, p) for p in parts], dim=-1))
    with pytest.raises(ValueError):  # activations differ
        cpu_int4dot.concat([parts[0], cpu_int4dot.prepare(quantized("int4-asym-g64", 8, 192), act="bf16")])


def test_joined_8bit_weights_equal_their_parts():
    # int8 codes on the int8-activation kernel (cpu-int8dot) join as the 4-bit ones do: a decode
    # step runs q/k/v and gate/up as one call
    if not cpu_int4dot.vnni_int8_available():
        pytest.skip("no AVX512-VNNI here")
    parts = [cpu_int4dot.prepare(quantized("int8-g32", n, 192)) for n in (64, 30, 100)]
    assert {p.path for p in parts} == {cpu_int4dot.INT8_PATH}
    joined = cpu_int4dot.concat(parts)
    assert joined.path == cpu_int4dot.INT8_PATH and joined.shape == (194, 192)
    x = torch.randn(3, 192)
    assert torch.equal(qmatmul(x, joined), torch.cat([qmatmul(x, p) for p in parts], dim=-1))
    with pytest.raises(ValueError):  # 4- and 8-bit codes do not mix
        cpu_int4dot.concat([parts[0], prepared(quantized("int4-g32", 64, 192))])


@pytest.mark.parametrize("act", ["int8", "bf16"])
def test_rows_of_a_joined_weight_share_its_memory_and_compute_as_their_part(act):
    if act == "bf16" and not cpu_int4dot.bf16_available():
        pytest.skip("no bf16-activation int4 kernel on this machine")
    sizes = (128, 64, 192)
    parts = [cpu_int4dot.prepare(quantized("int4-asym-g32", n, 192), act=act) for n in sizes]
    joined = cpu_int4dot.concat(parts)
    x = torch.randn(5, 192)
    start = 0
    for part, n in zip(parts, sizes):
        view = cpu_int4dot.rows(joined, start, n)
        for name, t in view.tensors.items():  # views of the joined arrays: no copy
            assert t.untyped_storage().data_ptr() == joined.tensors[name].untyped_storage().data_ptr(), name
        assert torch.equal(qmatmul(x, view), qmatmul(x, part))
        start += n
    # rows that do not fill whole groups of 64 (four interleaved tiles of 16) have no view
    assert cpu_int4dot.rows(joined, 32, 64) is None and cpu_int4dot.rows(joined, 0, 96) is None
    assert cpu_int4dot.rows(joined, 320, 128) is None  # past the end


def test_placing_copies_once_and_keeps_the_numbers(monkeypatch):
    from lowbit.kernels import hugepages

    monkeypatch.setattr(hugepages, "_enabled", True)
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)
    pw = prepared(quantized("int4-g32", 128, 256))
    x = torch.randn(3, 256)
    with hugepages.arena():
        placed = cpu_int4dot.place(pw)
        assert all(hugepages.placed(placed.tensors[name]) for name in cpu_int4dot.STREAMED if name in placed.tensors)
        assert cpu_int4dot.place(placed) is placed  # placed already: nothing copied again
        view = cpu_int4dot.rows(placed, 64, 64)
        assert cpu_int4dot.place(view) is view  # a view of placed rows stays a view
    assert torch.equal(qmatmul(x, placed), qmatmul(x, pw))
    assert cpu_int4dot.place(pw) is pw  # outside an arena nothing moves


def test_non_finite_activations_give_nan_rows_only():
    qt = quantized("int4", 32, 128)
    pw = prepared(qt)
    x = torch.randn(3, 128)
    x[1, 5] = float("nan")
    y = qmatmul(x, pw)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
    z = torch.zeros(1, 128)
    assert torch.equal(qmatmul(z, pw), torch.zeros(1, 32))


def test_layout_round_trips():
    codes = torch.randint(0, 16, (53, 130), dtype=torch.uint8)
    tiled = cpu_int4dot.tile_codes_vnni(codes)
    assert tiled.shape == (1, 32 * 192)
    assert torch.equal(cpu_int4dot.untile_codes_vnni(tiled, 53, 130), codes)
    # byte 4i+b of chunk c of tile t: row 16t + i, code 8c + b low, 8c + 4 + b high
    t, c, i, b = 2, 5, 7, 3
    byte = int(tiled[0, (c * 4 + t) * 64 + 4 * i + b])
    assert byte == int(codes[16 * t + i, 8 * c + b]) | int(codes[16 * t + i, 8 * c + 4 + b]) << 4


@pytest.mark.skipif(not cpu_int4dot.bf16_available(), reason="no AVX512-BF16 build on this machine")
def test_environment_chooses_the_route(monkeypatch):
    qt = quantized("int4", 16, 64)
    monkeypatch.setenv(cpu_int4dot.ACTIVATIONS_ENV, "bf16")
    assert cpu_int4dot.prepare(qt).params["act"] == "bf16"
    monkeypatch.setenv(cpu_int4dot.ACTIVATIONS_ENV, "int8")
    assert cpu_int4dot.prepare(qt).params["act"] == "int8"
    monkeypatch.setenv(cpu_int4dot.ACTIVATIONS_ENV, "int7")
    with pytest.raises(LowbitError, match="int8 or bf16"):
        cpu_int4dot.prepare(qt)


@pytest.mark.skipif(not cpu_int4dot.vnni_int8_available(), reason="8-bit codes need the AVX512-VNNI build")
@pytest.mark.parametrize("label", ["int8", "int8-g128", "int8-g64"])
@pytest.mark.parametrize("n,k", [(96, 192), (33, 576), (17, 130)])
def test_int8_codes_match_oracle_and_rows_alone(label, n, k):
    # cpu-int8dot: 8-bit codes through the same kernel (offset 128); the tests' default is float32
    # activations (conftest), so it runs here when named
    from lowbit.kernels import choose_path, prepare

    qt = quantized(label, n, k)
    assert choose_path(qt, "cpu") != "cpu-int8dot"
    pw = prepare(qt, "cpu", path="cpu-int8dot")
    assert pw.path == "cpu-int8dot" and pw.params["act"] == "int8"
    x = torch.randn(cpu_int4dot.PASS_ROWS, k)
    alone = torch.cat([qmatmul(x[i : i + 1], pw) for i in range(x.shape[0])])
    assert rel_err(alone, int8_oracle(x, qt)) < 1e-5, label
    for m in (2, 5, 16):
        assert torch.equal(qmatmul(x[:m], pw), alone[:m])
    more = torch.randn(20, k)  # past one 16-row pass
    assert rel_err(qmatmul(more, pw), int8_oracle(more, qt)) < 1e-5


def test_int8_layout_round_trips():
    codes = torch.randint(0, 256, (53, 130), dtype=torch.uint8)
    tiled = cpu_int4dot.tile_codes_vnni(codes, 8)
    assert tiled.shape == (1, 64 * 192)
    assert torch.equal(cpu_int4dot.untile_codes_vnni(tiled, 53, 130, 8), codes)
    # chunk c of tile t: byte 4i+b = row 16t+i code 8c+b; byte 64+4i+b = code 8c+4+b
    t, c, i, b = 1, 3, 9, 2
    base = (c * 4 + t) * 128
    assert int(tiled[0, base + 4 * i + b]) == int(codes[16 * t + i, 8 * c + b])
    assert int(tiled[0, base + 64 + 4 * i + b]) == int(codes[16 * t + i, 8 * c + 4 + b])


def test_a_cpu_with_vnni_but_no_bf16_takes_the_int8_route(monkeypatch):
    # Cascade Lake / Ice Lake servers: AVX512-VNNI without AVX512-BF16
    from lowbit.kernels import choose_path, prepare

    monkeypatch.setattr(cpu_int4dot, "bf16_available", lambda: False)
    qt = quantized("int4-asym-g64", 40, 576)
    assert choose_path(qt, "cpu") == "cpu-int4dot"
    pw = prepare(qt, "cpu")
    assert pw.params["act"] == "int8"
    x = torch.randn(3, 576)
    assert rel_err(qmatmul(x, pw), int8_oracle(x, qt)) < 1e-5
    monkeypatch.setenv(cpu_int4dot.ACTIVATIONS_ENV, "bf16")
    with pytest.raises(LowbitError, match="AVX512-BF16"):
        prepare(qt, "cpu")


@pytest.mark.parametrize("label", ["int4", "int4-g32", "int4-asym-g64"])
def test_the_avx2_build_gives_the_avx512_bits(label, tmp_path):
    # The AVX2 section (CPUs without AVX-512) widens int16 pair sums instead of vpdpbusd, but its
    # integers and float steps are the AVX-512 kernel's: outputs equal bit for bit, so a model
    # generates the same tokens on either CPU.
    from lowbit.native import int4_vnni
    from tests.kernels.cases import avx2_library

    native = int4_vnni.library()
    if native.lowbit_i4v_available() != 1:
        pytest.skip("this machine's own build is the AVX2 one: nothing to compare")
    avx2 = avx2_library("int4_vnni", int4_vnni.SIGNATURES, tmp_path)
    if avx2 is None:
        pytest.skip("no compiler or no AVX2 here")
    assert avx2.lowbit_i4v_available() == 2
    qt = quantized(label, 70, 576)
    pw = prepared(qt)
    for m in (1, 2, 5, 17):
        for x_dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, 576).to(x_dtype)
            for y_bf16 in (0, 1):
                ys = []
                for lib in (native, avx2):
                    y = torch.empty(m, 70, dtype=torch.bfloat16 if y_bf16 else torch.float32)
                    assert lib.lowbit_i4v_matmul(pw.params["ref"], x.data_ptr(), x_dtype == torch.bfloat16, 576, m,
                                                 y.data_ptr(), y_bf16, 70, 2) == 0
                    ys.append(y)
                assert torch.equal(ys[0], ys[1]), (label, m, x_dtype, y_bf16)
    # 8-bit codes would overflow AVX2's int16 sums: that build refuses them
    pw8 = cpu_int4dot.prepare(quantized("int8", 32, 64), act="int8")
    y = torch.empty(1, 32)
    assert avx2.lowbit_i4v_matmul(pw8.params["ref"], torch.randn(1, 64).data_ptr(), 0, 64, 1, y.data_ptr(), 0, 32, 1) == -1


@pytest.mark.parametrize("label", ["int4-g32", "int4-asym-g64", "int4", "int4-channel"])
def test_avx2_float16_scales_give_the_float32_scales_bits(label, tmp_path):
    # Where every scale is exactly a float16 (RTN's are), the AVX2 build streams them as float16:
    # the same values, so the same outputs bit for bit, from a tenth fewer bytes at group 32.
    from lowbit.native import int4_vnni
    from tests.kernels.cases import avx2_library

    lib = int4_vnni.library()
    if lib.lowbit_i4v_available() != 2:
        lib = avx2_library("int4_vnni", int4_vnni.SIGNATURES, tmp_path)
        if lib is None:
            pytest.skip("no compiler or no AVX2 here")
    qt = quantized(label, 70, 576)
    pw = prepared(qt)
    t = pw.tensors
    wide = t["scales"].float().contiguous()
    half = wide.half()
    assert torch.equal(half.float(), wide)
    if cpu_int4dot.vnni_available() and int4_vnni.library().lowbit_i4v_available() == 2:
        assert t["scales"].dtype is torch.float16  # prepare chose them on this AVX2 machine
    codes, zeros = t["codes"], t.get("zeros")
    structs = [cpu_int4dot.I4VWeightStruct(
        codes.data_ptr(), codes.shape[1] // 4, None if s16 else wide.data_ptr(), None if zeros is None else zeros.data_ptr(),
        70, 576, codes.shape[1] // 256, pw.params["groups"], pw.params["cpg"], int(t["offset"]), 4,
        half.data_ptr() if s16 else None, pw.params["gps"]) for s16 in (False, True)]
    for m in (1, 3, 17):
        x = torch.randn(m, 576)
        ys = []
        for struct in structs:
            y = torch.empty(m, 70)
            assert lib.lowbit_i4v_matmul(ctypes.byref(struct), x.data_ptr(), 0, 576, m, y.data_ptr(), 0, 70, 2) == 0
            ys.append(y)
        assert torch.equal(ys[0], ys[1]), (label, m)
        assert rel_err(ys[1], int8_oracle(x, qt)) < 1e-5

"""tutel.ops.decode_quantized_experts (the operator tutel::decode_quantized_experts) on CPU: MXFP4,
NVFP4 and block-scaled FP8 expert weights against a float64 reference written here from the
formats' specifications (each code decoded on its own, dequantized, then plain PyTorch experts),
for every format, unit and activation dtype, T = 0 to 32, k 1 to 8, E = 1 and 64, odd sizes,
partial FP8 blocks and expert ids outside [0, E); both kernel sets (AVX2 where the CPU has it,
and the portable loops).  The tolerance is a bound of float32 accumulation's error, computed
alongside the reference, plus the output's rounding to its dtype; mutated references (nibbles
swapped, an E8M0 bias of 128, FP8 scales of the neighbouring block) fall outside it.  Also: the code
tables against PyTorch's float8 dtypes, NaN codes, thread-count independence, the fake kernel,
and bad input named."""
import math
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tutel.ops.decode_quantized_experts import (decode_quantized_experts, quantized_decode_kernel_sets,
                                                quantized_decode_kernels, set_quantized_decode_kernels,
                                                using_quantized_decode_kernels)
from tutel.ops.gated_units import SWIGLU, GatedUnit

UNIT_ROUNDOFF = 2.0 ** -24  # float32's
# Half an ulp of the output dtype, relative (rounding to nearest).
OUTPUT_ROUNDING = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
GPT_OSS = GatedUnit(alpha=1.702, up_offset=1.0, limit=7.0, interleaved=True)
UNITS = {"swiglu": SWIGLU, "gpt_oss": GPT_OSS, "gelu": "gelu", "gelu_tanh": "gelu_tanh", "relu": "relu"}
KERNEL_SETS = list(quantized_decode_kernel_sets())  # every set this CPU runs, "portable" last

# ---- the formats, from their specifications -----------------------------------------------------

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (OCP MX v1.0): bit 3 the sign, bits 0-2 index the magnitudes."""
    codes = codes.long()
    magnitude = E2M1_MAGNITUDES[codes & 7]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def unpack_fp4(packed: torch.Tensor, low_first: bool = True) -> torch.Tensor:
    """uint8 [..., K/2] -> codes [..., K]: element 2j in byte j's low nibble, 2j+1 in its high one."""
    low, high = packed.long() & 15, packed.long() >> 4
    pairs = torch.stack([low, high] if low_first else [high, low], dim=-1)
    return pairs.flatten(-2)


def e8m0_values(scales: torch.Tensor, bias: int = 127) -> torch.Tensor:
    """E8M0 bytes: 2^(s - 127); 255 is NaN."""
    s = scales.long()
    value = torch.pow(torch.tensor(2.0, dtype=torch.float64), (s - bias).double())
    return torch.where(s == 255, torch.full_like(value, math.nan), value)


def e4m3_values(raw: torch.Tensor) -> torch.Tensor:
    """E4M3 "fn" bytes: sign bit 7, exponent bits 3-6 (bias 7), mantissa bits 0-2; exponent 0
    subnormal; 0x7f / 0xff NaN; no infinities."""
    b = raw.long()
    exponent, mantissa = (b >> 3) & 15, (b & 7).double()
    normal = (1 + mantissa / 8) * torch.pow(torch.tensor(2.0, dtype=torch.float64), (exponent - 7).double())
    magnitude = torch.where(exponent == 0, mantissa / 8 * 2.0 ** -6, normal)
    magnitude = torch.where((b & 0x7f) == 0x7f, torch.full_like(magnitude, math.nan), magnitude)
    return torch.where((b & 0x80) != 0, -magnitude, magnitude)


# Every byte's value by the definitions above, so that a stack decodes by lookup (each code
# still on its own).
E4M3_TABLE = e4m3_values(torch.arange(256))
E8M0_TABLE = e8m0_values(torch.arange(256))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def expand_blocks(scales: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """[E, R, C] per-block scales -> [E, rows, cols], block (i, j) covering rows i*b0.. and cols j*b1.."""
    return scales.repeat_interleave(block_rows, 1)[:, :rows].repeat_interleave(block_cols, 2)[:, :, :cols]


class Stack:
    """One quantized expert stack [E, N, K] in a format, with random codes and scales."""

    def __init__(self, format, experts, rows, cols, gen, block=(1, 1), scale_exponent=-4):
        self.format, self.rows, self.cols, self.block = format, rows, cols, block
        self.global_scale = None
        if format == "fp8_block":
            raw = torch.randint(0, 256, (experts, rows, cols), generator=gen, dtype=torch.uint8)
            raw[(raw & 0x7f) == 0x7f] = 0x38  # no NaN codes here (test_nan_codes has them)
            self.codes = raw.view(torch.float8_e4m3fn)
            blocks = (experts, -(-rows // block[0]), -(-cols // block[1]))
            # |q| reaches 448: scales bring the weights to ~2^scale_exponent.
            self.scales = (torch.rand(blocks, generator=gen, dtype=torch.float64) + 0.5).float() \
                * 2.0 ** (scale_exponent - 7)
        else:
            self.codes = torch.randint(0, 256, (experts, rows, cols // 2), generator=gen, dtype=torch.uint8)
            width = 32 if format == "mxfp4" else 16
            shape = (experts, rows, cols // width)
            if format == "mxfp4":
                self.scales = torch.randint(127 + scale_exponent - 2, 127 + scale_exponent + 1, shape, generator=gen,
                                            dtype=torch.uint8)
            else:  # positive E4M3 scales 2^-3 .. 2^1 with random mantissas, a global per expert
                exponents = torch.randint(4, 9, shape, generator=gen)
                mantissas = torch.randint(0, 8, shape, generator=gen)
                self.scales = ((exponents << 3) | mantissas).to(torch.uint8).view(torch.float8_e4m3fn)
                self.global_scale = (torch.rand(experts, generator=gen, dtype=torch.float64) + 0.5).float() \
                    * 2.0 ** scale_exponent

    def dequantized(self, low_first=True, e8m0_bias=127, neighbour_blocks=False) -> torch.Tensor:
        """W [E, N, K] in float64, each element decoded from its code and scaled (the arguments
        make the mutants the tests must tell apart)."""
        if self.format == "fp8_block":
            scales = self.scales.double()
            if neighbour_blocks:  # each block scaled by the next block's scale along the row
                scales = scales.roll(1, dims=2)
            return E4M3_TABLE[as_bytes(self.codes).long()] * expand_blocks(scales, self.rows, self.cols, *self.block)
        values = e2m1_values(unpack_fp4(self.codes, low_first))
        if self.format == "mxfp4":
            return values * e8m0_values(self.scales, e8m0_bias).repeat_interleave(32, -1)
        scales = E4M3_TABLE[as_bytes(self.scales).long()].repeat_interleave(16, -1)
        return values * scales * self.global_scale.double()[:, None, None]

    def kwargs(self, prefix):
        args = {prefix: self.codes, f"{prefix}_scales": self.scales}
        return args, ({f"{prefix}_global": self.global_scale} if self.global_scale is not None else {})


# ---- the experts in float64, and a bound of float32's error -------------------------------------

def unit_value(gate, up, unit, clamp=True):
    if isinstance(unit, str):
        if unit == "gelu":
            return 0.5 * up * (1 + torch.erf(up / math.sqrt(2)))
        if unit == "gelu_tanh":
            return 0.5 * up * (1 + torch.tanh(math.sqrt(2 / math.pi) * (up + 0.044715 * up ** 3)))
        return up.clamp(min=0)
    if unit.limit is not None and clamp:
        gate, up = gate.clamp(max=unit.limit), up.clamp(-unit.limit, unit.limit)
    return (up + unit.up_offset) * gate * torch.sigmoid(unit.alpha * gate)


def unit_slopes(gate, up, unit):
    """|d h / d gate| and |d h / d up| at each value, the larger of the clamped unit's and the
    unclamped one's (float32's errors may put a value on either side of the limit)."""
    slopes = []
    for clamp in (True, False):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        grads = torch.autograd.grad(unit_value(g, u, unit, clamp).sum(), (g, u), allow_unused=True,
                                    materialize_grads=True)
        slopes.append(tuple(grad.abs() for grad in grads))
    return torch.maximum(slopes[0][0], slopes[1][0]), torch.maximum(slopes[0][1], slopes[1][1])


def gamma(n):
    return n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)


def per_choice(matrices, vectors, e):
    """vectors[c] @ matrices[e[c]]^T for every choice c (vectors [C, K], matrices [E, N, K]),
    with the same for the absolute values (the sums' scale), one expert at a time."""
    products = vectors.new_zeros((vectors.shape[0], matrices.shape[1]))
    magnitudes = torch.zeros_like(products)
    for expert in e.unique().tolist():
        chosen = e == expert
        products[chosen] = vectors[chosen] @ matrices[expert].T
        magnitudes[chosen] = vectors[chosen].abs() @ matrices[expert].abs().T
    return products, magnitudes


def reference(x, expert_ids, weights, w_gate_up, w_down, gate_up_bias, down_bias, unit, dtype):
    """The experts' weighted sum in float64 and, per output, a bound of the error of float32
    sums (each product and sum rounded once), the unit's values rounded to `dtype` and the output's
    rounding to `dtype`."""
    experts, inter = w_gate_up.shape[0], w_down.shape[2]
    tokens, k = expert_ids.shape
    kept = ((expert_ids >= 0) & (expert_ids < experts)).reshape(-1)
    e = expert_ids.long().reshape(-1).clamp(0, experts - 1)
    xs = x.double().repeat_interleave(k, 0)  # [T k, H]: choice c = t k + j holds token t
    w = torch.ones(tokens * k, dtype=torch.float64) if weights is None else weights.double().reshape(-1)
    w = torch.where(kept, w, torch.zeros_like(w))
    gu, gu_abs = per_choice(w_gate_up, xs, e)
    if gate_up_bias is not None:
        gu, gu_abs = gu + gate_up_bias.double()[e], gu_abs + gate_up_bias.double().abs()[e]
    gu_error = gamma(x.shape[1] + 4) * gu_abs  # the sums, the scale products, the bias
    if isinstance(unit, str):
        gate, up, gate_error, up_error = torch.zeros_like(gu), gu, torch.zeros_like(gu), gu_error
    elif unit.interleaved:
        gate, up, gate_error, up_error = gu[:, 0::2], gu[:, 1::2], gu_error[:, 0::2], gu_error[:, 1::2]
    else:
        gate, up = gu[:, :inter], gu[:, inter:]
        gate_error, up_error = gu_error[:, :inter], gu_error[:, inter:]
    h = unit_value(gate, up, unit)
    slope_gate, slope_up = unit_slopes(gate, up, unit)
    # The inputs' errors through the unit, and the unit's own float32 evaluation (a few roundings
    # of each of its terms).
    h_error = slope_gate * gate_error + slope_up * up_error \
        + 32 * UNIT_ROUNDOFF * (h.abs() + slope_gate * gate.abs() + slope_up * up.abs())
    h_error = h_error + OUTPUT_ROUNDING[dtype] * (h.abs() + h_error)  # h rounded to the tokens' dtype
    y, y_abs = per_choice(w_down, h, e)
    carried, _ = per_choice(w_down.abs(), h_error, e)
    y_error = gamma(inter + 4) * y_abs + carried
    if down_bias is not None:
        y = y + down_bias.double()[e]
        y_error = y_error + gamma(2) * down_bias.double().abs()[e]
    outputs = w_down.shape[1]
    out = (y * w[:, None]).reshape(tokens, k, outputs).sum(1)
    out_error = ((y_error + gamma(k + 1) * y.abs()) * w.abs()[:, None]).reshape(tokens, k, outputs).sum(1)
    out_error = out_error + OUTPUT_ROUNDING[dtype] * (out.abs() + out_error) + 2.0 ** -24  # 2^-24: fp16's smallest
    return out, out_error


def outside(got, want, bound):
    """The outputs farther from `want` than `bound` (NaN where `want` is NaN counts as agreeing)."""
    distance = (got.double() - want).abs()
    both_nan = torch.isnan(got.double()) & torch.isnan(want)
    return ~((distance <= bound) | both_nan)


# ---- problems ------------------------------------------------------------------------------------

FORMAT_CASES = {
    # format, H, I, O, fp8 block: fp4 rows are whole blocks; nvfp4's 48 ends on a single 16-block;
    # fp8 with 200 columns ends on a partial 128-block, odd I and O, blocks of 24 columns end off
    # the kernels' 8-element steps; blocks of 64 columns are one bfloat16 round each (200 and 67
    # end on partial rounds); blocks of 32 columns are not whole rounds.
    "mxfp4": ("mxfp4", 64, 32, 64, None),
    "nvfp4": ("nvfp4", 48, 32, 48, None),
    "fp8_block": ("fp8_block", 200, 37, 200, (128, 128)),
    "fp8_small_blocks": ("fp8_block", 72, 19, 33, (16, 24)),
    "fp8_round_blocks": ("fp8_block", 200, 67, 130, (64, 64)),
    "fp8_half_round_blocks": ("fp8_block", 96, 45, 40, (32, 32)),
}
# Long rows: 517 blocks of 32 (hundreds of scales per row, the last round of one block) up, and 96
# columns (one round of two blocks, one of one) down.
LONG_ROWS = {"mxfp4_long_rows": ("mxfp4", 32 * 517, 96, 40, None)}
TOKEN_COUNTS = [0, 1, 3, 17, 32]
EXPERT_COUNTS = [1, 64]


class Problem:
    def __init__(self, case, unit, dtype, tokens, experts, seed, k=None, with_weights=True):
        format, hidden, inter, outputs, block = {**FORMAT_CASES, **LONG_ROWS}[case]
        gen = torch.Generator().manual_seed(seed)
        self.format, self.block, self.unit, self.dtype = format, block, unit, dtype
        up_rows = inter if isinstance(unit, str) else 2 * inter
        blocks = block or (1, 1)
        # Weights of ~2^-4 over 32-64 inputs bring gate and up values to a few units, some past
        # gpt-oss' limit of 7.
        self.gate_up = Stack(format, experts, up_rows, hidden, gen, blocks, scale_exponent=-3)
        self.down = Stack(format, experts, outputs, inter, gen, blocks, scale_exponent=-3)
        self.x = (torch.randn(tokens, hidden, generator=gen, dtype=torch.float64) * 2).to(dtype)
        if k is None:  # k from 1 to 8 over the token counts
            k = dict(zip(TOKEN_COUNTS, [2, 1, 8, 4, 8])).get(tokens, 3)
        ids = torch.randint(0, experts, (tokens, k), generator=gen, dtype=torch.int64)
        if tokens > 0 and k > 1:
            ids[0, -1] = experts + 2  # expert parallelism's sentinels: ids of no local expert
            ids[-1, 1] = ids[-1, 0]  # a token choosing one expert twice
        if tokens > 2:
            ids[1] = -1  # a token keeping no choice
        self.expert_ids = ids.to(torch.int32) if seed % 2 else ids
        self.weights = torch.rand(tokens, k, generator=gen) if with_weights else None
        biased = unit in (GPT_OSS, "gelu")
        self.gate_up_bias = torch.randn(experts, up_rows, generator=gen) if biased else None
        self.down_bias = torch.randn(experts, outputs, generator=gen) if biased else None

    def run(self):
        gate_up, gate_up_global = self.gate_up.kwargs("gate_up")
        down, down_global = self.down.kwargs("down")
        kwargs = dict(**gate_up_global, **down_global, gate_up_bias=self.gate_up_bias, down_bias=self.down_bias,
                      unit=self.unit)
        if self.block is not None:
            kwargs["block"] = self.block
        return decode_quantized_experts(self.x, self.expert_ids, self.weights, self.format, gate_up["gate_up"],
                                        gate_up["gate_up_scales"], down["down"], down["down_scales"], **kwargs)

    def reference(self, **mutation):
        return reference(self.x, self.expert_ids, self.weights, self.gate_up.dequantized(**mutation),
                         self.down.dequantized(**mutation), self.gate_up_bias, self.down_bias, self.unit, self.dtype)


def check(problem, kernels):
    want, bound = problem.reference()
    with using_quantized_decode_kernels(kernels):
        got = problem.run()
    assert got.dtype == problem.dtype and got.shape == want.shape
    bad = outside(got, want, bound)
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outputs outside the bound; worst excess "
                           f"{float(((got.double() - want).abs() - bound)[bad].max())}")
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unit_name", list(UNITS))
@pytest.mark.parametrize("case", list(FORMAT_CASES))
def test_against_the_float64_reference(case, unit_name, dtype):
    for seed, (tokens, experts) in enumerate((t, e) for t in TOKEN_COUNTS for e in EXPERT_COUNTS):
        problem = Problem(case, UNITS[unit_name], dtype, tokens, experts, seed)
        for kernels in KERNEL_SETS:
            check(problem, kernels)


@pytest.mark.parametrize("unit", [SWIGLU, GPT_OSS], ids=["swiglu", "gpt_oss"])
def test_rows_of_hundreds_of_scale_blocks(unit):
    for tokens in (1, 3):
        problem = Problem("mxfp4_long_rows", unit, torch.bfloat16, tokens, 2, seed=tokens, k=2)
        for kernels in KERNEL_SETS:
            check(problem, kernels)


def mxfp4_rows(rows):
    """An MXFP4 stack [1, len(rows), 32] whose row i holds the E2M1 codes rows[i] (a dict element ->
    code, the others 0) at scale 1, as (codes, scales) the operator takes."""
    codes = torch.zeros(1, len(rows), 32, dtype=torch.uint8)
    for i, row in enumerate(rows):
        for element, code in row.items():
            codes[0, i, element] = code
    return codes[..., 0::2] | (codes[..., 1::2] << 4), torch.full((1, len(rows), 1), 127, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unit", [SWIGLU, "relu"], ids=["swiglu", "relu"])
def test_the_units_values_take_the_tokens_dtype_between_the_products(unit, dtype):
    # Units 0 and 1 get ups of 1 + 2^-10 and 1 (E2M1 code 2 is 1.0, x = [1, 2^-10, 1, 0, ...]) and, gated,
    # equal gates of 6 + 4 = 10 (codes 7 and 6); the down row takes h0 - h1.  Rounded to bfloat16
    # the two values are equal and the output 0; kept in float32 it would be their difference.
    one, six, four, minus_one = 2, 7, 6, 10
    ups = [{0: one, 1: one}, {0: one}] + [{}] * 30
    gates = [{0: six, 2: four}] * 2 + [{}] * 30
    gate_up, gate_up_scales = mxfp4_rows(gates + ups if unit is SWIGLU else ups)
    down, down_scales = mxfp4_rows([{0: one, 1: minus_one}])
    x = torch.zeros(1, 32, dtype=torch.float64)
    x[0, :3] = torch.tensor([1.0, 2.0 ** -10, 1.0])
    x = x.to(dtype)
    u = torch.tensor([1 + 2.0 ** -10, 1.0], dtype=torch.float64)
    h = torch.nn.functional.silu(torch.tensor(10.0, dtype=torch.float64)) * u if unit is SWIGLU else u
    h = h.to(dtype).double()
    want = (h[0] - h[1]).to(dtype)
    if dtype == torch.bfloat16:
        assert want == 0  # the case is built for it
    for kernels in KERNEL_SETS:
        with using_quantized_decode_kernels(kernels):
            got = decode_quantized_experts(x, torch.zeros(1, 1, dtype=torch.int64), None, "mxfp4", gate_up,
                                           gate_up_scales, down, down_scales, unit=unit)
        torch.testing.assert_close(got[0, 0], want, rtol=1e-5 if dtype == torch.float32 else 0, atol=0,
                                   msg=lambda m: f"{kernels}: {m}")


@pytest.mark.parametrize("k", range(1, 9))
def test_every_k_without_routing_weights(k):
    for case in ("mxfp4", "fp8_block"):
        check(Problem(case, GPT_OSS, torch.bfloat16, 5, 64, seed=k, k=k, with_weights=False), "best")


def test_the_reference_is_held_tight_enough_to_fail():
    # The same kernel output against references of misread formats: nibbles in the other order,
    # an E8M0 bias of 128, fp8 scales of the neighbouring block.  Each lies outside the bound.
    for case, mutation in (("mxfp4", dict(low_first=False)), ("nvfp4", dict(low_first=False)),
                           ("mxfp4", dict(e8m0_bias=128)), ("fp8_small_blocks", dict(neighbour_blocks=True))):
        for dtype in DTYPES:
            problem = Problem(case, SWIGLU, dtype, 3, 4, seed=7)
            got = check(problem, "best")
            want, bound = problem.reference(**mutation)
            assert outside(got, want, bound).any(), (case, mutation, dtype)


def test_the_code_tables_match_pytorchs_float8_dtypes():
    every_byte = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    torch.testing.assert_close(e4m3_values(every_byte), every_byte.view(torch.float8_e4m3fn).double(), equal_nan=True)
    if hasattr(torch, "float8_e8m0fnu"):
        torch.testing.assert_close(e8m0_values(every_byte), every_byte.view(torch.float8_e8m0fnu).double(),
                                   equal_nan=True)
    assert e2m1_values(torch.arange(16)).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_nan_codes_reach_the_outputs_of_their_tokens(kernels, dtype):
    problem = Problem("fp8_block", SWIGLU, dtype, 4, 8, seed=3, k=2)
    chosen = int(problem.expert_ids[2, 0])
    raw = problem.gate_up.codes.view(torch.uint8).clone()
    raw[chosen, 0, 133] = 0x7f  # E4M3 NaN in the first gate row, the second round's second half
    problem.gate_up.codes = raw.view(torch.float8_e4m3fn)
    with using_quantized_decode_kernels(kernels):
        got = problem.run()
    takes_it = (problem.expert_ids == chosen).any(1)
    assert torch.isnan(got[takes_it]).all() and not torch.isnan(got[~takes_it]).any()
    # A NaN as an expert's first code stays out of the previous expert's last row, which ends on a
    # partial round that the kernels read up to, not past.
    edge = Problem("fp8_block", SWIGLU, dtype, 4, 8, seed=3, k=2)
    uses = [(edge.expert_ids == e).any(1) for e in range(8)]
    after = next(e for e in range(1, 8) if (uses[e - 1] & ~uses[e]).any())
    raw = edge.down.codes.view(torch.uint8).clone()
    raw[after, 0, 0] = 0x7f
    edge.down.codes = raw.view(torch.float8_e4m3fn)
    with using_quantized_decode_kernels(kernels):
        got = edge.run()
    # down row 0 is output 0
    expected = torch.zeros_like(got, dtype=torch.bool)
    expected[uses[after], 0] = True
    assert torch.equal(torch.isnan(got), expected)
    scales = Problem("mxfp4", "relu", dtype, 4, 8, seed=3, k=2)
    scales.down.scales[int(scales.expert_ids[0, 0])] = 255  # E8M0 NaN: every down row of the expert
    with using_quantized_decode_kernels(kernels):
        assert torch.isnan(scales.run()[0]).all()


def test_the_kernel_sets_and_thread_counts_agree_to_rounding():
    problem = Problem("nvfp4", GPT_OSS, torch.float32, 17, 64, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = problem.run()
        torch.set_num_threads(max(2, threads))
        several = problem.run()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, several)  # each output's sums run in one order whatever the threads
    want, bound = problem.reference()
    assert not outside(one, want, bound).any()
    for kernels in KERNEL_SETS:
        with using_quantized_decode_kernels(kernels):
            assert quantized_decode_kernels() == kernels
            assert not outside(problem.run(), want, bound).any()
    assert quantized_decode_kernels() == KERNEL_SETS[0]  # the best again


def test_the_fake_kernel_gives_the_output_shape_and_dtype():
    problem = Problem("mxfp4", GPT_OSS, torch.bfloat16, 3, 4, seed=1)
    with FakeTensorMode() as mode:
        for holder in (problem, problem.gate_up, problem.down):
            for name, value in list(vars(holder).items()):
                if isinstance(value, torch.Tensor):
                    setattr(holder, name, mode.from_tensor(value))
        out = problem.run()
    assert out.shape == (3, 64) and out.dtype == torch.bfloat16


def test_it_compiles_without_graph_breaks():
    problem = Problem("fp8_block", SWIGLU, torch.bfloat16, 3, 4, seed=2)
    compiled = torch.compile(lambda: problem.run(), fullgraph=True, backend="eager")
    assert torch.equal(compiled(), problem.run())


# ---- bad input -----------------------------------------------------------------------------------

def _call(problem, **changes):
    gate_up, gate_up_global = problem.gate_up.kwargs("gate_up")
    down, down_global = problem.down.kwargs("down")
    args = dict(x=problem.x, expert_ids=problem.expert_ids, weights=problem.weights, format=problem.format,
                **gate_up, **down, **gate_up_global, **down_global, unit=problem.unit)
    if problem.block is not None:
        args["block"] = problem.block
    args.update(changes)
    return decode_quantized_experts(**args)


@pytest.mark.parametrize("changes, error, words", [
    (dict(format="int4"), ValueError, "`format` must be one of"),
    (dict(x=torch.zeros(3, 64, dtype=torch.float64)), TypeError, "`x` must be float32, bfloat16 or float16"),
    (dict(x=torch.zeros(3, 32)), ValueError, "`gate_up` must be [4, 64, 16]"),
    (dict(expert_ids=torch.zeros(2, 2, dtype=torch.int64)), ValueError, "`expert_ids` must be [T, k] with T = 3"),
    (dict(expert_ids=torch.zeros(3, 2)), TypeError, "`expert_ids` must be int32 or int64"),
    (dict(weights=torch.ones(3, 5)), ValueError, "`weights` must have the shape of `expert_ids`"),
    (dict(gate_up=torch.zeros(4, 64, 16, dtype=torch.float16)), TypeError, "`gate_up` must be uint8"),
    (dict(gate_up_scales=torch.zeros(4, 64, 3, dtype=torch.uint8)), ValueError, "`gate_up_scales` must be [4, 64, 2]"),
    (dict(down=torch.zeros(5, 64, 16, dtype=torch.uint8)), ValueError, "`gate_up` holds 4 experts and `down` 5"),
    (dict(down_scales=torch.zeros(4, 64, 1)), TypeError, "`down_scales` must be uint8 or float8_e8m0fnu"),
    (dict(gate_up_global=torch.ones(4)), ValueError, "`gate_up_global` is nvfp4's"),
    (dict(block=(32, 32)), ValueError, "`block` is fp8_block's"),
    (dict(gate_up_bias=torch.zeros(4, 63)), ValueError, "`gate_up_bias` must be [4, 64]"),
    (dict(down_bias=torch.zeros(4, 64, dtype=torch.int32)), TypeError, "`down_bias` must be float32"),
    (dict(unit="silu"), ValueError, "`unit` 'silu' is not a unit"),
    (dict(unit=GatedUnit(limit=-1.0)), ValueError, "limit None or a finite number > 0"),
    (dict(unit=3), TypeError, "`unit` must be a tutel.ops.gated_units.GatedUnit"),
    (dict(unit="gelu"), ValueError, "`gate_up` must be [4, 32, 32]"),
])
def test_bad_input_is_named(changes, error, words):
    problem = Problem("mxfp4", SWIGLU, torch.float32, 3, 4, seed=1)
    with pytest.raises(error, match=re.escape(words)):
        _call(problem, **changes)


def test_bad_input_of_the_other_formats_is_named():
    nvfp4 = Problem("nvfp4", SWIGLU, torch.float32, 3, 4, seed=1)
    with pytest.raises(ValueError, match="nvfp4 needs `down_global`"):
        _call(nvfp4, down_global=None)
    with pytest.raises(TypeError, match="`gate_up_scales` must be float8_e4m3fn"):
        _call(nvfp4, gate_up_scales=nvfp4.gate_up.scales.view(torch.uint8))
    with pytest.raises(ValueError, match="multiple of 16"):
        _call(nvfp4, x=torch.zeros(3, 40), gate_up=torch.zeros(4, 64, 20, dtype=torch.uint8))
    fp8 = Problem("fp8_block", SWIGLU, torch.float32, 3, 4, seed=1)
    with pytest.raises(ValueError, match=r"`down_scales` must be \[4, 2, 1\]"):
        _call(fp8, block=(128, 128), down_scales=torch.ones(4, 1, 1))
    with pytest.raises(ValueError, match=r"`block` must be \(rows, cols\)"):
        _call(fp8, block=(0, 128))
    with pytest.raises(TypeError, match="`gate_up` must be float8_e4m3fn"):
        _call(fp8, gate_up=fp8.gate_up.codes.view(torch.uint8))
    with torch.enable_grad(), pytest.raises(RuntimeError, match="no backward"):
        _call(fp8, x=fp8.x.clone().requires_grad_())


def test_the_operator_checks_its_arguments_itself():
    problem = Problem("mxfp4", SWIGLU, torch.float32, 3, 4, seed=1)
    args = [problem.x, problem.expert_ids, problem.weights, "mxfp4", problem.gate_up.codes, problem.gate_up.scales,
            None, problem.down.codes, problem.down.scales, None, [], None, None, "gated", 1.0, 0.0, None, False]
    for index, value, words in ((3, "fp6", "is not a weight format"), (13, "tanh", "is not a unit"),
                                (10, [128, 128], "`block` is fp8_block's"),
                                (5, problem.gate_up.scales[:, :, :1], "`gate_up_scales` must be")):
        bad = list(args)
        bad[index] = value
        with pytest.raises(ValueError, match=words):
            torch.ops.tutel.decode_quantized_experts(*bad)


def test_the_kernel_set_is_named():
    with pytest.raises(ValueError, match="'avx9' is not a kernel set this CPU runs; allowed: 'best', "):
        set_quantized_decode_kernels("avx9")
    assert KERNEL_SETS[-1] == "portable" and set(KERNEL_SETS) <= {"avx512_bf16", "avx512", "avx2", "portable"}
    assert quantized_decode_kernels() == KERNEL_SETS[0]

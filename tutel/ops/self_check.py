"""Runs two implementations of tutel's operators on the same small random problems and compares them.

Used at the first use of each CUDA device (the compiled kernels against the
composite PyTorch operators, see tutel.ops.backend) and by ``python -m
tutel.check``.  The implementations are parameters (objects with the operators
as attributes, like ``torch.ops.tutel``), so the comparison itself is tested on
the CPU.  Moves, counts, slots and route_experts' choices and plan must agree
exactly; the dot products of the gate gradient, route_experts' weights and loss,
decode_experts', decode_quantized_experts' and quantized_grouped_linear's sums and the other
reductions summed
in another order, to their dtype's rounding.
"""
import contextlib
import math
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..rules.lines import DECODE_MAX_CHOICES, DECODE_MAX_TOKENS  # the decode kernel's limits

OPERATORS = ("route_topk", "assign_locations", "cumsum_sub_one", "gather_slots", "scatter_slots", "group_by_expert",
             "gated_unit", "gated_unit_backward", "gated_unit_pair", "gated_unit_pair_backward", "add_expert_bias_",
             "expert_row_sums", "choice_rows", "grouped_rows_linear", "grouped_rows_linear_backward", "route_experts",
             "decode_experts", "decode_quantized_experts", "quantized_grouped_linear")
DATA_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

# Outputs compared to rounding rather than exactly: (operator, output number).
_REDUCTIONS = {("gather_slots", 1), ("scatter_slots", 1)}
_DOT_TOLERANCES = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=1e-4)}
# The gated units' outputs, which differ where the implementations' exponentials round
# differently: each value within a few of its dtype's ulps (the absolute part covers values
# near zero, where d gate cancels), and at most _UNIT_DIFFERING of them differing at all, since
# a rounding difference shows in some values and a wrong result in all of them.
_UNITS = {"gated_unit", "gated_unit_backward", "gated_unit_pair", "gated_unit_pair_backward"}
_UNIT_TOLERANCES = {torch.float64: dict(rtol=1e-13, atol=1e-13), torch.float32: dict(rtol=1e-5, atol=1e-5),
                    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}
_UNIT_DIFFERING = 0.5
# The experts' row sums, summed in another order by the composite operator (index_add_, atomics on
# CUDA): to the accumulation dtype's rounding of sums of up to a few thousand values of size ~1
# (FULL_SIZES), then one rounding to the data dtype.
_ROW_SUMS = "expert_row_sums"
_ROW_SUM_TOLERANCES = {torch.float64: dict(rtol=1e-12, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-3),
                       torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}
# The grouped products, summed in another order by the composite operator (PyTorch's matrix
# products): each value to the accumulation dtype's rounding of sums of up to a few thousand terms
# of size ~1, then one rounding to the data dtype.
_PRODUCTS = {"grouped_rows_linear", "grouped_rows_linear_backward"}
# route_experts' floating outputs (the weights, 1, and the loss, 8) are in the accumulation dtype,
# computed from the same scores in another order: to that dtype's rounding.  Its other outputs are
# integers, compared exactly.
_ROUTE_EXPERTS = "route_experts"
_ROUTING_FLOATS = {1, 8}
_ROUTING_TOLERANCES = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}
# decode_experts' [T, O] result: the accumulation dtype's sums of a few hundred products of size ~1,
# then one rounding to the data dtype (the CPU operator also rounds the gated unit's values to it).
_DECODE_EXPERTS = "decode_experts"
# decode_quantized_experts' [T, O] result: float32 sums of a few hundred products of size ~1 with
# exactly decoded weights, then one rounding to the data dtype, as decode_experts' in float32.
_DECODE_QUANTIZED = "decode_quantized_experts"
# quantized_grouped_linear's [n, N] result: the same float32 sums over rows grouped by expert (a few
# hundred products of size ~1 each), to the same tolerances.
_QUANTIZED_LINEAR = "quantized_grouped_linear"
_DECODE_TOLERANCES = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=1e-4),
                      torch.bfloat16: dict(rtol=4e-2, atol=4e-2), torch.float16: dict(rtol=6e-3, atol=6e-3)}
# Operators that write their result into an argument (its number) and return nothing.
_IN_PLACE = {"add_expert_bias_": 0}
# Operators whose arguments keep their strides on the device they are moved to (row-strided views
# are what these read in place), each call getting its own copy (the in-place one writes it).
_LAYOUT_KEPT = {"add_expert_bias_", "expert_row_sums", "choice_rows", "grouped_rows_linear",
                "grouped_rows_linear_backward"}


class Case(NamedTuple):
    """One call: the operator's name, a label for messages, and its arguments (CPU tensors)."""

    operator: str
    label: str
    args: Tuple


class Sizes(NamedTuple):
    tokens: int
    experts: int
    k: int
    capacity: int
    model_dim: int


# Small, yet several blocks and chunks for the kernels: 520 tokens are 3 blocks of gather rows,
# 9 chunks of slot assignment and of cumsum rows.  model_dim 24 and 16 take the 16-byte vector
# paths, 7 the element-wise ones.
QUICK_SIZES = (Sizes(45, 5, 2, 7, 24), Sizes(67, 9, 3, 11, 7), Sizes(520, 12, 2, 100, 16))
FULL_SIZES = QUICK_SIZES + (Sizes(0, 3, 1, 4, 8), Sizes(1, 1, 1, 1, 1), Sizes(37, 5, 2, 0, 8),
                            Sizes(1000, 64, 4, 70, 64), Sizes(257, 600, 3, 2, 33), Sizes(64, 4, 4, 80, 2048),
                            Sizes(3000, 16, 8, 1600, 5))


def _tied_scores(tokens: int, experts: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Scores with many exact ties, -0 and NaN: the cases where top-k rules matter."""
    scores = torch.randint(0, 6, (tokens, experts), generator=generator).to(torch.float64) / 4 - 0.5
    scores[torch.rand(tokens, experts, generator=generator) < 0.1] = -0.0
    scores[torch.rand(tokens, experts, generator=generator) < 0.03] = float("nan")
    return scores.to(dtype)


def _distinct_slots(s: Sizes, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """(indices, locations) [k, T] naming every slot at most once: first choices take
    distinct random slots (or are dropped when the slots run out), later choices are dropped."""
    slots = s.experts * s.capacity
    pick = torch.randperm(max(slots, s.tokens), generator=generator)[: s.tokens]
    indices = torch.randint(0, s.experts, (s.k, s.tokens), generator=generator, dtype=torch.int32)
    locations = torch.full((s.k, s.tokens), s.capacity, dtype=torch.int32)
    kept = pick < slots
    if s.capacity > 0:
        indices[0] = torch.where(kept, pick // s.capacity, indices[0].long()).to(torch.int32)
        locations[0] = torch.where(kept, pick % s.capacity, torch.full_like(pick, s.capacity)).to(torch.int32)
    return indices, locations


def _cases(sizes: Sequence[Sizes], seed: int) -> Iterator[Case]:
    g = torch.Generator().manual_seed(seed)
    rows_generator = torch.Generator().manual_seed(seed + 1)  # the grouped rows' cases draw from their own
    routing_generator = torch.Generator().manual_seed(seed + 2)  # and so do route_experts' and decode_experts'
    quantized_generator = torch.Generator().manual_seed(seed + 3)  # and quantized_grouped_linear's

    def randn(*shape, dtype):
        return torch.randn(*shape, generator=g).to(dtype)

    for s in sizes:
        tag = f"tokens={s.tokens} experts={s.experts} k={s.k}"
        for dtype in DATA_DTYPES:
            name = str(dtype).replace("torch.", "")
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            for prioritized in (False, True):
                yield Case("route_topk", f"{name} tied scores {tag} batch_prioritized={prioritized}",
                           (_tied_scores(s.tokens, s.experts, dtype, g), s.k, prioritized))
            softmax = torch.randn(s.tokens, s.experts, generator=g).softmax(1).to(dtype)
            yield Case("route_topk", f"{name} softmax scores {tag}", (softmax, s.k, True))
            indices = torch.randint(0, s.experts, (s.k, s.tokens), generator=g, dtype=torch.int32)
            yield Case("assign_locations", f"{name} priority {tag}",
                       (indices, s.experts, _tied_scores(1, s.tokens, dtype, g)[0]))
            # Locations up to capacity + 1: some choices dropped, some slots named twice.
            locations = torch.randint(0, s.capacity + 2, (s.k, s.tokens), generator=g, dtype=torch.int32)
            weights = (torch.rand(s.k, s.tokens, generator=g) + 0.1).to(acc)
            weights[0, ::3] = 1
            slot_tag = f"{name} {tag} capacity={s.capacity} model_dim={s.model_dim}"
            rows = randn(s.experts, s.capacity, s.model_dim, dtype=dtype)
            src = randn(s.tokens, s.model_dim, dtype=dtype)
            distinct = _distinct_slots(s, g)
            for w in (None, weights):
                weighted = "weighted" if w is not None else "unweighted"
                yield Case("gather_slots", f"{slot_tag} {weighted}",
                           (rows, indices, locations, w, randn(s.tokens, s.model_dim, dtype=dtype)))
                yield Case("scatter_slots", f"{slot_tag} {weighted} shared slots",
                           (src, indices, locations, w, randn(s.experts, s.capacity, s.model_dim, dtype=dtype),
                            s.experts, s.capacity))
                yield Case("scatter_slots", f"{slot_tag} {weighted} distinct slots",
                           (src, *distinct, w, None, s.experts, s.capacity))
        yield from _expert_cases(s, tag, g)
        yield from _expert_row_cases(s, tag, rows_generator)
        yield from _route_experts_cases(s, tag, routing_generator)
        yield from _decode_experts_cases(s, routing_generator)
        yield from _decode_quantized_cases(s, routing_generator)
        yield from _quantized_linear_cases(s, quantized_generator)
        yield Case("assign_locations", f"{tag} token order",
                   (torch.randint(0, s.experts, (s.k, s.tokens), generator=g, dtype=torch.int32), s.experts, None))
        for mask_dtype in (torch.bool, torch.int32, torch.int64, torch.float32, torch.float64):
            low = 0 if mask_dtype == torch.bool else -3
            mask = torch.randint(low, 2, (s.tokens * s.k, s.experts), generator=g).to(mask_dtype)
            yield Case("cumsum_sub_one", f"{str(mask_dtype).replace('torch.', '')} mask {tuple(mask.shape)}",
                       (mask,))


# The gated units' parameters: SwiGLU, gpt-oss' (clamped, offset, interleaved), clamped halves.
_UNIT_PARAMETERS = ((1.0, 0.0, None, False), (1.702, 1.0, 7.0, True), (0.5, -0.25, 3.0, False))


def _unit_values(rows: int, columns: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Normal values times 4 with the clamp bounds (±7, ±3), NaN, -0, ±90 and ±inf in some places."""
    values = torch.randn(rows, columns, generator=generator, dtype=torch.float64) * 4
    specials = torch.tensor([7.0, -7.0, 3.0, -3.0, float("nan"), 90.0, -90.0, -0.0, float("inf"), float("-inf")],
                            dtype=torch.float64)
    pick = torch.randint(0, 64, (rows, columns), generator=generator)
    values = torch.where(pick < len(specials), specials[pick.clamp(max=len(specials) - 1)], values)
    return values.to(dtype)


def _expert_cases(s: Sizes, tag: str, g: torch.Generator) -> Iterator[Case]:
    """group_by_expert (int32 and int64 ids, some outside [0, E), a transposed view) and the gated
    units (every data dtype and unit; I = model_dim; gated_unit and its backward also with the
    per-expert bias of E experts)."""
    ids = torch.randint(-2, s.experts + 2, (s.tokens, s.k), generator=g)
    yield Case("group_by_expert", f"int64 ids {tag}", (ids, s.experts))
    yield Case("group_by_expert", f"int32 ids transposed {tag}", (ids.t().contiguous().to(torch.int32).t(), s.experts))
    width = s.model_dim
    for dtype in DATA_DTYPES:
        name = str(dtype).replace("torch.", "")
        for alpha, offset, limit, interleaved in _UNIT_PARAMETERS:
            unit = f"{name} alpha={alpha} up_offset={offset} limit={limit} interleaved={interleaved} {tag} I={width}"
            gate_up = _unit_values(s.tokens, 2 * width, dtype, g)
            grad = _unit_values(s.tokens, width, dtype, g)
            yield Case("gated_unit", unit, (gate_up, alpha, offset, limit, interleaved))
            yield Case("gated_unit_backward", unit, (grad, gate_up, alpha, offset, limit, interleaved))
            if not interleaved:
                gate, up = gate_up[:, :width], gate_up[:, width:]  # row-strided views
                yield Case("gated_unit_pair", unit, (gate, up, alpha, offset, limit))
                yield Case("gated_unit_pair_backward", unit, (grad, gate, up, alpha, offset, limit))
        for alpha, offset, limit, interleaved in _UNIT_PARAMETERS[:2]:
            # The per-expert bias of rows grouped by expert: random ends, so some experts are idle
            # and some rows lie past the last expert's.
            unit = (f"{name} alpha={alpha} up_offset={offset} limit={limit} interleaved={interleaved} {tag} "
                    f"I={width} biased")
            gate_up = _unit_values(s.tokens, 2 * width, dtype, g)
            grad = _unit_values(s.tokens, width, dtype, g)
            bias = (torch.randn(s.experts, 2 * width, generator=g, dtype=torch.float64) * 2).to(dtype)
            ends = torch.randint(0, s.tokens + 1, (s.experts,), generator=g).sort().values.to(torch.int32)
            yield Case("gated_unit", unit, (gate_up, alpha, offset, limit, interleaved, bias, ends))
            yield Case("gated_unit_backward", unit, (grad, gate_up, alpha, offset, limit, interleaved, bias, ends))


def _grouped_ends(rows: int, experts: int, generator: torch.Generator) -> torch.Tensor:
    """[experts] int32 non-decreasing ends within [0, rows]: random group sizes, about a quarter of
    the experts idle, and a random number of rows past the last expert's."""
    weights = torch.rand(experts, generator=generator) * (torch.rand(experts, generator=generator) > 0.25)
    used = int(torch.randint(0, rows + 1, (1,), generator=generator)) if rows else 0
    shares = weights / weights.sum() if float(weights.sum()) > 0 else torch.zeros(experts)
    return (shares.cumsum(0) * used).floor().clamp(max=used).to(torch.int32)


def _expert_row_cases(s: Sizes, tag: str, g: torch.Generator) -> Iterator[Case]:
    """add_expert_bias_, expert_row_sums, grouped_rows_linear and its backward (grouped rows
    [T k, model_dim] as a row-strided view, idle experts, rows past the last expert's) and
    choice_rows (group_by_expert's slot choices)."""
    rows, width = s.tokens * s.k, s.model_dim
    choices = torch.randperm(rows, generator=g)  # a permutation, as group_by_expert's slot choices are
    for dtype in DATA_DTYPES:
        name = str(dtype).replace("torch.", "")
        label = f"{name} {tag} rows={rows} columns={width}"
        ends = _grouped_ends(rows, s.experts, g)
        grouped = torch.randn(rows, width + 3, generator=g).to(dtype)[:, :width]
        yield Case("add_expert_bias_", label, (grouped, torch.randn(s.experts, width, generator=g).to(dtype), ends))
        yield Case("expert_row_sums", label, (grouped, ends))
        tokens = torch.randn(s.tokens, width + 1, generator=g).to(dtype)[:, :width]
        yield Case("choice_rows", label, (tokens, choices, s.k))
        # The grouped products in both weight layouts, with and without a bias; O odd.
        outputs = width // 2 + 3
        for transposed in (False, True):
            shape = (s.experts, width, outputs) if transposed else (s.experts, outputs, width)
            weight = torch.randn(*shape, generator=g).to(dtype)
            bias = torch.randn(s.experts, outputs, generator=g).to(dtype) if transposed else None
            product = f"{label} outputs={outputs} transposed={transposed}"
            yield Case("grouped_rows_linear", product, (grouped, weight, bias, ends, transposed))
            grad = torch.randn(rows, outputs, generator=g).to(dtype)
            mask = [True, True, True] if transposed else [False, True, True]
            yield Case("grouped_rows_linear_backward", f"{product} mask={mask}",
                       (grad, grouped, weight, ends, transposed, mask))


# route_experts' integer outputs follow from comparisons of scores that the two implementations
# compute with different exponentials and sums, so the cases compare only numbers that come out
# the same in both, whatever the last bit of a score (tests/python/test_self_check_routing.py
# checks these levels for every dtype):
# * softmax over logits on two levels 45 apart: a token's top score is 1/m for its m best experts
#   (the others add at most 600 e^-45 < 2^-54 to the sum, below float64's rounding of m), so equal m
#   tie exactly across tokens, and the levels within a row are a factor e^45 apart;
# * sigmoid and sqrt(softplus) of logits on the levels (i + 0.07) / 4, |i| <= 12: equal logits give
#   equal scores, distinct ones scores far apart, none within a float32 rounding of a 16-bit
#   float's rounding boundary, no two pairs with (nearly) equal sums (the group scores), and a
#   selection bias that is one multiple of 4 per group (scores stay below 2, so a bias never
#   brings two scores close, and two groups holding the same scores tie exactly or differ by 8);
# * softmax_after_topk ranks the logits themselves (multiples of 1/4, -0 and NaN) plus biases that
#   are multiples of 1/4: exact sums.
ROUTING_LEVELS = tuple((i + 0.07) / 4 for i in range(-12, 13))
_BIAS_STEP = 4.0


SOFTMAX_LEVEL_GAP = 45.0


def _softmax_levels(tokens: int, experts: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Logits offset or offset - SOFTMAX_LEVEL_GAP, a per-token integer offset in [-2, 2]."""
    levels = -SOFTMAX_LEVEL_GAP * torch.randint(0, 2, (tokens, experts), generator=generator).to(torch.float64)
    offsets = torch.randint(-2, 3, (tokens, 1), generator=generator).to(torch.float64)
    return (levels + offsets).to(dtype)


def _scored_levels(tokens: int, experts: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Logits on ROUTING_LEVELS, with many exact ties."""
    levels = torch.tensor(ROUTING_LEVELS, dtype=torch.float64)
    return levels[torch.randint(0, len(ROUTING_LEVELS), (tokens, experts), generator=generator)].to(dtype)


def _groups(experts: int, k: int) -> Tuple[int, int]:
    """(n_group, topk_group): the smallest divisor >= 2 of the experts (else 1 group), and enough
    kept groups for k choices (about half of the groups when that is more)."""
    n_group = next((d for d in range(2, experts + 1) if experts % d == 0), 1)
    size = experts // n_group
    return n_group, min(n_group, max(-(-k // size), n_group // 2))


def _route_experts_cases(s: Sizes, tag: str, g: torch.Generator) -> Iterator[Case]:
    """route_experts in every data dtype: softmax with batch priority, capacity, renormalisation and
    the loss; sigmoid or sqrt(softplus) with a selection bias per group, groups, scaling, batch priority and
    (for some dtypes) no capacity; softmax_after_topk over tied logits with -0 and NaN, a bias and no
    loss.  The inputs are the levels described above."""
    k = min(s.k, s.experts)
    for number, dtype in enumerate(DATA_DTYPES):
        name = str(dtype).replace("torch.", "")
        label = f"{name} {tag} capacity={s.capacity}"
        yield Case(_ROUTE_EXPERTS, f"{label} softmax, levels {SOFTMAX_LEVEL_GAP:g} apart, prioritized, renormalized",
                   (_softmax_levels(s.tokens, s.experts, dtype, g), k, "softmax", False, None, 0, 0, True, 1.0,
                    True, s.capacity, True))
        score = "sigmoid" if number % 2 == 0 else "sqrt_softplus"
        bias_dtype = torch.float32 if number < 2 else torch.float64
        n_group, topk_group = _groups(s.experts, k)
        bias = (torch.randint(0, 3, (n_group,), generator=g) * _BIAS_STEP).repeat_interleave(s.experts // n_group)
        bias = bias.to(bias_dtype)
        capacity = -1 if number % 2 else s.capacity
        yield Case(_ROUTE_EXPERTS, f"{label} {score}, bias, groups {n_group}/{topk_group}, capacity {capacity}",
                   (_scored_levels(s.tokens, s.experts, dtype, g), k, score, False, bias, n_group, topk_group, True,
                    2.5, True, capacity, True))
        bias = (torch.randint(-4, 5, (s.experts,), generator=g) / 4).to(bias_dtype)
        yield Case(_ROUTE_EXPERTS, f"{label} softmax_after_topk, tied logits with NaN, bias, no loss",
                   (_tied_scores(s.tokens, s.experts, dtype, g), k, "softmax", True, bias, 0, 0, False, 1.0, True,
                    s.capacity, False))


_DECODE_FORMS = ("concatenated", "interleaved", "separate")


def _decode_experts_cases(s: Sizes, g: torch.Generator) -> Iterator[Case]:
    """decode_experts at the kernel's sizes (up to DECODE_MAX_TOKENS tokens and DECODE_MAX_CHOICES
    choices) in every data dtype, both matrix layouts, the three gate forms in turn (concatenated
    SwiGLU, gpt-oss' interleaved clamped unit with biases, separate gate matrices), int32 and int64
    ids with dropped choices, float32, bfloat16 or no routing weights."""
    tokens = min(s.tokens, DECODE_MAX_TOKENS)
    k = max(1, min(s.k, DECODE_MAX_CHOICES // max(tokens, 1)))
    hidden, inter, outputs = s.model_dim, min(s.model_dim, 64), s.model_dim + 3
    for number, dtype in enumerate(DATA_DTYPES):
        name = str(dtype).replace("torch.", "")
        for transposed in (False, True):
            form = _DECODE_FORMS[(number + transposed) % 3]
            separate, interleaved = form == "separate", form == "interleaved"
            width = inter if separate else 2 * inter
            ids = torch.randint(-1, s.experts + 1, (tokens, k), generator=g)  # -1 and E: dropped
            ids = ids.to(torch.int64 if transposed else torch.int32)
            weights = None if number == 3 and transposed else \
                (torch.rand(tokens, k, generator=g) + 0.25).to(torch.bfloat16 if transposed else torch.float32)

            def matrix(rows: int, columns: int) -> torch.Tensor:
                shape = (s.experts, columns, rows) if transposed else (s.experts, rows, columns)
                return (torch.randn(*shape, generator=g) * columns ** -0.5).to(dtype)

            up = matrix(width, hidden)
            gate = matrix(width, hidden) if separate else None
            down = matrix(outputs, inter)
            up_bias = (torch.randn(s.experts, width, generator=g) * 0.5).to(dtype) if interleaved else None
            down_bias = (torch.randn(s.experts, outputs, generator=g) * 0.5).to(dtype) if interleaved else None
            alpha, up_offset, limit = (1.702, 1.0, 1.5) if interleaved else (1.0, 0.0, None)
            x = torch.randn(tokens, hidden, generator=g).to(dtype)
            yield Case(_DECODE_EXPERTS, f"{name} tokens={tokens} k={k} experts={s.experts} H={hidden} I={inter} "
                                        f"O={outputs} {form} transposed={transposed}",
                       (x, ids, weights, up, down, up_bias, down_bias, transposed, alpha, up_offset, limit,
                        interleaved, gate))


# decode_quantized_experts' units in turn: (activation, alpha, up_offset, limit, interleaved).
_QUANTIZED_UNITS = (("gated", 1.0, 0.0, None, False), ("gated", 1.702, 1.0, 1.5, True), ("gelu", 1.0, 0.0, None, False),
                    ("gelu_tanh", 1.0, 0.0, None, False), ("relu", 1.0, 0.0, None, False))


def _quantized_stack(format: str, experts: int, rows: int, cols: int, block: Sequence[int],
                     g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(codes, scales, global) of one random [experts, rows, cols] stack whose rows' products with
    unit-sized activations stay near 1: every fp4 code; E4M3 codes up to 2^2 (subnormals included)."""
    shift = max(0, round(math.log2(math.sqrt(cols))))
    if format == "fp8_block":
        magnitude = torch.randint(0, 72, (experts, rows, cols), generator=g, dtype=torch.int32)  # exponents 0..8
        sign = torch.randint(0, 2, (experts, rows, cols), generator=g, dtype=torch.int32) << 7
        codes = (magnitude | sign).to(torch.uint8).view(torch.float8_e4m3fn)
        grid = (experts, -(-rows // block[0]), -(-cols // block[1]))
        scales = (torch.rand(grid, generator=g) * 1.5 + 0.5) * 2.0 ** -shift
        return codes, scales, None
    codes = torch.randint(0, 256, (experts, rows, cols // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    if format == "mxfp4":
        scales = torch.randint(124 - shift, 128 - shift, (experts, rows, cols // 32), generator=g,
                               dtype=torch.int32).to(torch.uint8)
        return codes, scales, None
    scale_bytes = torch.randint(40, 72, (experts, rows, cols // 16), generator=g, dtype=torch.int32)  # 0.25..3.75
    global_scale = (torch.rand(experts, generator=g) * 0.2 + 0.15) * 2.0 ** -shift
    return codes, scale_bytes.to(torch.uint8).view(torch.float8_e4m3fn), global_scale


def _decode_quantized_cases(s: Sizes, g: torch.Generator) -> Iterator[Case]:
    """decode_quantized_experts at decoding sizes (up to DECODE_MAX_TOKENS tokens) in every
    activation dtype, the three formats and the five units in turn: rows of whole 16-byte chunks and
    of other lengths, fp8_block with 16 x 16 and partial 128 x 128 blocks, int32 and int64 ids with
    dropped choices, biases and routing weights or none."""
    tokens = min(s.tokens, DECODE_MAX_TOKENS)
    k = max(1, min(s.k, DECODE_MAX_CHOICES // max(tokens, 1)))
    for number, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        for form in range(2):
            format = ("mxfp4", "nvfp4", "fp8_block")[(number + form + s.model_dim) % 3]
            activation, alpha, up_offset, limit, interleaved = _QUANTIZED_UNITS[(2 * number + form + s.k) % 5]
            if format == "fp8_block":
                block = [16, 16] if form == 0 else [128, 128]
                hidden, inter = (64, 48) if form == 0 else (s.model_dim * 3 + 133, 40)
            else:
                block = []
                width = 32 if format == "mxfp4" else 16
                hidden, inter = width * (2 + form + s.model_dim % 3), width * (1 + form)
            outputs = s.model_dim + 3
            up_rows = 2 * inter if activation == "gated" else inter
            gate_up = _quantized_stack(format, s.experts, up_rows, hidden, block, g)
            down = _quantized_stack(format, s.experts, outputs, inter, block, g)
            ids = torch.randint(-1, s.experts + 1, (tokens, k), generator=g)  # -1 and E: dropped
            ids = ids.to(torch.int64 if form else torch.int32)
            weights = None if number == 2 and form else (torch.rand(tokens, k, generator=g) + 0.25).to(
                torch.bfloat16 if form else torch.float32)
            biased = form == 1 or interleaved
            gate_up_bias = torch.randn(s.experts, up_rows, generator=g) * 0.5 if biased else None
            down_bias = torch.randn(s.experts, outputs, generator=g) * 0.5 if biased else None
            x = torch.randn(tokens, hidden, generator=g).to(dtype)
            yield Case(_DECODE_QUANTIZED, f"{str(dtype).replace('torch.', '')} {format} {activation} tokens={tokens} "
                                          f"k={k} experts={s.experts} H={hidden} I={inter} O={outputs} block={block}",
                       (x, ids, weights, format, gate_up[0], gate_up[1], gate_up[2], down[0], down[1], down[2],
                        block, gate_up_bias, down_bias, activation, alpha, up_offset, limit, interleaved))


def _quantized_linear_cases(s: Sizes, g: torch.Generator) -> Iterator[Case]:
    """quantized_grouped_linear over the routed rows grouped by expert (T k rows, random ends with
    idle experts and rows past the last expert's) in every rows dtype, the three formats in turn:
    rows of whole and partial depth tiles, fp8_block with partial 128 x 128 blocks (K not a
    multiple of 16) and with blocks 24 wide (steps split at block boundaries), the first also with
    W8A8 activations (activation_group 128); int32 and int64 ends, a float32 bias or none;
    N = model_dim + 3 (odd where model_dim is even)."""
    rows = s.tokens * s.k
    outputs = s.model_dim + 3
    for number, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        for form in range(2):
            format = ("mxfp4", "nvfp4", "fp8_block")[(number + form + s.model_dim) % 3]
            if format == "fp8_block":
                block = [128, 128] if form == 0 else [16, 24]
                depth = 200 if form == 0 else 72
            else:
                block = []
                depth = (32 if format == "mxfp4" else 16) * (2 + form + s.model_dim % 3)
            codes, scales, global_scale = _quantized_stack(format, s.experts, outputs, depth, block, g)
            ends = _grouped_ends(rows, s.experts, g).to(torch.int64 if form else torch.int32)
            bias = torch.randn(s.experts, outputs, generator=g) * 0.5 if form == 0 else None
            x = torch.randn(rows, depth, generator=g).to(dtype)
            yield Case(_QUANTIZED_LINEAR, f"{str(dtype).replace('torch.', '')} {format} rows={rows} "
                                          f"experts={s.experts} K={depth} N={outputs} block={block} "
                                          f"ends={str(ends.dtype).replace('torch.', '')}",
                       (x, ends, format, codes, scales, global_scale, block, bias))
            if format == "fp8_block" and form == 0:  # W8A8: the rows quantized per 128 columns (the last 72)
                yield Case(_QUANTIZED_LINEAR, f"{str(dtype).replace('torch.', '')} fp8_block W8A8 rows={rows} "
                                              f"experts={s.experts} K={depth} N={outputs} block={block} "
                                              f"activation_group=128",
                           (x, ends, format, codes, scales, global_scale, block, bias, 128))


def _to(value, device: torch.device, keep_layout: bool = False):
    if not isinstance(value, torch.Tensor):
        return value
    if not keep_layout:
        return value.to(device)
    copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
    return copy.copy_(value)


def _call(implementation, case: Case, device: torch.device) -> tuple:
    """The outputs of one call of the case's operator (an in-place operator's written argument)."""
    args = [_to(a, device, case.operator in _LAYOUT_KEPT) for a in case.args]
    outputs = getattr(implementation, case.operator)(*args)
    if case.operator in _IN_PLACE:
        return (args[_IN_PLACE[case.operator]],)
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def _compare(operator: str, number: int, expected: torch.Tensor, got: torch.Tensor) -> Optional[str]:
    """None when `got` agrees with `expected` (both on the CPU), else what differs."""
    if expected.dtype != got.dtype or expected.shape != got.shape:
        return f"output {number}: {got.dtype} {tuple(got.shape)} instead of {expected.dtype} {tuple(expected.shape)}"
    if operator in _UNITS:
        return _compare_unit_values(number, expected, got)
    decoded = operator in (_DECODE_EXPERTS, _DECODE_QUANTIZED, _QUANTIZED_LINEAR)
    if (operator == _ROUTE_EXPERTS and number in _ROUTING_FLOATS) or decoded:
        tolerances = _ROUTING_TOLERANCES if operator == _ROUTE_EXPERTS else _DECODE_TOLERANCES
        close = torch.isclose(got, expected, equal_nan=True, **tolerances[expected.dtype])
        if bool(close.all()):
            return None
        return f"output {number}: {int((~close).sum())} of {close.numel()} values differ beyond rounding"
    if operator == _ROW_SUMS or operator in _PRODUCTS:
        close = torch.isclose(got, expected, equal_nan=True, **_ROW_SUM_TOLERANCES[expected.dtype])
        if bool(close.all()):
            return None
        return f"output {number}: {int((~close).sum())} of {close.numel()} sums differ beyond rounding"
    if (operator, number) in _REDUCTIONS:
        close = torch.isclose(got, expected, equal_nan=True, **_DOT_TOLERANCES[expected.dtype])
        if bool(close.all()):
            return None
        return f"output {number}: {int((~close).sum())} of {close.numel()} dot products differ beyond rounding"
    if expected.is_floating_point():
        nan = expected.isnan()
        if not torch.equal(nan, got.isnan()):
            return f"output {number}: NaN in other places"
        expected, got = expected.masked_fill(nan, 0), got.masked_fill(nan, 0)
    if torch.equal(expected, got):
        return None
    differ = expected != got
    first = tuple(int(i) for i in differ.nonzero()[0])
    return (f"output {number}: {int(differ.sum())} of {differ.numel()} values differ, first at {first}: "
            f"{got[first].item()} instead of {expected[first].item()}")


def _compare_unit_values(number: int, expected: torch.Tensor, got: torch.Tensor) -> Optional[str]:
    close = torch.isclose(got, expected, equal_nan=True, **_UNIT_TOLERANCES[expected.dtype])
    if not bool(close.all()):
        return f"output {number}: {int((~close).sum())} of {close.numel()} values differ beyond rounding"
    differ = int((got != expected).logical_and(~(got.isnan() & expected.isnan())).sum())
    if differ > _UNIT_DIFFERING * max(1, expected.numel()):
        return f"output {number}: {differ} of {expected.numel()} values differ (by rounding: more than a rounding explains)"
    return None


@contextlib.contextmanager
def _exact_matrix_products() -> Iterator[None]:
    """PyTorch's matrix products as the compiled kernels compute them: float32 without TF32, 16-bit
    data with float32 sums, whatever the caller set (torch.set_float32_matmul_precision("high")
    would round the reference's grouped products to TF32's 10 bits and fail a correct kernel)."""
    matmul = torch.backends.cuda.matmul
    saved = (torch.get_float32_matmul_precision(), matmul.allow_fp16_reduced_precision_reduction,
             matmul.allow_bf16_reduced_precision_reduction)
    torch.set_float32_matmul_precision("highest")
    matmul.allow_fp16_reduced_precision_reduction = False
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = saved[1:]


def compare_operators(fast, reference, device: torch.device, sizes: Sequence[Sizes] = QUICK_SIZES,
                      seed: int = 0, reference_device: Optional[torch.device] = None,
                      operators: Sequence[str] = OPERATORS) -> Dict[str, Optional[str]]:
    """Runs every case with `fast` on `device` and `reference` on `reference_device`
    (default: the same device).

    Returns, for each operator, None when all its cases agree, else a description
    of the first disagreement (or of the exception `fast` raised).  Exceptions of
    `reference` propagate: it is the implementation trusted to work.
    """
    reference_device = device if reference_device is None else reference_device
    failures: Dict[str, Optional[str]] = {name: None for name in operators}
    for case in _cases(sizes, seed):
        if case.operator not in failures or failures[case.operator] is not None:
            continue
        with _exact_matrix_products():
            expected = _call(reference, case, reference_device)
        try:
            got = _call(fast, case, device)
        except Exception as error:  # noqa: BLE001  (any failure of the fast path means: do not use it)
            failures[case.operator] = f"{case.label}: raised {type(error).__name__}: {str(error).splitlines()[0]}"
            continue
        if len(expected) != len(got):
            failures[case.operator] = f"{case.label}: {len(got)} outputs instead of {len(expected)}"
            continue
        for number, (e, r) in enumerate(zip(expected, got)):
            problem = _compare(case.operator, number, e.cpu(), r.cpu())
            if problem:
                failures[case.operator] = f"{case.label}: {problem}"
                break
    return failures


def count_cases(sizes: Sequence[Sizes] = QUICK_SIZES, seed: int = 0) -> Dict[str, int]:
    """How many calls compare_operators makes per operator (for reports)."""
    counts: Dict[str, int] = {name: 0 for name in OPERATORS}
    for case in _cases(sizes, seed):
        counts[case.operator] += 1
    return counts


__all__: List[str] = ["OPERATORS", "QUICK_SIZES", "FULL_SIZES", "Sizes", "compare_operators", "count_cases"]

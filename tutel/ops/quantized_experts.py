"""The products of experts whose matrices are quantized stacks (tutel.quant), on the CPU and CUDA.

For the rows of expert e (rows grouped by expert, as ``group_by_expert``'s ends give them):

    h = gate(x @ Wup[e]^T + up_bias[e])        (or activation(...) for experts without a gate)
    y = h @ Wdown[e]^T + down_bias[e]

where W[e] is expert e's matrix dequantized as its format defines it, and each product accumulates
in float32 (float64 for float64 rows), its bias (any floating dtype, optional) added there.  Rows
of float32, bfloat16 or float16 go through tutel's ``quantized_grouped_linear`` operator, which
decodes each expert's weights strip by strip into a small buffer as it multiplies (bfloat16 rows:
the weights rounded to bfloat16 on the way, tutel.ops.quantized_linear); float64 rows dequantize
one expert's matrix at a time in float64.  No float copy of a whole stack ever exists.  Each product's result is then
rounded to the rows' dtype, so the activations between the products are in the model's dtype, as
transformers' experts keep them.  ``up_bias`` is laid out as the values the gate rule reads: [E, U]
like `up`'s rows, or [E, 2I] for [gate | up] where the gates are a stack of their own.

What the products' inputs are (``activations``):

* ``"weight_only"``: the activations as they are, times the dequantized weights.
* ``"dynamic"`` (W8A8, block-FP8 stacks only): each product's input row is quantized first, per
  group of the weight block's columns b1 (128 for DeepSeek-V3's 128 x 128 blocks; the whole row
  where the block is the whole matrix), to E4M3 with the float32 scale amax / 448 (codes
  a / scale rounded to nearest, ties to even; an all-zero group gives zeros): DeepSeek-V3's
  ``act_quant`` and the rule transformers' finegrained-fp8 kernels apply inline.  The product is
  then sum over the groups of a_scale * w_scale * (a_codes . w_codes).  For float32 / bfloat16 /
  float16 rows the ``quantized_grouped_linear`` operator quantizes the rows itself (its
  ``activation_group``, the block width b1, where b1 is a multiple of 16 or spans the row; other
  widths go through ``dynamic_activations``, the same rule in PyTorch operators, first): the CPU
  multiplies the dequantized operands in float32, CUDA the codes on the tensor cores with each
  step's product scaled; float64 rows take ``dynamic_activations`` and float64 products.

At decoding sizes the same experts run in one call of tutel's ``decode_quantized_experts``
operator (``decode_quantized_products``), which streams each chosen expert's packed codes once and
keeps the units' values in float32: where ``decode_form`` finds a form of the experts the operator
computes (weight-only activations, up and down in one format, a GatedUnit or an up-only gelu /
relu it recognises, no gate stack of its own), tutel.rules.paths may choose it.

The CPU and CUDA devices compute (``DEVICES``; the stacks, the biases and the rows on one device).
On CUDA both operators run their CUDA kernels and nothing is read back to the host: the group ends
stay an int32 tensor on the device, and W8A8's activation quantization runs inside each product's
launch (the operator's ``activation_group``).  float64 rows run on the CPU only (their path
dequantizes one expert's matrix at a time in a loop on the host): on CUDA they are refused with a
TypeError, and no call dequantizes a whole stack on a GPU.  Nothing here records gradients (quantized experts run inference only; the
callers refuse calls that would).
"""
import weakref
from typing import Callable, Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from ..quant import Fp8BlockWeights, Mxfp4Weights, Nvfp4Weights, QuantizedWeights
from ..quant.activations import dynamic_activations
from .backend import operators_for
from .gated_units import GatedUnit, apply_gated_unit, apply_gated_unit_pair, unit_scalars
from .quantized_linear import quantized_grouped_linear, stack_arguments

WEIGHT_ONLY = "weight_only"
DYNAMIC = "dynamic"
ACTIVATIONS = (WEIGHT_ONLY, DYNAMIC)

#: The device types quantized experts run on.
DEVICES = ("cpu", "cuda")
#: The rows' dtypes each device type computes (float64 dequantizes expert by expert on the host).
ROW_DTYPES = {"cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
              "cuda": (torch.float32, torch.bfloat16, torch.float16)}

def require_device(device: torch.device, what: str) -> None:
    """NotImplementedError unless `device` is one of DEVICES (the CPU or a CUDA device)."""
    if device.type not in DEVICES:
        raise NotImplementedError(f"{what} is on {device}: quantized experts run on the CPU and CUDA devices")


def require_rows_dtype(dtype: torch.dtype, device: torch.device, what: str) -> None:
    """TypeError unless rows of `dtype` are computed on `device` (ROW_DTYPES): float64 on CUDA is
    refused, since its products dequantize one expert at a time in a loop on the host."""
    allowed = ROW_DTYPES.get(device.type, ())
    if dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        extra = " (float64 dequantizes one expert's matrix at a time in a loop on the host: it runs on the CPU)" \
            if dtype == torch.float64 and device.type == "cuda" else ""
        raise TypeError(f"{what} is {dtype} on {device}: quantized experts on {device.type} take {names} "
                        f"tokens{extra}")


def require_same_device(device: torch.device, stacks_device: torch.device, what: str) -> None:
    """ValueError unless `device` (a call's tokens, routing or biases) is the stacks' device."""
    if device != stacks_device:
        raise ValueError(f"{what}: on {device}, but the experts' stacks lie on {stacks_device}; every tensor of a "
                         f"quantized experts call must lie on one device")


class Float32Copies:
    """float32 copies of bfloat16 / float16 tensors (biases) made once and kept while their source is
    the same tensor, unchanged (its version counter), so that a call does not convert them again
    (the operators add biases in float32; the widening is exact).  Other tensors pass as they are.
    An owner keeps one as a plain attribute: nothing enters its state_dict; a copy or a pickle of the
    owner starts empty."""
    __slots__ = ("_kept",)

    _WIDENED = (torch.bfloat16, torch.float16)

    def __init__(self):
        self._kept: Dict[str, tuple] = {}

    def __reduce__(self):
        return Float32Copies, ()

    def __deepcopy__(self, memo):
        return Float32Copies()

    def of(self, name: str, tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """`tensor` in float32 where it is bfloat16 / float16 (kept under `name`), else `tensor`."""
        if tensor is None or tensor.dtype not in self._WIDENED:
            return tensor
        try:
            version = tensor._version
        except RuntimeError:  # an inference tensor tracks no version: converted on every call
            return tensor.detach().float()
        kept = self._kept.get(name)
        if kept is not None and kept[0]() is tensor and kept[1] == version:
            return kept[2]
        copy = tensor.detach().float()
        self._kept[name] = (weakref.ref(tensor), version, copy)
        return copy


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the products of rows of `dtype` accumulate in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dequantize_expert(stack: QuantizedWeights, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert `expert`'s (N, K) matrix of `stack`, dequantized in `dtype` (float32 or float64).

    Block FP8 multiplies the E4M3 codes (exact in float32) by their blocks' scales in place; other
    formats take their float64 reference dequantizer on the one expert."""
    if not isinstance(stack, Fp8BlockWeights):
        return stack.expert(expert).dequantize_reference(dtype)[0]
    rows, columns = stack.out_features, stack.in_features
    block_rows, block_columns = stack.block
    matrix = stack.weight[expert].to(dtype)
    # one scale per block row repeated over its rows: (N, ceil(K / b1)), small beside the matrix
    scales = stack.scale_inv[expert].to(dtype).repeat_interleave(block_rows, dim=0)[:rows]
    full = columns // block_columns
    if full:
        matrix[:, :full * block_columns].unflatten(1, (full, block_columns)).mul_(scales[:, :full, None])
    if full * block_columns < columns:  # the partial last block column
        matrix[:, full * block_columns:].mul_(scales[:, full:])
    return matrix


def _with_bias(product: torch.Tensor, bias: Optional[torch.Tensor], expert: int) -> torch.Tensor:
    """product [n, N] plus expert `expert`'s row of `bias` (already in the product's dtype), in place."""
    return product if bias is None else product.add_(bias[expert])


def _product(values: torch.Tensor, stack: QuantizedWeights, expert: int, dynamic: bool, dtype: torch.dtype,
             weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """values [n, K] @ W[expert]^T in `dtype` (W dequantized unless given as `weight`)."""
    if weight is None:
        weight = dequantize_expert(stack, expert, dtype)
    if dynamic:
        values = dynamic_activations(values, stack.block[1], dtype)
    elif values.dtype != dtype:
        values = values.to(dtype)
    return values @ weight.t()


def quantized_expert_products(rows: torch.Tensor, ends: Union[Sequence[int], torch.Tensor], up: QuantizedWeights,
                              down: QuantizedWeights, *, gate_weight: Optional[QuantizedWeights] = None,
                              unit: Optional[GatedUnit] = None,
                              gate_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                              activation: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                              activations: str = WEIGHT_ONLY, up_bias: Optional[torch.Tensor] = None,
                              down_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The experts' outputs for [n, H] rows grouped by expert (see the module docstring).

    Args:
        rows: [n, H] rows on the CPU (float32 / float64 / bfloat16 / float16) or a CUDA device
            (float32 / bfloat16 / float16); expert e's are rows[ends[e-1]:ends[e]] (rows past
            the last end give zeros).
        ends: [E] non-decreasing end of each expert's rows: ints, or an integer tensor (on CUDA
            an int32 tensor on the rows' device, never read on the host; ints are copied there).
        up: the up projections: (E, U, H), with U = 2I gate and up rows for gated experts (the rule
            of `unit` / `gate_fn` reads them), U = I otherwise; or the ups alone (E, I, H) with
            `gate_weight`.
        down: (E, O, I) down projections.
        gate_weight: the gates' own (E, I, H) matrices, or None; with it the gate rule sees each
            row's gate and up values concatenated, [gate | up].
        unit: the fused gated unit, or None.
        gate_fn: a callable [n, 2I] -> [n, I] (the model's gate rule), used where `unit` is None.
        activation: an elementwise callable for experts without a gate (no `unit`, no `gate_fn`).
        activations: "weight_only" or "dynamic" (W8A8; block-FP8 stacks only).
        up_bias: [E, U] added to the up projection (U: the values the gate rule reads, [gate | up]
            with `gate_weight`), or None.
        down_bias: [E, O] added to the down projection, or None.

    The arguments are checked by the callers once (``check_quantized_experts``), not here: this runs
    for every piece of rows.

    Returns:
        [n, O] in rows' dtype.
    """
    if rows.dtype != torch.float64:
        return _compiled_products(rows, ends, up, down, gate_weight, unit, gate_fn, activation,
                                  activations == DYNAMIC, up_bias, down_bias)
    require_rows_dtype(rows.dtype, rows.device, "rows")  # (float64: the CPU only, a loop on the host)
    if isinstance(ends, torch.Tensor):
        ends = ends.tolist()
    dtype, wide = rows.dtype, compute_dtype(rows.dtype)
    dynamic = activations == DYNAMIC
    out = rows.new_zeros((rows.shape[0], down.out_features))
    with torch.no_grad():  # the stacks' float8 tensors may require grad; nothing here is differentiated
        # the biases in the accumulation dtype once, each expert's row added to its product there
        if up_bias is not None:
            up_bias = up_bias.to(wide)
        if down_bias is not None:
            down_bias = down_bias.to(wide)
        start = 0
        for expert, end in enumerate(ends):
            if end <= start:
                continue
            up_matrix = dequantize_expert(up, expert, wide)
            if gate_weight is not None:  # [gate; up] rows, one product
                up_matrix = torch.cat((dequantize_expert(gate_weight, expert, wide), up_matrix))
            hidden = _with_bias(_product(rows[start:end], up, expert, dynamic, wide, up_matrix), up_bias,
                                expert).to(dtype)
            hidden = _gated(hidden, unit, gate_fn, activation)
            out[start:end] = _with_bias(_product(hidden, down, expert, dynamic, wide), down_bias, expert)
            start = end
    return out


def _gated(hidden: torch.Tensor, unit: Optional[GatedUnit], gate_fn: Optional[Callable],
           activation: Optional[Callable]) -> torch.Tensor:
    """The rule between the two products on [n, U] up values."""
    if unit is not None:
        return apply_gated_unit(hidden, unit)
    if gate_fn is not None:
        return gate_fn(hidden)
    return activation(hidden)


def _device_ends(ends: Union[Sequence[int], torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """The group ends as an int32 tensor on the rows' (CUDA) device, as its kernel reads them:
    converted there where they come in another form (nothing read back to the host)."""
    if not isinstance(ends, torch.Tensor):
        return torch.tensor(list(ends), dtype=torch.int32, device=rows.device)
    return ends if ends.dtype == torch.int32 and ends.device == rows.device else \
        ends.to(device=rows.device, dtype=torch.int32)


def _grouped_linear(rows: torch.Tensor, ends: Union[Sequence[int], torch.Tensor], stack: QuantizedWeights,
                    bias: Optional[torch.Tensor], activation_group: int = 0) -> torch.Tensor:
    """quantized_grouped_linear of checked arguments.  On the CPU its public wrapper (which checks
    the ends' values, reading them); on CUDA the operator itself, with the ends an int32 device
    tensor and the bias in float32 (what its kernel reads), so the call reads nothing back."""
    if rows.device.type == "cpu":
        return quantized_grouped_linear(rows, ends, stack, bias, activation_group)
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    return torch.ops.tutel.quantized_grouped_linear(rows, _device_ends(ends, rows), *stack_arguments(stack), bias,
                                                    activation_group)


def _stack_product(rows: torch.Tensor, ends: Union[Sequence[int], torch.Tensor], stack: QuantizedWeights,
                   bias: Optional[torch.Tensor], dynamic: bool) -> torch.Tensor:
    """One product of the experts, in rows' dtype (W8A8: float32 where the rows are quantized here).
    W8A8 quantizes inside the operator (its activation_group: the block's width b1) where it takes
    that width (a multiple of 16, or the whole row); other widths quantize with dynamic_activations
    first, the same rule in PyTorch operators."""
    if not dynamic:
        return _grouped_linear(rows, ends, stack, bias)
    group = stack.block[1]
    if group % 16 == 0 or group >= stack.in_features:
        return _grouped_linear(rows, ends, stack, bias, group)
    return _grouped_linear(dynamic_activations(rows, group, torch.float32), ends, stack, bias)


def projection_row_bytes(width: int, dtype: torch.dtype, activations: str) -> int:
    """Bytes of one row, `width` values wide, of a product quantized_expert_products computes for
    rows of `dtype`: in the rows' dtype, or float32 (at least) under W8A8, whose rows PyTorch may
    quantize to float32 first (_stack_product).  The grouped paths cut their pieces by it."""
    return width * (dtype.itemsize if activations == WEIGHT_ONLY else max(dtype.itemsize, 4))


def _in_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return values if values.dtype == dtype else values.to(dtype)


def _compiled_products(rows: torch.Tensor, ends: Union[Sequence[int], torch.Tensor], up: QuantizedWeights,
                       down: QuantizedWeights, gate_weight: Optional[QuantizedWeights], unit: Optional[GatedUnit],
                       gate_fn: Optional[Callable], activation: Optional[Callable], dynamic: bool,
                       up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """quantized_expert_products for float32 / bfloat16 / float16 rows: both products on tutel's
    quantized_grouped_linear operator, which decodes each expert's weights strip by strip as it
    multiplies (W8A8: the operator quantizes each product's input rows itself, per group of the
    stack's block width, and multiplies the dequantized operands in float32 on the CPU; CUDA
    quantizes inside its launch).  On CUDA: the two products (three with a gate stack apart) and
    the unit; no host synchronisation."""
    dtype = rows.dtype
    if rows.device.type != "cpu" and not isinstance(ends, torch.Tensor):
        ends = _device_ends(ends, rows)  # (once for every product)
    with torch.no_grad():  # the stacks' float8 tensors may require grad; nothing here is differentiated
        if gate_weight is None:
            hidden = _gated(_in_dtype(_stack_product(rows, ends, up, up_bias, dynamic), dtype), unit, gate_fn,
                            activation)
        else:  # [gate | up]: the bias' halves with their stacks
            inner = up.out_features
            gate_bias, ups_bias = (None, None) if up_bias is None else (up_bias[:, :inner], up_bias[:, inner:])
            gates = _stack_product(rows, ends, gate_weight, gate_bias, dynamic)
            ups = _stack_product(rows, ends, up, ups_bias, dynamic)
            if unit is not None:  # the fused unit reads both products where they are (no concatenation)
                hidden = apply_gated_unit_pair(_in_dtype(gates, dtype), _in_dtype(ups, dtype), unit)
            else:
                hidden = _gated(_in_dtype(torch.cat((gates, ups), dim=1), dtype), None, gate_fn, activation)
        out = _stack_product(hidden, ends, down, down_bias, dynamic)
        return out if out.dtype == dtype else out.to(dtype)


def check_activations(activations: object, stacks: Sequence[Tuple[str, QuantizedWeights]], where: str) -> None:
    """ValueError (from `where`) unless `activations` is one of ACTIVATIONS and, for "dynamic",
    every (name, stack) of `stacks` is block FP8."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"{where}: `activations` must be one of {ACTIVATIONS}, got {activations!r}")
    if activations == DYNAMIC:
        for name, stack in stacks:
            if not isinstance(stack, Fp8BlockWeights):
                raise ValueError(f"{where}: activations='dynamic' (W8A8) quantizes activations per weight block and "
                                 f"needs block-FP8 stacks; `{name}` is {type(stack).__name__}")


def check_quantized_experts(up: object, down: object, gate_weight: object, gated: bool, activations: object,
                            where: str) -> int:
    """Checks the stacks of quantized experts against each other once (the formats checked their
    own tensors when they were built); returns the experts' input width H.

    Raises:
        TypeError: a stack is no tutel.quant stack.
        ValueError: expert counts, widths, devices or `activations` do not fit together.
        NotImplementedError: a stack lies on another device than the CPU or a CUDA device.
    """
    stacks = [("up", up), ("down", down)] + ([("gate_weight", gate_weight)] if gate_weight is not None else [])
    for name, stack in stacks:
        if not isinstance(stack, QuantizedWeights):
            raise TypeError(f"{where}: `{name}` must be a tutel.quant stack (Fp8BlockWeights, Mxfp4Weights, "
                            f"Nvfp4Weights), got {type(stack).__name__}")
        require_device(stack.device, f"{where}: `{name}`")
    devices = [stack.device for _, stack in stacks]
    if any(device != devices[0] for device in devices):
        raise ValueError(f"{where}: the stacks lie on different devices "
                         f"({', '.join(f'`{name}` on {device}' for (name, _), device in zip(stacks, devices))}); "
                         f"every stack of the experts must lie on one device")
    check_activations(activations, stacks, where)
    experts, width = up.experts, up.in_features
    for name, stack in stacks:
        if stack.experts != experts:
            raise ValueError(f"{where}: `up` holds {experts} experts but `{name}` {stack.experts}")
    if gate_weight is not None:
        if not gated:
            raise ValueError(f"{where}: `gate_weight` is given but no gate rule (`gate` or `gate_fn`)")
        if gate_weight.shape != up.shape:
            raise ValueError(f"{where}: `gate_weight` {gate_weight.shape} must have the shape of `up` {up.shape}")
        inner = up.out_features
    elif gated:
        if up.out_features % 2:
            raise ValueError(f"{where}: gated experts need `up` of 2 x intermediate rows, got {up.shape}")
        inner = up.out_features // 2
    else:
        inner = up.out_features
    if down.in_features != inner:
        raise ValueError(f"{where}: `down` {down.shape} must take the {inner} hidden values the up projection "
                         f"gives (E, O, {inner})")
    return width


def check_expert_biases(up_bias: object, down_bias: object, up: QuantizedWeights, down: QuantizedWeights,
                        gate_weight: Optional[QuantizedWeights], where: str) -> None:
    """Checks the experts' optional biases against their (checked) stacks: `up_bias` [E, U] laid out
    as the values the gate rule reads (`up`'s rows; [gate | up], 2I, with `gate_weight`), `down_bias`
    [E, O]; any floating dtype, on the stacks' device.

    Raises:
        TypeError: a bias is no tensor, or not floating point.
        ValueError: a bias's shape is not the one expected (naming both), or it lies on another
            device than the stacks.
    """
    experts = up.experts
    up_width = up.out_features * (1 if gate_weight is None else 2)
    layout = "`up`'s rows" if gate_weight is None else "[gate | up], the gate rule's input"
    for name, bias, size, width, what in (("up_bias", up_bias, "U", up_width, layout),
                                          ("down_bias", down_bias, "O", down.out_features, "`down`'s rows")):
        if bias is None:
            continue
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{where}: `{name}` must be a tensor or None, got {type(bias).__name__}")
        if not bias.dtype.is_floating_point:
            raise TypeError(f"{where}: `{name}` must be floating point, got {bias.dtype}")
        if tuple(bias.shape) != (experts, width):
            raise ValueError(f"{where}: `{name}` has shape {tuple(bias.shape)}; expected [E, {size}] = "
                             f"({experts}, {width}), laid out as {what}")
        require_same_device(bias.device, up.device, f"{where}: `{name}`")


# -- at decoding sizes: tutel's decode_quantized_experts operator ---------------------------------

#: The token dtypes the decode operator takes.
DECODE_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))


class QuantizedDecodeForm(NamedTuple):
    """How tutel's decode_quantized_experts operator takes a set of quantized experts."""
    format: str                # "mxfp4", "nvfp4" or "fp8_block"
    unit: tuple                # (activation, alpha, up_offset, limit, interleaved) as the operator takes them
    block: Tuple[int, ...]     # fp8_block's scale block (rows, cols); () for the fp4 formats


def up_only_unit(activation: object) -> Optional[str]:
    """The decode operator's up-only unit that `activation` is: ``"gelu"`` for F.gelu or an
    nn.GELU() (``"gelu_tanh"`` with approximate="tanh"), ``"relu"`` for F.relu, torch.relu or an
    nn.ReLU(); None for any other callable (only these exact functions and classes are recognised,
    so nothing that merely looks alike is computed as something else)."""
    if activation is F.gelu:
        return "gelu"
    if activation is F.relu or activation is torch.relu or type(activation) is torch.nn.ReLU:
        return "relu"
    if type(activation) is torch.nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(activation.approximate)
    return None


def _common_fp8_block(up: Fp8BlockWeights, down: Fp8BlockWeights) -> Optional[Tuple[int, int]]:
    """One scale block that gives both stacks their own scale grids (the operator takes one block for
    both), or None.  Along each dimension a stack with several blocks fixes the block's size; a
    stack whose one block spans the dimension (one scale per matrix, say) fits any size as large."""
    block = []
    for dim in (0, 1):
        spans = ((up.shape[1 + dim], up.block[dim]), (down.shape[1 + dim], down.block[dim]))
        sizes = {size for extent, size in spans if extent > size}
        if len(sizes) > 1:
            return None
        size = sizes.pop() if sizes else max(extent for extent, _ in spans)
        if any(extent > size for extent, own in spans if extent <= own):
            return None
        block.append(size)
    return block[0], block[1]


def decode_form(up: QuantizedWeights, down: QuantizedWeights, gate_weight: Optional[QuantizedWeights],
                unit: Optional[GatedUnit], gate_fn: Optional[Callable], activation: Optional[Callable],
                activations: str) -> Optional[QuantizedDecodeForm]:
    """The form in which the decode operator computes these (checked) experts, or None where it
    cannot: W8A8 activations, a gate stack of its own (its codes would have to be joined to the
    ups' on every call), up and down in different formats or fp8 blocks that no one block gives, a
    gate_fn, or an activation up_only_unit does not recognise."""
    if activations != WEIGHT_ONLY or gate_weight is not None or type(up) is not type(down) or \
            min(up.shape) < 1 or min(down.shape) < 1:
        return None
    if unit is not None:
        unit_arguments = ("gated",) + unit_scalars(unit) + (bool(unit.interleaved),)
    elif gate_fn is not None:
        return None
    else:
        name = up_only_unit(activation)
        if name is None:
            return None
        unit_arguments = (name, 1.0, 0.0, None, False)
    if isinstance(up, Fp8BlockWeights):
        block = _common_fp8_block(up, down)
        if block is None:
            return None
    elif isinstance(up, (Mxfp4Weights, Nvfp4Weights)):
        block = ()
    else:  # a format the operator does not read
        return None
    return QuantizedDecodeForm(up.format, unit_arguments, block)


def decode_quantized_products(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor],
                              up: QuantizedWeights, down: QuantizedWeights, form: QuantizedDecodeForm,
                              up_bias: Optional[torch.Tensor] = None,
                              down_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The routing-weighted sum of each token's experts, [T, O] in x's dtype, by one call of tutel's
    decode_quantized_experts operator (tutel.ops.decode_quantized_experts has the formula).

    For arguments the callers checked (the stacks, the routing, the biases; `form` from
    ``decode_form``), on CPU or CUDA tokens of DECODE_DTYPES: the public wrapper's checks are
    skipped, as they would cost more Python than the rest of a decoding step (the operator checks
    the shapes itself).  Integer ids of other dtypes than int32 / int64 are widened; the biases are
    taken in float32, as the operator adds them (a bias of another dtype costs a conversion per
    call: Float32Copies keeps them converted).  On CUDA the device's operator as tutel.ops.backend
    chose it (the two kernels; the composite operator where they failed the self-check)."""
    if expert_ids.dtype != torch.int64 and expert_ids.dtype != torch.int32:
        expert_ids = expert_ids.long()
    if up_bias is not None and up_bias.dtype != torch.float32:
        up_bias = up_bias.float()
    if down_bias is not None and down_bias.dtype != torch.float32:
        down_bias = down_bias.float()
    _, gate_up, gate_up_scales, gate_up_global, _ = stack_arguments(up)
    _, down_codes, down_scales, down_global, _ = stack_arguments(down)
    operator = torch.ops.tutel.decode_quantized_experts if x.device.type == "cpu" else \
        operators_for(x.device).decode_quantized_experts
    return operator(
        x, expert_ids, weights, form.format, gate_up, gate_up_scales, gate_up_global, down_codes, down_scales,
        down_global, form.block, up_bias, down_bias, *form.unit)

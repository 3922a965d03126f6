"""Every operator registered under ``torch.ops.tutel``, and where each part of it lives.

One entry per operator: its CPU implementation (the csrc file that registers it for the CPU), its
CUDA implementation (the csrc file and the NVRTC kernels of kernels/ it launches), its composite
implementation (plain PyTorch, tutel.ops.composite, which stands in for the CUDA kernels), its fake
kernel (shapes only, for torch.compile and FakeTensor) and its autograd.  The schema is read from
the registered operator (``schema(name)``), never copied here.  Four operators are defined in
Python with ``torch.library.custom_op``: they wrap compiled ones so that torch.compile sees one
opaque, differentiable call.  tests/python/test_operator_registry.py checks the entries against
the registrations (names, dispatch keys, the csrc files' ``TORCH_LIBRARY_IMPL`` blocks and the
kernels they launch) and keeps docs/operators.md equal to ``operator_table()``.

How csrc/ops/ is laid out: every schema is in csrc/ops/schemas.cpp; the implementations are one
file per operator group and device, named after the group (csrc/ops/cpu/<group>_cpu.cpp,
csrc/ops/cuda/<group>_cuda.cpp), with the argument checks both devices share in
csrc/ops/<group>_args.cpp (or the common op_args.cpp) and the kernels in kernels/<group>.cu
(except routing's routing_topk.cu and slot_assignment.cu, and grouped_rows_linear's
grouped_rows_gemm.cu).  A group is one operator with its backward where that is all
(decode_experts, decode_quantized_experts, quantized_grouped_linear, select_rows, to_dtype, grouped_linear,
grouped_rows_linear, route_experts; cumsum for cumsum_sub_one), else a family: dispatch (gather_slots, scatter_slots),
routing (route_topk, assign_locations, and group_by_expert on the CPU, whose CUDA kernel has its own file),
gated_units, expert_rows, routed_experts (routed_gated_experts).  The files are not renamed to
one per operator: the map is this table.
"""
import importlib
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from . import gated_units as _gated_units  # noqa: F401  (defines the Python operators listed below)
from . import grouped_mm as _grouped_mm  # noqa: F401
from .extension import load_extension

load_extension()  # registers the compiled operators whose schemas are read here

NAMESPACE = "tutel"
NONE = "none: "  # how a part an operator does not have begins, followed by why


class Operator(NamedTuple):
    """One operator of ``torch.ops.tutel``: what it does and where each implementation lives.

    ``cpu`` / ``cuda``: the csrc file registering the compiled kernel for that device (None: none).
    ``kernels``: the kernels/*.cu files the CUDA implementation launches.  ``python``: for an
    operator defined in Python, the ``torch.library.custom_op`` object (a dotted path); it runs on
    every device.  ``composite``, ``fake``, ``autograd``: a dotted path to the Python function
    (``autograd`` also a ``tutel::`` operator whose autograd covers this one), or ``"none: why"``.
    """

    name: str
    does: str
    cpu: Optional[str]
    cuda: Optional[str]
    kernels: Tuple[str, ...]
    composite: str
    fake: str
    autograd: str
    python: Optional[str] = None


class Overlap(NamedTuple):
    """Operators whose work overlaps, and why each of them still exists."""

    names: Tuple[str, ...]
    why: str


_CPU, _CUDA = "csrc/ops/cpu/", "csrc/ops/cuda/"
_BACKWARD = NONE + "a backward step, called by the autograd of "

OPERATORS: Tuple[Operator, ...] = (
    Operator("route_topk", "top-k of scores [T, E] and GShard slots (Tutel's routing API)",
             _CPU + "routing_cpu.cpp", _CUDA + "routing_cuda.cpp",
             ("kernels/routing_topk.cu", "kernels/slot_assignment.cu"),
             "tutel.ops.composite.routing.route_topk", "tutel.ops.fake._route_topk", "tutel.ops.routing._RouteTopK"),
    Operator("assign_locations", "GShard slots for given expert choices",
             _CPU + "routing_cpu.cpp", _CUDA + "routing_cuda.cpp",
             ("kernels/routing_topk.cu", "kernels/slot_assignment.cu"),
             "tutel.ops.composite.routing.assign_locations", "tutel.ops.fake._assign_locations",
             NONE + "integer outputs"),
    Operator("group_by_expert", "dropless plan: the choices sorted by expert",
             _CPU + "routing_cpu.cpp", _CUDA + "group_by_expert_cuda.cpp", ("kernels/group_by_expert.cu",),
             "tutel.ops.composite.experts.group_by_expert", "tutel.ops.fake._group_by_expert",
             NONE + "integer outputs"),
    Operator("cumsum_sub_one", "cumsum(mask, 0) - 1: each token's slot for a one-hot mask",
             _CPU + "cumsum_cpu.cpp", _CUDA + "cumsum_cuda.cpp", ("kernels/cumsum.cu",),
             "tutel.ops.composite.cumsum.cumsum_sub_one", "tutel.ops.fake._cumsum_sub_one",
             NONE + "slots carry no gradient"),
    Operator("gather_slots", "combine: each token's weighted sum of its choices' rows",
             _CPU + "dispatch_cpu.cpp", _CUDA + "dispatch_cuda.cpp", ("kernels/dispatch.cu",),
             "tutel.ops.composite.slots.gather_slots", "tutel.ops.fake._gather_slots", "tutel.ops.dispatch._Decode"),
    Operator("scatter_slots", "dispatch: token rows into expert slots",
             _CPU + "dispatch_cpu.cpp", _CUDA + "dispatch_cuda.cpp", ("kernels/dispatch.cu",),
             "tutel.ops.composite.slots.scatter_slots", "tutel.ops.fake._scatter_slots", "tutel.ops.dispatch._Encode"),
    Operator("grouped_linear", "expert products over rows grouped by host-side group sizes (CPU GEMM)",
             _CPU + "grouped_linear_cpu.cpp", None, (),
             "tutel.ops._expert_loops.grouped_linear_loop", "tutel.ops.fake._grouped_linear",
             "tutel.ops.linear._GroupedLinear"),
    Operator("grouped_linear_backward", "grouped_linear's gradients",
             _CPU + "grouped_linear_cpu.cpp", None, (),
             "tutel.ops._expert_loops.grouped_linear_backward_loop", "tutel.ops.fake._grouped_linear_backward",
             _BACKWARD + "grouped_linear"),
    Operator("gated_unit", "gated activation of [gate | up] rows (SwiGLU and variants)",
             _CPU + "gated_units_cpu.cpp", _CUDA + "gated_units_cuda.cpp", ("kernels/gated_units.cu",),
             "tutel.ops.composite.experts.gated_unit", "tutel.ops.fake._gated_unit", "tutel::gated_unit_rows"),
    Operator("gated_unit_backward", "gated_unit's gradient",
             _CPU + "gated_units_cpu.cpp", _CUDA + "gated_units_cuda.cpp", ("kernels/gated_units.cu",),
             "tutel.ops.composite.experts.gated_unit_backward", "tutel.ops.fake._gated_unit_backward",
             _BACKWARD + "gated_unit_rows"),
    Operator("select_rows", "x[rows] into a buffer of the CPU block cache",
             _CPU + "select_rows_cpu.cpp", None, (),
             NONE + "CPU only (Tensor.index_select elsewhere)", "tutel.ops.fake._select_rows",
             NONE + "inference only"),
    Operator("routed_gated_experts", "routed gated experts in one call, any size (CPU)",
             _CPU + "routed_experts_cpu.cpp", None, (),
             NONE + "CPU only (other devices take the grouped path)", "tutel.ops.fake._routed_gated_experts",
             NONE + "inference only"),
    Operator("decode_experts", "routed gated experts at decoding sizes (CUDA kernel)",
             _CPU + "decode_experts_cpu.cpp", _CUDA + "decode_experts_cuda.cpp", ("kernels/decode_experts.cu",),
             "tutel.ops.composite.decode_experts", "tutel.ops.fake._decode_experts",
             NONE + "inference only"),
    Operator("decode_quantized_experts", "routed experts with MXFP4 / NVFP4 / FP8-block weights at decoding sizes",
             _CPU + "decode_quantized_experts_cpu.cpp", _CUDA + "decode_quantized_experts_cuda.cpp",
             ("kernels/quantized_decode.cu",),
             "tutel.ops.composite.decode_quantized_experts", "tutel.ops.fake._decode_quantized_experts",
             NONE + "inference only"),
    Operator("quantized_grouped_linear", "rows grouped by expert times an MXFP4 / NVFP4 / FP8-block stack (prefill)",
             _CPU + "quantized_grouped_linear_cpu.cpp", _CUDA + "quantized_grouped_linear_cuda.cpp",
             ("kernels/quantized_grouped_linear.cu",),
             "tutel.ops.composite.quantized_grouped_linear", "tutel.ops.fake._quantized_grouped_linear",
             NONE + "inference only"),
    Operator("add_expert_bias_", "in place: each grouped row plus its expert's bias",
             _CPU + "expert_rows_cpu.cpp", _CUDA + "expert_rows_cuda.cpp", ("kernels/expert_rows.cu",),
             "tutel.ops.composite.expert_rows.add_expert_bias_", "tutel.ops.fake._add_expert_bias_",
             "tutel::grouped_rows_mm"),
    Operator("expert_row_sums", "each expert's sum of its grouped rows (a bias gradient)",
             _CPU + "expert_rows_cpu.cpp", _CUDA + "expert_rows_cuda.cpp", ("kernels/expert_rows.cu",),
             "tutel.ops.composite.expert_rows.expert_row_sums", "tutel.ops.fake._expert_row_sums",
             _BACKWARD + "grouped_rows_mm and gated_unit_rows"),
    Operator("choice_rows", "the token rows in a plan's slot order",
             _CPU + "expert_rows_cpu.cpp", _CUDA + "expert_rows_cuda.cpp", ("kernels/expert_rows.cu",),
             "tutel.ops.composite.expert_rows.choice_rows", "tutel.ops.fake._choice_rows",
             "tutel.ops.dispatch._CopyChoiceRows"),
    Operator("grouped_rows_linear", "expert products over rows grouped by device-side ends",
             _CPU + "grouped_rows_linear_cpu.cpp", _CUDA + "grouped_rows_linear_cuda.cpp",
             ("kernels/grouped_rows_gemm.cu",),
             "tutel.ops.composite.grouped_rows.grouped_rows_linear", "tutel.ops.fake._grouped_rows_linear",
             "tutel::grouped_rows_mm"),
    Operator("grouped_rows_linear_backward", "grouped_rows_linear's gradients",
             _CPU + "grouped_rows_linear_cpu.cpp", _CUDA + "grouped_rows_linear_cuda.cpp",
             ("kernels/grouped_rows_gemm.cu",),
             "tutel.ops.composite.grouped_rows.grouped_rows_linear_backward",
             "tutel.ops.fake._grouped_rows_linear_backward", _BACKWARD + "grouped_rows_mm"),
    Operator("to_dtype", "x.to(dtype) into a buffer of the CPU block cache",
             _CPU + "to_dtype_cpu.cpp", None, (),
             NONE + "CPU only (Tensor.to elsewhere)", "tutel.ops.fake._to_dtype", NONE + "inference only"),
    Operator("gated_unit_pair", "the gated unit over separate gate and up tensors",
             _CPU + "gated_units_cpu.cpp", _CUDA + "gated_units_cuda.cpp", ("kernels/gated_units.cu",),
             "tutel.ops.composite.experts.gated_unit_pair", "tutel.ops.fake._gated_unit_pair",
             "tutel::gated_unit_pair_rows"),
    Operator("gated_unit_pair_backward", "gated_unit_pair's gradients",
             _CPU + "gated_units_cpu.cpp", _CUDA + "gated_units_cuda.cpp", ("kernels/gated_units.cu",),
             "tutel.ops.composite.experts.gated_unit_pair_backward", "tutel.ops.fake._gated_unit_pair_backward",
             _BACKWARD + "gated_unit_pair_rows"),
    Operator("route_experts", "routing from logits with scored-routing options, its plan and loss",
             _CPU + "route_experts_cpu.cpp", _CUDA + "route_experts_cuda.cpp", ("kernels/route_experts.cu",),
             "tutel.ops.composite.route_experts", "tutel.ops.fake._route_experts",
             "tutel.ops.route_experts._RouteExperts"),
    Operator("route_experts_backward", "route_experts' gradient for the logits",
             _CPU + "route_experts_cpu.cpp", _CUDA + "route_experts_cuda.cpp", ("kernels/route_experts.cu",),
             NONE + "route_experts has none", "tutel.ops.fake._route_experts_backward", _BACKWARD + "route_experts"),
    # Defined in Python (torch.library.custom_op) over the compiled operators above.
    Operator("gated_unit_rows", "gated_unit as one differentiable, traceable call",
             None, None, (), NONE + "gated_unit runs gated_unit_composite instead where the kernel is not chosen",
             "tutel.ops.gated_units._gated_unit_fake", "tutel.ops.gated_units._backward",
             python="tutel.ops.gated_units._gated_unit"),
    Operator("gated_unit_pair_rows", "gated_unit_pair as one differentiable, traceable call",
             None, None, (), NONE + "gated_unit_pair runs the composite unit instead where the kernel is not chosen",
             "tutel.ops.gated_units._gated_unit_pair_fake", "tutel.ops.gated_units._pair_backward",
             python="tutel.ops.gated_units._gated_unit_pair"),
    Operator("grouped_rows_mm", "grouped expert products (grouped_mm or grouped_rows_linear) as one call",
             None, None, (), NONE + "its operators come from operators_for, composite ones included",
             "tutel.ops.grouped_mm._grouped_rows_mm_fake", "tutel.ops.grouped_mm._autograd_backward",
             python="tutel.ops.grouped_mm._grouped_rows_mm"),
    Operator("grouped_rows_mm_backward", "grouped_rows_mm's gradients as one call",
             None, None, (), NONE + "its operators come from operators_for, composite ones included",
             "tutel.ops.grouped_mm._grouped_rows_mm_backward_fake", _BACKWARD + "grouped_rows_mm",
             python="tutel.ops.grouped_mm._grouped_rows_mm_backward"),
)

OVERLAPS: Tuple[Overlap, ...] = (
    Overlap(("grouped_linear", "grouped_rows_linear"),
            "grouped_linear takes the group sizes as a host list, which tutel's CPU GEMM plans from, while "
            "grouped_rows_linear takes the group ends as a device tensor its CUDA kernel reads without a host "
            "synchronisation (so CUDA graphs capture it) and zeros the rows of no expert; on the CPU it reads "
            "the ends and runs grouped_linear's products."),
    Overlap(("route_topk", "route_without_grad", "route_experts"),
            "route_topk is Tutel's routing API (scores to [k, T] choices, gates and GShard slots, with "
            "autograd through the gates), route_experts routes from the logits with the scored-routing options "
            "(score functions, selection bias, groups, scaling) and also plans the static grouped buffer and "
            "the loss on the device for the CUDA paths, and route_without_grad (a function of the extension, "
            "not an operator) is the layer's CPU inference routing with its normalisation, counts and loss in "
            "one C++ pass."),
    Overlap(("routed_gated_experts", "decode_experts"),
            "They compute the same result with the same schema, but routed_gated_experts is the CPU "
            "implementation for any size while decode_experts is the CUDA kernel made for decoding sizes "
            "(decode_experts_supported says which calls it takes), whose CPU kernel is routed_gated_experts "
            "itself; one operator would promise CUDA sizes its kernel does not handle."),
)


def entry(name: str) -> Operator:
    """The registry's entry of operator `name` (KeyError for an operator it does not list)."""
    for operator in OPERATORS:
        if operator.name == name:
            return operator
    raise KeyError(f"tutel.ops.registry: no operator {name!r} in torch.ops.{NAMESPACE}")


def registered_operators() -> List[str]:
    """The names of every operator registered under torch.ops.tutel now (the dispatcher's list)."""
    prefix = NAMESPACE + "::"
    return sorted({name[len(prefix):].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
                   if name.startswith(prefix)})


def schema(name: str) -> str:
    """The registered schema of operator `name`, without the namespace."""
    text = str(getattr(getattr(torch.ops, NAMESPACE), name).default._schema)
    return text[len(NAMESPACE) + 2:] if text.startswith(NAMESPACE + "::") else text


def resolve(path: str) -> object:
    """The Python object at the dotted `path` (a module's attribute, e.g. 'tutel.ops.fake._route_topk')."""
    module, _, attribute = path.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def _cell(value: Optional[str]) -> str:
    if value is None:
        return "none"
    return value if value.startswith(NONE) else f"`{value}`"


def _row(operator: Operator) -> str:
    if operator.python is not None:
        cpu = cuda = f"Python: `{operator.python}`"
    else:
        cpu = _cell(operator.cpu)
        cuda = _cell(operator.cuda) + "".join(f", `{kernel}`" for kernel in operator.kernels)
    cells = [f"`{operator.name}`", operator.does, f"`{schema(operator.name)}`", cpu, cuda,
             _cell(operator.composite), _cell(operator.fake), _cell(operator.autograd)]
    return "| " + " | ".join(cells) + " |"


def operator_table() -> str:
    """docs/operators.md's table of every operator (schemas as registered) and the reasons
    overlapping operators all exist, as markdown."""
    lines = ["| operator | what it does | schema | CPU | CUDA (kernels) | composite | fake | autograd |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [_row(operator) for operator in OPERATORS]
    lines += ["", "Operators that overlap, and why each exists:", ""]
    lines += [f"* {', '.join(f'`{name}`' for name in overlap.names)}: {overlap.why}" for overlap in OVERLAPS]
    return "\n".join(lines) + "\n"


def by_file() -> Dict[str, List[str]]:
    """{csrc file: the operators it registers kernels for}, over both devices."""
    files: Dict[str, List[str]] = {}
    for operator in OPERATORS:
        for path in (operator.cpu, operator.cuda):
            if path is not None:
                files.setdefault(path, []).append(operator.name)
    return files


__all__ = ["NAMESPACE", "OPERATORS", "OVERLAPS", "Operator", "Overlap", "by_file", "entry", "operator_table",
           "registered_operators", "resolve", "schema"]

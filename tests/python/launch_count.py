"""Counting the operators a call dispatches, on fake CUDA tensors (what the CUDA path would launch).

``FakeTensorMode`` with ``device="cuda"`` works on a CPU-only PyTorch: every operator runs its
shape function only, and anything that needs a value on the host (``int(t)``, ``t.tolist()``,
``nonzero``) or a data-dependent shape raises, which is exactly what would break CUDA-graph
capture on a GPU.  ``OperatorCount`` records the operators under that mode, leaving out those
that launch nothing: views, metadata queries and uninitialised allocations.
"""
import contextlib
import hashlib
import inspect
import os
import subprocess
import sysconfig
import weakref
from typing import Dict, Iterator, List, Optional, Sequence, Union

import torch
from torch._library.custom_ops import OPDEFS
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that launch no kernel: allocations without initialisation and metadata queries.
_NO_KERNEL = {
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.new_empty.default",
    "aten.new_empty_strided.default", "aten.empty_like.default", "prim.device.default",
    "aten.lift_fresh.default", "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default",
    "aten.is_same_size.default", "aten._has_compatible_shallow_copy_type.default",
}


def launches_kernel(func) -> bool:
    """Whether the operator overload `func` would launch work on a device (not a view, alias or
    metadata query, not an uninitialised allocation)."""
    if str(func) in _NO_KERNEL:
        return False
    schema = func._schema
    # A view returns an alias of an input (its return carries an alias annotation, not written).
    if schema.returns and all(ret.alias_info is not None and not ret.alias_info.is_write for ret in schema.returns):
        return False
    return True


# Kernel launches of one call of tutel's compiled operators on CUDA (csrc/ops/cuda, listed in
# docs/cuda-backend.md), as a number or a function of the call's arguments; every other operator
# counts one.
CUDA_LAUNCHES = {
    "tutel.route_topk.default": 3,
    "tutel.assign_locations.default": 3,
    "tutel.cumsum_sub_one.default": 3,
    # a memset of the slot table, claiming slots, the rows; the grouped layout (no indices): no memset
    "tutel.scatter_slots.default": lambda src, indices, *rest: 3 if indices is not None else 2,
    "tutel.group_by_expert.default": 2,
    "tutel.route_experts.default": 2,
    "tutel.decode_experts.default": 2,
    # gate/up and down; fp8_block's scales other than float32 are converted to float32 first
    "tutel.decode_quantized_experts.default":
        lambda x, ids, weights, format, gate_up, gate_up_scales, gate_up_global, down, down_scales, *rest:
        2 + (format == "fp8_block") * ((gate_up_scales.dtype != torch.float32) + (down_scales.dtype != torch.float32)),
    # the kernel; int64 ends converted to int32, a bias other than float32 and fp8_block's scales other
    # than float32 converted first (one launch each); W8A8's quantization inside the kernel
    "tutel.quantized_grouped_linear.default":
        lambda rows, ends, format, codes, scales, global_scale, block, bias, activation_group=0:
        1 + (ends.dtype != torch.int32) + (bias is not None and bias.dtype != torch.float32)
        + (format == "fp8_block" and scales.dtype != torch.float32),
    "tutel.add_expert_bias_.default": 1,
    "tutel.expert_row_sums.default": 1,
    "tutel.choice_rows.default": 1,
    "tutel.grouped_rows_linear.default": 1,
    # the row gradient's product, then the weight and bias gradients together (none asked: nothing)
    "tutel.grouped_rows_linear_backward.default":
        lambda grad, rows, weight, offsets, transposed, mask: bool(mask[0]) + bool(mask[1] or mask[2]),
}


def _python_implementation(func):
    """The Python function behind a torch.library.custom_op operator (whose own launches are the
    operators it calls), or None for an operator implemented otherwise."""
    definition = OPDEFS.get(func._schema.name)
    return None if definition is None else definition._init_fn


class OperatorCount(TorchDispatchMode):
    """Records every operator dispatched inside the mode that launches a kernel.

    An operator defined in Python (torch.library.custom_op, e.g. tutel.ops.grouped_mm's) is opened:
    its implementation runs under the mode instead of its fake kernel, so the operators it calls
    are what is recorded.  ``kernels`` weighs each recorded operator by its CUDA launches."""

    def __init__(self):
        super().__init__()
        self.operators: List[str] = []
        self.launches: List[int] = []  # the CUDA kernels of each recorded operator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        implementation = _python_implementation(func)
        if implementation is not None:
            with OperatorCount() as inner:
                result = implementation(*args, **(kwargs or {}))
            self.operators.extend(inner.operators)
            self.launches.extend(inner.launches)
            return result
        if launches_kernel(func):
            name = str(func)
            launches = CUDA_LAUNCHES.get(name, 1)
            self.operators.append(name)
            self.launches.append(launches(*args, **(kwargs or {})) if callable(launches) else launches)
        return func(*args, **(kwargs or {}))

    def __len__(self) -> int:
        return len(self.operators)

    @property
    def kernels(self) -> int:
        """The CUDA kernels the recorded operators launch."""
        return sum(self.launches)


_GUARD_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda_guard.cpp")
_guard_loaded = False


def _load_fake_cuda_guard() -> None:
    """On a PyTorch without a usable CUDA device (a CPU build, or a CUDA build on a machine without
    a GPU), compiles (once per PyTorch version, cached under build/) and loads fake_cuda_guard.cpp,
    so autograd can record graphs of fake CUDA tensors."""
    global _guard_loaded
    if _guard_loaded or torch.cuda.is_available():
        return
    torch_dir = os.path.dirname(torch.__file__)
    # C++20, which newer releases' headers need (their cpp_extension passes it too) and older ones
    # compile under; the C++ ABI the wheel was built with (the oldest supported releases' is the old one).
    flags = ["-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    with open(_GUARD_SOURCE, "rb") as source:
        key = hashlib.sha256(source.read() + " ".join([torch.__version__] + flags).encode()).hexdigest()[:16]
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(_GUARD_SOURCE))), "build", "test_support")
    library = os.path.join(root, f"fake_cuda_guard_{key}.so")
    if not os.path.exists(library):
        os.makedirs(root, exist_ok=True)
        compiler = os.environ.get("CXX") or sysconfig.get_config_var("CXX").split()[0] or "c++"
        partial = f"{library}.{os.getpid()}.tmp"
        subprocess.run([compiler, *flags, "-O1", "-shared", "-fPIC", f"-I{torch_dir}/include", _GUARD_SOURCE,
                        f"-L{torch_dir}/lib", "-lc10", "-o", partial], check=True)
        os.replace(partial, library)  # atomic: concurrent test processes never load half a file
    torch.ops.load_library(library)
    _guard_loaded = True


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """A FakeTensorMode in which tensors made on "cuda" are fake CUDA tensors, with no shape
    environment: data-dependent shapes and host reads raise.  Autograd records graphs of them
    (walk those with backward_by_hand)."""
    _load_fake_cuda_guard()
    with recording_function_arguments(), FakeTensorMode(allow_non_fake_inputs=False) as mode:
        yield mode


# For the nodes of Python autograd Functions made while recording: which forward arguments were
# tensors (their backward returns one gradient per argument, the graph has edges for tensors only).
_TENSOR_ARGUMENTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def recording_function_arguments() -> Iterator[None]:
    """Within the block, every autograd Function call records which of its arguments were tensors,
    so backward_by_hand can match the gradients its backward returns with the graph's edges."""
    # The attribute as stored, not as looked up: a Python classmethod on older releases, a method
    # implemented in C (inherited from the C base class) on newer ones.  Binding it to `cls` by hand
    # calls either; putting the stored object back (or removing ours, when it was inherited) restores it.
    stored = torch.autograd.Function.__dict__.get("apply")
    original = inspect.getattr_static(torch.autograd.Function, "apply")

    def apply(cls, *args, **kwargs):
        outputs = original.__get__(None, cls)(*args, **kwargs)
        for output in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
            node = getattr(output, "grad_fn", None)
            if isinstance(node, torch.autograd.function.BackwardCFunction):
                _TENSOR_ARGUMENTS[node] = [isinstance(arg, torch.Tensor) for arg in args]
                break
        return outputs

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        if stored is None:
            del torch.autograd.Function.apply
        else:
            torch.autograd.Function.apply = stored


def fake_parameters(module: torch.nn.Module, mode: FakeTensorMode, device: str = "cuda",
                    dtype: torch.dtype = None) -> torch.nn.Module:
    """`module` with every parameter and buffer replaced by a fake tensor on `device` (in `dtype`
    for floating ones), made from the real ones' shapes."""
    def fake(t: torch.Tensor) -> torch.Tensor:
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        with unset_fake_temporarily():  # the real tensor's detach runs outside the mode
            t = t.detach()
        return mode.from_tensor(t).to(device=device, dtype=target)

    for submodule in module.modules():
        for name, param in list(submodule._parameters.items()):
            if param is not None:
                submodule._parameters[name] = torch.nn.Parameter(fake(param), param.requires_grad)
        for name, buffer in list(submodule._buffers.items()):
            if buffer is not None:
                submodule._buffers[name] = fake(buffer)
    return module


def backward_by_hand(outputs: Union[torch.Tensor, Sequence[torch.Tensor]],
                     grads: Union[torch.Tensor, Sequence[torch.Tensor]]) -> Dict[torch.Tensor, torch.Tensor]:
    """The backward pass of `outputs` (seeded with `grads`, one per output) run node by node from
    Python, as the autograd engine would: every node of the graph is called once its gradients are
    complete, gradients reaching one input twice are added, and the leaves' gradients are returned
    (by leaf, not stored in .grad).

    On a PyTorch without CUDA the engine itself refuses graphs of (fake) CUDA tensors, since it
    looks for the device's streams; the nodes' own backward functions, which are what a CUDA
    build would launch, run as they are."""
    if isinstance(outputs, torch.Tensor):
        outputs, grads = [outputs], [grads]
    roots = [output.grad_fn for output in outputs]
    order = _topological_order(roots)
    inputs: Dict[object, List[Optional[torch.Tensor]]] = {}
    for root, output, grad in zip(roots, outputs, grads):
        slots = inputs.setdefault(root, [None] * _input_count(root))
        slots[output.output_nr] = grad
    leaves: Dict[torch.Tensor, torch.Tensor] = {}
    for node in order:
        grads = inputs.pop(node, None)
        if grads is None:  # nothing flows into this node (every gradient it would take is None)
            continue
        if type(node).__name__ == "AccumulateGrad":
            leaves[node.variable] = grads[0]
            continue
        outputs = _run_node(node, grads)
        for (successor, slot), value in zip(node.next_functions, outputs):
            if successor is None or value is None:
                continue
            value = _as_expected(successor, slot, value)
            slots = inputs.setdefault(successor, [None] * _input_count(successor))
            slots[slot] = value if slots[slot] is None else slots[slot] + value
    return leaves


def _run_node(node, grads: List[Optional[torch.Tensor]]) -> tuple:
    """The gradients `node` sends along its edges (node.next_functions), in their order."""
    if not isinstance(node, torch.autograd.function.BackwardCFunction):
        outputs = node(*grads)
        return outputs if isinstance(outputs, tuple) else (outputs,)
    # A Python Function's backward runs through .apply and returns a gradient per forward
    # argument; the graph has edges for the tensor arguments only.
    outputs = node.apply(*grads)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    tensors = _TENSOR_ARGUMENTS.get(node)
    if tensors is None:
        raise RuntimeError(f"backward_by_hand: {type(node).__name__} was made outside recording_function_arguments()")
    return tuple(grad for grad, is_tensor in zip(outputs, tensors) if is_tensor)


def _as_expected(node, slot: int, grad: torch.Tensor) -> torch.Tensor:
    """`grad` reduced to the shape and dtype `node` expects for input `slot`, as the engine does
    (a broadcast gradient summed back, a gradient of another dtype converted)."""
    metadata = getattr(node, "_input_metadata", None)
    if metadata is None or slot >= len(metadata):
        return grad
    expected = metadata[slot]
    if tuple(grad.shape) != tuple(expected.shape):
        grad = grad.sum_to_size(expected.shape)
    return grad if grad.dtype == expected.dtype else grad.to(expected.dtype)


def _input_count(node) -> int:
    """How many gradients `node` takes (one per output of its forward)."""
    metadata = getattr(node, "_input_metadata", None)
    return len(metadata) if metadata is not None else 1


def _topological_order(roots: list) -> list:
    """The nodes reachable from `roots`, each after every node that sends it a gradient."""
    seen, order = set(), []

    def visit(node):
        seen.add(node)
        for successor, _ in node.next_functions:
            if successor is not None and successor not in seen:
                visit(successor)
        order.append(node)

    for root in roots:
        if root not in seen:
            visit(root)
    return list(reversed(order))

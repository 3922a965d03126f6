"""What the layer benchmarks compare: tutel's moe_layer, the ideal (only the GEMMs the layer
must do, on tokens already laid out per expert) and a naive GShard / fairseq-style layer whose
dispatch and combine are one-hot einsums over [tokens, experts, capacity].

All three share the same gate weight and expert module, so they compute the same function
(the naive layer's output is checked against moe_layer's before timing).
"""
import resource
import types
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

from _common import interleaved_medians
from tutel import moe
from tutel.rules.capacity import expert_capacity


def build_layer(model_dim: int, hidden: int, experts: int, top_k: int, dtype: torch.dtype,
                capacity_factor: float = 1.0) -> torch.nn.Module:
    """A single-process moe_layer with the linear top-k gate and ReLU FFN experts."""
    layer = moe.moe_layer(gate_type={"type": "top", "k": top_k, "capacity_factor": capacity_factor},
                          model_dim=model_dim,
                          experts={"type": "ffn", "num_experts_per_device": experts, "hidden_size_per_expert": hidden})
    return layer.to(dtype)


def expert_context() -> types.SimpleNamespace:
    """The attributes built-in experts read from the layer, for calling them directly."""
    return types.SimpleNamespace(world_size=1, megablocks_size=0, sharded_count=1, adaptive_degree=1)


def clear_grads(module: torch.nn.Module, *tensors: torch.Tensor) -> None:
    module.zero_grad(set_to_none=True)
    for tensor in tensors:
        tensor.grad = None


# Largest allowed |naive - moe_layer|, relative to the largest |output|: both sum the same k
# weighted expert rows, in another order, and round to the data type (16-bit: a few units in
# the last place of the largest output; float32: a few hundred float32 roundings).
NAIVE_RELATIVE_BOUND = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


class NaiveGShardLayer:
    """Top-k routing with dense one-hot masks, as GShard / fairseq's top2gating generalised to k:
    [T, E] masks per choice, cumsum locations, a [T, E, C] combine tensor, einsum dispatch and
    combine.  Same semantics as moe_layer (GShard slot order, gates normalised over the k choices,
    gshard loss, choices beyond capacity dropped)."""

    def __init__(self, gate_weight: torch.Tensor, experts: torch.nn.Module, top_k: int, capacity: int):
        self.gate_weight, self.experts, self.top_k, self.capacity = gate_weight, experts, top_k, capacity
        self.context = expert_context()

    def __call__(self, x: torch.Tensor):
        logits = F.linear(x, self.gate_weight)
        probs = F.softmax(logits, dim=1)
        tokens, experts = probs.shape
        # Ties go to the lower expert index (moe_layer's rule; torch.topk leaves them unordered,
        # and 16-bit probabilities tie often).
        top = torch.sort(probs, dim=1, descending=True, stable=True).indices[:, :self.top_k]
        # Slot counting in integers: a 16-bit float counts exactly only up to 256 (bfloat16).
        masks = [F.one_hot(top[:, j], experts) for j in range(self.top_k)]
        l_aux = torch.sum(probs.mean(dim=0) * masks[0].to(probs.dtype).mean(dim=0)) * experts
        # Gates in float32 at least, as fairseq's gating and moe_layer compute them.
        gate_probs = probs.to(torch.promote_types(probs.dtype, torch.float32))
        gates = [(gate_probs * mask).sum(dim=1) for mask in masks]
        if self.top_k > 1:
            denominator = torch.clamp(sum(gates), min=torch.finfo(gate_probs.dtype).eps)
            gates = [gate / denominator for gate in gates]
        combine = x.new_zeros((tokens, experts, self.capacity), dtype=gate_probs.dtype)
        filled = torch.zeros(experts, dtype=torch.int64)
        for mask, gate in zip(masks, gates):
            locations = torch.cumsum(mask, dim=0) - 1 + filled
            filled = filled + mask.sum(dim=0)
            mask = mask * (locations < self.capacity)
            slot = (locations * mask).sum(dim=1)
            combine = combine + (gate * mask.sum(dim=1))[:, None, None] * mask[:, :, None] * \
                F.one_hot(slot, self.capacity)[:, None, :]
        combine = combine.to(x.dtype)
        dispatch = (combine != 0).to(x.dtype)
        dispatched = torch.einsum("tec,tm->ecm", dispatch, x)
        expert_out = self.experts(dispatched, self.context)
        out = torch.einsum("tec,ecm->tm", combine, expert_out)
        return out, l_aux


class LayerCase:
    """One shape and dtype: the three candidates as step functions (forward + backward)."""

    def __init__(self, tokens: int, model_dim: int, hidden: int, experts: int, top_k: int, dtype: torch.dtype,
                 seed: int = 0):
        torch.manual_seed(seed)
        self.shape = dict(T=tokens, M=model_dim, H=hidden, E=experts, k=top_k)
        self.dtype = dtype
        self.layer = build_layer(model_dim, hidden, experts, top_k, dtype)
        self.capacity = expert_capacity(1.0, top_k, tokens, experts)
        self.gate_weight = self.layer.gates[0].wg.weight
        self.naive = NaiveGShardLayer(self.gate_weight, self.layer.experts, top_k, self.capacity)
        self.context = expert_context()
        self.inputs = self.make_inputs()

    def make_inputs(self) -> Dict[str, torch.Tensor]:
        s, dtype = self.shape, self.dtype
        return {
            "x": torch.randn(s["T"], s["M"], dtype=dtype, requires_grad=True),
            "grad_y": torch.randn(s["T"], s["M"], dtype=dtype),
            "x_laid_out": torch.randn(s["E"], self.capacity, s["M"], dtype=dtype, requires_grad=True),
            "grad_laid_out": torch.randn(s["E"], self.capacity, s["M"], dtype=dtype),
            "grad_logits": torch.randn(s["T"], s["E"], dtype=dtype),
        }

    # Each step takes its inputs, so a memory measurement can create them inside the window.
    def layer_step(self, inputs: Dict[str, torch.Tensor]) -> None:
        clear_grads(self.layer, inputs["x"])
        y = self.layer(inputs["x"])
        torch.autograd.backward([y, y.l_aux], [inputs["grad_y"], torch.ones((), dtype=y.l_aux.dtype)])

    def ideal_step(self, inputs: Dict[str, torch.Tensor]) -> None:
        clear_grads(self.layer, inputs["x"], inputs["x_laid_out"])
        logits = F.linear(inputs["x"], self.gate_weight)
        y = self.layer.experts(inputs["x_laid_out"], self.context)
        torch.autograd.backward([y, logits], [inputs["grad_laid_out"], inputs["grad_logits"]])

    def naive_step(self, inputs: Dict[str, torch.Tensor]) -> None:
        clear_grads(self.layer, inputs["x"])
        y, l_aux = self.naive(inputs["x"])
        torch.autograd.backward([y, l_aux], [inputs["grad_y"], torch.ones((), dtype=l_aux.dtype)])

    def steps(self, include_naive: bool = True) -> Dict[str, Callable[[], None]]:
        steps = {"layer": lambda: self.layer_step(self.inputs), "ideal": lambda: self.ideal_step(self.inputs)}
        if include_naive:
            steps["naive"] = lambda: self.naive_step(self.inputs)
        return steps

    def naive_difference(self) -> float:
        """Largest |naive - moe_layer| over the outputs; raises if it exceeds the dtype's bound
        (they compute the same function, so a larger difference is a bug in one of them)."""
        with torch.no_grad():
            expected = self.layer(self.inputs["x"]).float()
            got = self.naive(self.inputs["x"])[0].float()
        if not expected.numel():
            return 0.0
        difference = float((expected - got).abs().max())
        bound = NAIVE_RELATIVE_BOUND[self.dtype] * max(float(expected.abs().max()), 1e-30)
        if not difference <= bound:
            raise AssertionError(f"the naive layer differs from moe_layer by {difference:g} at {self.shape} in "
                                 f"{self.dtype}, more than the bound {bound:g} (|output| <= "
                                 f"{float(expected.abs().max()):g})")
        return difference

    def inputs_only_for(self, name: str) -> Dict[str, torch.Tensor]:
        """Fresh inputs that `name`'s step reads (the others are not allocated)."""
        s, dtype = self.shape, self.dtype
        inputs = {"x": torch.randn(s["T"], s["M"], dtype=dtype, requires_grad=True)}
        if name == "ideal":
            inputs["x_laid_out"] = torch.randn(s["E"], self.capacity, s["M"], dtype=dtype, requires_grad=True)
            inputs["grad_laid_out"] = torch.randn(s["E"], self.capacity, s["M"], dtype=dtype)
            inputs["grad_logits"] = torch.randn(s["T"], s["E"], dtype=dtype)
        else:
            inputs["grad_y"] = torch.randn(s["T"], s["M"], dtype=dtype)
        return inputs

    def step_with_fresh_inputs(self, name: str) -> Callable[[], None]:
        step = {"layer": self.layer_step, "ideal": self.ideal_step, "naive": self.naive_step}[name]
        return lambda: step(self.inputs_only_for(name))


def time_case(case: LayerCase, reps: int, naive_limit_bytes: Optional[int] = 2 << 30) -> Dict[str, object]:
    """Interleaved median step times of layer, ideal and (where it fits) naive, and their ratios."""
    s = case.shape
    with_naive = naive_fits(s["T"], s["E"], case.capacity, naive_limit_bytes)
    row: Dict[str, object] = dict(s, C=case.capacity)
    if with_naive:
        row["naive_max_abs_diff"] = case.naive_difference()
    times = interleaved_medians(case.steps(include_naive=with_naive), reps)
    row["foreign_cpus"] = times.foreign_cpus
    # Fresh memory the layer's step touches beyond the ideal's.
    row["extra_fault_mib"] = (times.faults["layer"] - times.faults["ideal"]) * resource.getpagesize() / 2**20
    for name, seconds in times.items():
        row[f"{name}_ms"] = seconds * 1e3
    row["layer/ideal"] = times["layer"] / times["ideal"]
    row["naive/layer"] = times["naive"] / times["layer"] if with_naive else None
    row["tokens_per_s"] = s["T"] / times["layer"]
    return row


def time_case_under_glibc(case: LayerCase, reps: int) -> Dict[str, object]:
    """layer and ideal timed as time_case does, keys suffixed with _glibc (for glibc's default malloc)."""
    times = interleaved_medians(case.steps(include_naive=False), reps)
    return {"layer_ms_glibc": times["layer"] * 1e3, "ideal_ms_glibc": times["ideal"] * 1e3,
            "layer/ideal_glibc": times["layer"] / times["ideal"], "foreign_cpus_glibc": times.foreign_cpus}


def naive_fits(tokens: int, experts: int, capacity: int, limit_bytes: Optional[int] = 2 << 30) -> bool:
    """Whether the naive layer's [T, E, C] float32 tensors (a handful of them) fit in `limit_bytes`."""
    return limit_bytes is None or 6 * 4 * tokens * experts * capacity <= limit_bytes

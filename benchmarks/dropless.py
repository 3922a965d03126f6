"""Dropless routing (capacity_factor = 0) under skewed loads: the grouped computation
(megablocks_size = 1: each expert's GEMMs over its real rows only) against the padded path
(every expert padded to the busiest one's load) and against the ideal for the real token count
(the gate GEMM plus one dense FFN per expert on exactly its tokens), forward + backward.

Routing is pinned: every token picks expert 0 (which thus receives half of all choices) and one
other expert drawn from a Zipf law; a 'uniform' row draws both choices evenly for comparison.

    python benchmarks/dropless.py            # writes benchmarks/results/dropless.json
    python benchmarks/dropless.py --smoke
"""
import sys
from typing import Dict, Optional, Sequence

import torch
import torch.nn.functional as F

from _common import (add_memory, config_child, interleaved_medians, load_average, measure_rows, memory_child,
                     parse_args, peak_memory_mib, write_result)
from _models import clear_grads
from tutel import moe

# (T, M, H, E, k = 2)
SHAPES = [(4096, 512, 1024, 8), (4096, 512, 256, 32)]
SMOKE_SHAPES = [(64, 16, 32, 4)]
ZIPF_EXPONENT = 1.1


class PinnedGate(torch.nn.Module):
    """A linear gate plus a fixed per-token preference that decides the top-2 experts."""

    def __init__(self, model_dim: int, num_global_experts: int, top_k: int = 2):
        super().__init__()
        self.top_k, self.capacity_factor, self.gate_noise = top_k, 0.0, 0.0
        self.wg = torch.nn.Linear(model_dim, num_global_experts, bias=False)
        self.register_buffer("preference", torch.zeros(0, num_global_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wg(x) + self.preference


def preferences(tokens: int, experts: int, routing: str, generator: torch.Generator) -> torch.Tensor:
    """[T, E] logit offsets making each token's top-2 the wanted pair."""
    if routing == "uniform":
        pairs = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(tokens)])
    else:
        ranks = torch.arange(1, experts, dtype=torch.float64)
        second = 1 + torch.multinomial(ranks ** -ZIPF_EXPONENT, tokens, replacement=True, generator=generator)
        pairs = torch.stack([torch.zeros(tokens, dtype=torch.long), second], dim=1)
    offsets = torch.zeros(tokens, experts)
    offsets.scatter_(1, pairs, torch.tensor([[20.0, 10.0]]).expand(tokens, 2))
    return offsets


class DroplessCase:
    def __init__(self, tokens: int, model_dim: int, hidden: int, experts: int, routing: str):
        torch.manual_seed(0)
        self.shape = dict(T=tokens, M=model_dim, H=hidden, E=experts, k=2, routing=routing)
        self.layer = moe.moe_layer(gate_type={"type": "custom", "module": PinnedGate, "top_k": 2}, model_dim=model_dim,
                                   experts={"type": "ffn", "num_experts_per_device": experts,
                                            "hidden_size_per_expert": hidden})
        gate = self.layer.gates[0]
        gate.preference = preferences(tokens, experts, routing, torch.Generator().manual_seed(1))
        with torch.no_grad():
            self.layer(torch.randn(tokens, model_dim), capacity_factor=0.0)
        self.loads = [int(n) for n in self.layer.dispatch_count]
        experts_module = self.layer.experts
        # The ideal's experts: independent dense layers with the same weights.
        params = (experts_module.batched_fc1_w, experts_module.batched_fc1_bias, experts_module.batched_fc2_w,
                  experts_module.batched_fc2_bias)
        self.ideal_weights = [[p[e].detach().clone().requires_grad_() for p in params] for e in range(experts)]
        self.inputs = self.make_inputs()

    def make_inputs(self) -> Dict[str, object]:
        s = self.shape
        return {"x": torch.randn(s["T"], s["M"], requires_grad=True), "grad_y": torch.randn(s["T"], s["M"]),
                "rows": [torch.randn(load, s["M"], requires_grad=True) for load in self.loads],
                "grad_rows": [torch.randn(load, s["M"]) for load in self.loads],
                "grad_logits": torch.randn(s["T"], s["E"])}

    def layer_step(self, inputs, megablocks_size: int) -> None:
        clear_grads(self.layer, inputs["x"])
        y = self.layer(inputs["x"], capacity_factor=0.0, megablocks_size=megablocks_size)
        torch.autograd.backward([y, y.l_aux], [inputs["grad_y"], torch.ones(())])

    def ideal_step(self, inputs) -> None:
        clear_grads(self.layer, inputs["x"], *inputs["rows"])
        for weights in self.ideal_weights:
            for w in weights:
                w.grad = None
        outputs = [F.linear(inputs["x"], self.layer.gates[0].wg.weight)]
        for (w1, b1, w2, b2), rows in zip(self.ideal_weights, inputs["rows"]):
            outputs.append(torch.addmm(b2, torch.relu(torch.addmm(b1, rows, w1.t())), w2))
        torch.autograd.backward(outputs, [inputs["grad_logits"]] + inputs["grad_rows"])

    def steps(self, inputs=None):
        inputs = inputs or self.inputs
        return {"grouped": lambda: self.layer_step(inputs, 1), "padded": lambda: self.layer_step(inputs, 0),
                "ideal": lambda: self.ideal_step(inputs)}


def measure(shape, routing: str, reps: int) -> Dict[str, object]:
    tokens, model_dim, hidden, experts = shape
    case = DroplessCase(tokens, model_dim, hidden, experts, routing)
    times = interleaved_medians(case.steps(), reps)
    row: Dict[str, object] = dict(case.shape, load_before=load_average(), busiest_share=max(case.loads) / (2 * tokens),
                                  real_rows=sum(case.loads), padded_rows=experts * max(case.loads))
    for name, seconds in times.items():
        row[f"{name}_ms"] = seconds * 1e3
    row["foreign_cpus"] = times.foreign_cpus
    row["grouped/ideal"] = times["grouped"] / times["ideal"]
    row["padded/grouped"] = times["padded"] / times["grouped"]
    return row


def measure_glibc(shape, routing: str, reps: int) -> Dict[str, object]:
    case = DroplessCase(*shape, routing)
    times = interleaved_medians(case.steps(), reps)
    return {"grouped_ms_glibc": times["grouped"] * 1e3, "ideal_ms_glibc": times["ideal"] * 1e3,
            "grouped/ideal_glibc": times["grouped"] / times["ideal"], "foreign_cpus_glibc": times.foreign_cpus}


def measure_memory(row: Dict[str, object]) -> None:
    case = DroplessCase(row["T"], row["M"], row["H"], row["E"], row["routing"])
    for name in ("grouped", "padded", "ideal"):
        case.steps(case.make_inputs())[name]()
        row[f"{name}_peak_mib"] = peak_memory_mib(lambda: case.steps(case.make_inputs())[name]())


COLUMNS = ["T", "M", "H", "E", "k", "routing", "busiest_share", "real_rows", "padded_rows", "grouped_ms", "padded_ms",
           "ideal_ms", "grouped/ideal", "grouped/ideal_glibc", "padded/grouped", "grouped_peak_mib", "padded_peak_mib",
           "ideal_peak_mib", "foreign_cpus"]


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(__doc__.splitlines()[0], argv, default_reps=10)
    if config_child(args, measure, measure_glibc) or memory_child(args, measure_memory):
        return {}
    configs = [(shape, routing, args.reps) for shape in (SMOKE_SHAPES if args.smoke else SHAPES)
               for routing in ("zipf", "uniform")]
    rows = measure_rows(configs, measure, COLUMNS, glibc_row=measure_glibc, script=__file__)
    add_memory(rows, measure_memory, COLUMNS, __file__)
    result = {"rows": rows, "reps": args.reps, "columns": COLUMNS, "zipf_exponent": ZIPF_EXPONENT}
    write_result(args.out, "dropless", result, args.smoke)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

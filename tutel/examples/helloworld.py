"""Trains a one-layer MoE model on a synthetic batch and reports step times.

    python3 -m tutel.examples.helloworld --batch_size=16 [--device cpu]
    python3 -m torch.distributed.run --nproc_per_node=2 -m tutel.examples.helloworld --device cpu

The model is moe_layer -> sum over features -> log_softmax over tokens, trained with NLL towards
token 0, so the loss falls step by step.
"""
import os

import torch
import torch.nn.functional as F

from tutel import moe as tutel_moe
from tutel.examples import _common


def parse_args(argv=None):
    return _common.parser_for(__doc__, "fp32_gate", "allreduce_degree", "parallel_type", "checkpoint_path", "use_2dh",
                              "eval", "capacity_factor", "megablocks_size", "use_tensorcore",
                              "expert_type").parse_args(argv)


class ExampleModel(torch.nn.Module):
    """moe_layer -> sum over features -> log_softmax over tokens.  Flags missing from `args` take
    helloworld's defaults (the DDP variants share this model)."""

    def __init__(self, args, rank: int, dist_print, mark_experts: bool = True):
        super().__init__()
        option = lambda name, default: getattr(args, name, default)
        self.megablocks_size = option("megablocks_size", 0)
        self._moe_layer = tutel_moe.moe_layer(
            gate_type={"type": "top", "k": args.top, "fp32_gate": option("fp32_gate", False),
                       "capacity_factor": option("capacity_factor", 1.0)},
            experts={"type": option("expert_type", "ffn"), "num_experts_per_device": args.num_local_experts,
                     "hidden_size_per_expert": args.hidden_size, "activation_fn": lambda x: F.relu(x)},
            model_dim=args.model_dim,
            scan_expert_func=(lambda name, param: setattr(param, "skip_allreduce", True)) if mark_experts else None,
            seeds=(1, rank + 1, 1),
            a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
            use_2dh=option("use_2dh", False),
            parallel_type=option("parallel_type", "adaptive:1"),
        )
        local_count = sum(p.numel() for _, p in self._moe_layer.get_parameter_iterator(param_type="local_experts"))
        shared_count = sum(p.numel() for _, p in self._moe_layer.get_parameter_iterator(param_type="gate"))
        dist_print("[Statistics] param count for MoE local_experts = %s, param count for MoE gate = %s.\n"
                   % (local_count, shared_count))

    def forward(self, input):
        result = self._moe_layer(input, megablocks_size=self.megablocks_size)
        return F.log_softmax(torch.sum(result, dim=2), dim=1)


def main(argv=None):
    args = parse_args(argv)
    parallel_env, dist_print, world_size, device, dtype = _common.start(args)
    rank = parallel_env.global_rank
    if args.use_tensorcore:
        torch.backends.cuda.matmul.allow_tf32 = True

    model = ExampleModel(args, rank, dist_print).to(device=device, dtype=dtype)
    dist_print(model)
    checkpoint = _common.checkpoint_file(args.checkpoint_path, rank, world_size)
    if checkpoint and os.path.exists(checkpoint):
        model.load_state_dict(torch.load(checkpoint, map_location=device))
        dist_print("Loaded checkpoint %s" % checkpoint)

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    x, y = _common.synthetic_inputs(args.batch_size, args.num_tokens, args.model_dim, dtype, device)
    dist_print(_common.benchmark_line(args, world_size, device, args.parallel_type))
    layer = model._moe_layer
    step = _common.training_step(model, optimizer, x, y, layer, l_aux_wt=args.l_aux_wt, eval_mode=args.eval,
                                 shared=[] if args.allreduce_degree == -1 else _common.shared_parameters(model),
                                 world_size=world_size)
    printer = _common.tflops_printer(dist_print, args, layer.num_global_experts, args.eval)
    times = _common.train_steps(args.num_steps, step, _common.make_record_time(args.device), printer)
    dist_print(times.summary_line())
    if checkpoint:
        torch.save(model.state_dict(), checkpoint)


if __name__ == "__main__":
    main()

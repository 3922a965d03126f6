"""Trains a one-layer MoE model on a synthetic batch and reports step times.

    python3 -m tutel.examples.helloworld --batch_size=16 [--device cpu]
    python3 -m torch.distributed.run --nproc_per_node=2 -m tutel.examples.helloworld --device cpu

The model is moe_layer -> sum over features -> log_softmax over tokens, trained with NLL towards
token 0, so the loss falls step by step.
"""
import argparse
import os

import torch
import torch.nn.functional as F

from tutel import moe as tutel_moe
from tutel.examples import _common


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_flags(parser)
    parser.add_argument("--fp32_gate", default=False, action="store_true")
    parser.add_argument("--allreduce_degree", type=int, default=1, help="-1 disables the gradient all-reduce")
    parser.add_argument("--parallel_type", type=str, default="adaptive:1")
    parser.add_argument("--checkpoint_path", type=str, default="", help="pattern with {rank} and {size}")
    parser.add_argument("--use_2dh", default=False, action="store_true")
    parser.add_argument("--eval", default=False, action="store_true")
    parser.add_argument("--capacity_factor", type=float, default=1.0)
    parser.add_argument("--megablocks_size", type=int, default=0)
    parser.add_argument("--use_tensorcore", default=False, action="store_true")
    parser.add_argument("--expert_type", type=str, default="ffn")
    return parser.parse_args(argv)


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
    parallel_env = _common.init_parallel(args.device)
    rank, world_size, dist_print = parallel_env.global_rank, parallel_env.global_size, parallel_env.dist_print
    device = parallel_env.local_device
    if args.use_tensorcore:
        torch.backends.cuda.matmul.allow_tf32 = True
    dtype = _common.DTYPES[args.dtype]

    model = ExampleModel(args, rank, dist_print).to(device=device, dtype=dtype)
    dist_print(model)
    checkpoint = _common.checkpoint_file(args.checkpoint_path, rank, world_size)
    if checkpoint and os.path.exists(checkpoint):
        model.load_state_dict(torch.load(checkpoint, map_location=device))
        dist_print("Loaded checkpoint %s" % checkpoint)

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    x, y = _common.synthetic_inputs(args.batch_size, args.num_tokens, args.model_dim, dtype, device)
    dist_print("[Benchmark] world_size = %s, dtype = %s, model_dim = %s, hidden_size = %s, samples = %s, "
               "num_local_experts = %s, topK = %s, a2a_ffn_overlap_degree = %s, parallel_type = `%s`, device = `%s`"
               % (world_size, args.dtype, args.model_dim, args.hidden_size, args.batch_size * args.num_tokens,
                  args.num_local_experts, args.top, args.a2a_ffn_overlap_degree, args.parallel_type, device))
    shared = [] if args.allreduce_degree == -1 else _common.shared_parameters(model)
    num_global_experts = model._moe_layer.num_global_experts

    def step(_):
        if args.eval:
            with torch.no_grad():
                return F.nll_loss(model(x), y)
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)
        if args.l_aux_wt:
            loss = loss + args.l_aux_wt * model._moe_layer.l_aux
        loss.backward()
        _common.average_gradients(shared, world_size)
        optimizer.step()
        return loss

    def print_step(i, loss, seconds):
        tflops = _common.flops_tflops(args.batch_size, args.num_tokens, args.model_dim, args.hidden_size, args.top,
                                      num_global_experts, seconds, args.eval)
        dist_print("STEP-%s: loss = %.5f, step_time = %.6f sec, perf = %.2f tflops." % (i, loss, seconds, tflops))

    times = _common.train_steps(args.num_steps, step, _common.make_record_time(args.device), print_step)
    dist_print(times.summary_line())
    if checkpoint:
        torch.save(model.state_dict(), checkpoint)


if __name__ == "__main__":
    main()

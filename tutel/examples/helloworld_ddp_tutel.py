"""helloworld with tutel's ZeRO-1 style TutelDistributedOptimizer.

    python3 -m torch.distributed.run --nproc_per_node=2 -m tutel.examples.helloworld_ddp_tutel --device cpu

The optimizer shards the shared parameters' state across processes, reduce-scatters their
gradients (averaged: average_shared=True) and keeps expert parameters local.
"""
import argparse

import torch
import torch.nn.functional as F

from tutel import net
from tutel.examples import _common
from tutel.examples.helloworld import ExampleModel


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_flags(parser)
    parser.add_argument("--fp32_gate", default=False, action="store_true")
    parser.add_argument("--allreduce_degree", type=int, default=1, help="accepted for compatibility; unused")
    parser.add_argument("--parallel_type", type=str, default="auto")
    parser.add_argument("--use_2dh", default=False, action="store_true")
    parser.add_argument("--eval", default=False, action="store_true")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    parallel_env = _common.init_parallel(args.device)
    dist_print, world_size, device = parallel_env.dist_print, parallel_env.global_size, parallel_env.local_device
    dtype = _common.DTYPES[args.dtype]
    model = ExampleModel(args, parallel_env.global_rank, dist_print, mark_experts=False).to(device=device, dtype=dtype)
    dist_print(model)
    optimizer = net.TutelDistributedOptimizer(model.parameters(), group=None, average_shared=True).warp_local(
        torch.optim.SGD, lr=1e-5)
    x, y = _common.synthetic_inputs(args.batch_size, args.num_tokens, args.model_dim, dtype, device)
    dist_print("[Benchmark] world_size = %s, dtype = %s, model_dim = %s, hidden_size = %s, samples = %s, "
               "num_local_experts = %s, topK = %s, a2a_ffn_overlap_degree = %s, parallel_type = `%s`, device = `%s`"
               % (world_size, args.dtype, args.model_dim, args.hidden_size, args.batch_size * args.num_tokens,
                  args.num_local_experts, args.top, args.a2a_ffn_overlap_degree, args.parallel_type, device))

    def step(_):
        if args.eval:
            with torch.no_grad():
                return F.nll_loss(model(x), y)
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)
        if args.l_aux_wt:
            loss = loss + args.l_aux_wt * model._moe_layer.l_aux
        loss.backward()
        optimizer.step()
        return loss

    def print_step(i, loss, seconds):
        tflops = _common.flops_tflops(args.batch_size, args.num_tokens, args.model_dim, args.hidden_size, args.top,
                                      model._moe_layer.num_global_experts, seconds, args.eval)
        dist_print("STEP-%s: loss = %.5f, step_time = %.6f sec, perf = %.2f tflops." % (i, loss, seconds, tflops))

    times = _common.train_steps(args.num_steps, step, _common.make_record_time(args.device), print_step)
    dist_print(times.summary_line())


if __name__ == "__main__":
    main()

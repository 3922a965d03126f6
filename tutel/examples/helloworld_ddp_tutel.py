"""helloworld with tutel's ZeRO-1 style TutelDistributedOptimizer.

    python3 -m torch.distributed.run --nproc_per_node=2 -m tutel.examples.helloworld_ddp_tutel --device cpu

The optimizer shards the shared parameters' state across processes, reduce-scatters their
gradients (averaged: average_shared=True) and keeps expert parameters local.
"""

import torch

from tutel import net
from tutel.examples import _common
from tutel.examples.helloworld import ExampleModel


def parse_args(argv=None):
    return _common.parser_for(__doc__, "fp32_gate", "allreduce_degree", "parallel_type", "use_2dh", "eval",
                              parallel_type="auto").parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    parallel_env, dist_print, world_size, device, dtype = _common.start(args)
    model = ExampleModel(args, parallel_env.global_rank, dist_print, mark_experts=False).to(device=device, dtype=dtype)
    dist_print(model)
    optimizer = net.TutelDistributedOptimizer(model.parameters(), group=None, average_shared=True).warp_local(
        torch.optim.SGD, lr=1e-5)
    x, y = _common.synthetic_inputs(args.batch_size, args.num_tokens, args.model_dim, dtype, device)
    dist_print(_common.benchmark_line(args, world_size, device, args.parallel_type))
    layer = model._moe_layer
    step = _common.training_step(model, optimizer, x, y, layer, l_aux_wt=args.l_aux_wt, eval_mode=args.eval)
    printer = _common.tflops_printer(dist_print, args, layer.num_global_experts, args.eval)
    times = _common.train_steps(args.num_steps, step, _common.make_record_time(args.device), printer)
    dist_print(times.summary_line())


if __name__ == "__main__":
    main()

"""helloworld with PyTorch DistributedDataParallel for the shared (gate) parameters.

    python3 -m torch.distributed.run --nproc_per_node=2 -m tutel.examples.helloworld_ddp --device cpu

Expert parameters are different on every process, so DDP is told to ignore them
(``_ddp_params_and_buffers_to_ignore``); DDP averages the gate's gradients.
"""
import argparse

import torch
import torch.nn.functional as F

from tutel.examples import _common
from tutel.examples.helloworld import ExampleModel


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_flags(parser)
    parser.add_argument("--fp32_gate", default=False, action="store_true")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    parallel_env = _common.init_parallel(args.device)
    dist_print, world_size, device = parallel_env.dist_print, parallel_env.global_size, parallel_env.local_device
    dtype = _common.DTYPES[args.dtype]
    model = ExampleModel(args, parallel_env.global_rank, dist_print).to(device=device, dtype=dtype)
    if parallel_env.is_distributed:
        model._ddp_params_and_buffers_to_ignore = [name for name, p in model.named_parameters()
                                                   if getattr(p, "_tutel_expert", False)]
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    dist_print(model)
    layer = model.module._moe_layer if hasattr(model, "module") else model._moe_layer
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    x, y = _common.synthetic_inputs(args.batch_size, args.num_tokens, args.model_dim, dtype, device)
    dist_print("[Benchmark] world_size = %s, dtype = %s, model_dim = %s, hidden_size = %s, samples = %s, "
               "num_local_experts = %s, topK = %s, a2a_ffn_overlap_degree = %s, device = `%s`"
               % (world_size, args.dtype, args.model_dim, args.hidden_size, args.batch_size * args.num_tokens,
                  args.num_local_experts, args.top, args.a2a_ffn_overlap_degree, device))

    def step(_):
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)
        if args.l_aux_wt:
            loss = loss + args.l_aux_wt * layer.l_aux
        loss.backward()
        optimizer.step()
        return loss

    def print_step(i, loss, seconds):
        tflops = _common.flops_tflops(args.batch_size, args.num_tokens, args.model_dim, args.hidden_size, args.top,
                                      layer.num_global_experts, seconds, False)
        dist_print("STEP-%s: loss = %.5f, step_time = %.6f sec, perf = %.2f tflops." % (i, loss, seconds, tflops))

    times = _common.train_steps(args.num_steps, step, _common.make_record_time(args.device), print_step)
    dist_print(times.summary_line())


if __name__ == "__main__":
    main()

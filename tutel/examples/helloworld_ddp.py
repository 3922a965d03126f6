"""helloworld with PyTorch DistributedDataParallel for the shared (gate) parameters.

    python3 -m torch.distributed.run --nproc_per_node=2 -m tutel.examples.helloworld_ddp --device cpu

Expert parameters are different on every process, so DDP is told to ignore them
(``_ddp_params_and_buffers_to_ignore``); DDP averages the gate's gradients.
"""

import torch

from tutel.examples import _common
from tutel.examples.helloworld import ExampleModel


def parse_args(argv=None):
    return _common.parser_for(__doc__, "fp32_gate").parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    parallel_env, dist_print, world_size, device, dtype = _common.start(args)
    model = ExampleModel(args, parallel_env.global_rank, dist_print).to(device=device, dtype=dtype)
    layer = model._moe_layer
    if parallel_env.is_distributed:
        model._ddp_params_and_buffers_to_ignore = [name for name, p in model.named_parameters()
                                                   if getattr(p, "_tutel_expert", False)]
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    dist_print(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    x, y = _common.synthetic_inputs(args.batch_size, args.num_tokens, args.model_dim, dtype, device)
    dist_print(_common.benchmark_line(args, world_size, device))
    step = _common.training_step(model, optimizer, x, y, layer, l_aux_wt=args.l_aux_wt)
    printer = _common.tflops_printer(dist_print, args, layer.num_global_experts)
    times = _common.train_steps(args.num_steps, step, _common.make_record_time(args.device), printer)
    dist_print(times.summary_line())


if __name__ == "__main__":
    main()

"""helloworld under automatic mixed precision (autocast: float16 on CUDA, bfloat16 on CPU).

    python3 -m tutel.examples.helloworld_amp --batch_size=16 [--device cpu]
"""

import torch
import torch.nn.functional as F

from tutel.examples import _common
from tutel.examples.helloworld import ExampleModel


class AmpModel(ExampleModel):
    """helloworld's model with the MoE layer under autocast."""

    def __init__(self, args, rank, dist_print):
        super().__init__(args, rank, dist_print)
        self.device_type = args.device
        self.autocast_dtype = torch.float16 if args.device == "cuda" else torch.bfloat16

    def forward(self, input):
        with torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype):
            result = self._moe_layer(input)
        return F.log_softmax(torch.sum(result.float(), dim=2), dim=1)


def parse_args(argv=None):
    return _common.parser_for(__doc__, "fp32_gate").parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    parallel_env, dist_print, world_size, device, dtype = _common.start(args)
    model = AmpModel(args, parallel_env.global_rank, dist_print).to(device)
    dist_print(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    x, y = _common.synthetic_inputs(args.batch_size, args.num_tokens, args.model_dim, dtype, device)
    dist_print(_common.benchmark_line(args, world_size, device) + ", autocast = %s" % model.autocast_dtype)
    layer = model._moe_layer
    step = _common.training_step(model, optimizer, x, y, layer, l_aux_wt=args.l_aux_wt,
                                 shared=_common.shared_parameters(model), world_size=world_size)
    printer = _common.tflops_printer(dist_print, args, layer.num_global_experts)
    times = _common.train_steps(args.num_steps, step, _common.make_record_time(args.device), printer)
    dist_print(times.summary_line())


if __name__ == "__main__":
    main()

"""helloworld switching parallelism, overlap degree, top-k and capacity from step to step.

    python3 -m tutel.examples.helloworld_switch --batch_size=16 [--device cpu]
    python3 -m torch.distributed.run --nproc_per_node=4 -m tutel.examples.helloworld_switch --device cpu

Forward call n runs with adaptive_r = valid_rs[((n-1) // 8) % len(valid_rs)] and
a2a_ffn_overlap_degree = (n-1) % 8 + 1 (Tutel's schedule); with --switch_top_k and
--switch_capacity it also cycles top_k over 1..--top and the capacity factor over
(--cap_factor, 0 = dropless, -cap_factor).  The parameters never change layout: every
switch is free.
"""

import torch
import torch.nn.functional as F

from tutel.examples import _common
from tutel.examples.helloworld import ExampleModel


def parse_args(argv=None):
    parser = _common.parser_for(__doc__, "fp32_gate", "allreduce_degree", "checkpoint_path", "use_2dh", "eval")
    parser.add_argument("--cap_factor", type=float, default=1.0)
    parser.add_argument("--switch_top_k", default=False, action="store_true")
    parser.add_argument("--switch_capacity", default=False, action="store_true")
    return parser.parse_args(argv)


def schedule(call_index: int, valid_rs, args):
    """(capacity_factor, adaptive_r, overlap_degree, top_k) of forward call number call_index (0-based)."""
    i = call_index - 1
    r = valid_rs[(i // 8) % len(valid_rs)]
    overlap = i % 8 + 1
    top_k = (call_index % args.top) + 1 if args.switch_top_k else args.top
    factor = args.cap_factor
    if args.switch_capacity:
        factor = (args.cap_factor, 0.0, -abs(args.cap_factor))[call_index % 3]
    return factor, r, overlap, top_k


class SwitchingModel(ExampleModel):
    """helloworld's model whose every forward call takes the next settings of the schedule."""

    def __init__(self, args, rank, dist_print):
        super().__init__(args, rank, dist_print)
        self.args, self.calls = args, 0

    def forward(self, input):
        layer = self._moe_layer
        self.setting = schedule(self.calls, layer.valid_rs, self.args)
        self.calls += 1
        factor, r, overlap, top_k = self.setting
        result = layer(input, capacity_factor=factor, adaptive_r=r, a2a_ffn_overlap_degree=overlap,
                       top_k=min(top_k, layer.num_global_experts))
        return F.log_softmax(torch.sum(result, dim=2), dim=1)


def main(argv=None):
    args = parse_args(argv)
    parallel_env, dist_print, world_size, device, dtype = _common.start(args)
    model = SwitchingModel(args, parallel_env.global_rank, dist_print).to(device=device, dtype=dtype)
    dist_print(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    x, y = _common.synthetic_inputs(args.batch_size, args.num_tokens, args.model_dim, dtype, device)
    layer = model._moe_layer
    step = _common.training_step(model, optimizer, x, y, layer, l_aux_wt=args.l_aux_wt, eval_mode=args.eval,
                                 shared=[] if args.allreduce_degree == -1 else _common.shared_parameters(model),
                                 world_size=world_size)

    def suffix():
        factor, r, overlap, top_k = model.setting
        return " (f = %.1f, r = %d, o = %d)" % (factor, r, overlap) + (" (k = %d)" % top_k if args.switch_top_k else "")

    printer = _common.tflops_printer(dist_print, args, layer.num_global_experts, args.eval,
                                     top=lambda: model.setting[3], suffix=suffix)
    times = _common.train_steps(args.num_steps, step, _common.make_record_time(args.device), printer)
    dist_print(times.summary_line())


if __name__ == "__main__":
    main()

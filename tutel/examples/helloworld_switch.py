"""helloworld switching parallelism, overlap degree, top-k and capacity from step to step.

    python3 -m tutel.examples.helloworld_switch --batch_size=16 [--device cpu]
    python3 -m torch.distributed.run --nproc_per_node=4 -m tutel.examples.helloworld_switch --device cpu

Forward call n runs with adaptive_r = valid_rs[((n-1) // 8) % len(valid_rs)] and
a2a_ffn_overlap_degree = (n-1) % 8 + 1 (Tutel's schedule); with --switch_top_k and
--switch_capacity it also cycles top_k over 1..--top and the capacity factor over
(--cap_factor, 0 = dropless, -cap_factor).  The parameters never change layout: every
switch is free.
"""
import argparse

import torch
import torch.nn.functional as F

from tutel import moe as tutel_moe
from tutel.examples import _common


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_flags(parser)
    parser.add_argument("--fp32_gate", default=False, action="store_true")
    parser.add_argument("--allreduce_degree", type=int, default=1)
    parser.add_argument("--checkpoint_path", type=str, default="")
    parser.add_argument("--use_2dh", default=False, action="store_true")
    parser.add_argument("--eval", default=False, action="store_true")
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


def main(argv=None):
    args = parse_args(argv)
    parallel_env = _common.init_parallel(args.device)
    dist_print, world_size, device = parallel_env.dist_print, parallel_env.global_size, parallel_env.local_device
    dtype = _common.DTYPES[args.dtype]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0
            self._moe_layer = tutel_moe.moe_layer(
                gate_type={"type": "top", "k": args.top, "fp32_gate": args.fp32_gate},
                experts={"type": "ffn", "num_experts_per_device": args.num_local_experts,
                         "hidden_size_per_expert": args.hidden_size, "activation_fn": lambda x: F.relu(x)},
                model_dim=args.model_dim,
                scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
                seeds=(1, parallel_env.global_rank + 1, 1),
                a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
                use_2dh=args.use_2dh,
            )

        def forward(self, input):
            self.setting = schedule(self.calls, self._moe_layer.valid_rs, args)
            self.calls += 1
            factor, r, overlap, top_k = self.setting
            result = self._moe_layer(input, capacity_factor=factor, adaptive_r=r, a2a_ffn_overlap_degree=overlap,
                                     top_k=min(top_k, self._moe_layer.num_global_experts))
            return F.log_softmax(torch.sum(result, dim=2), dim=1)

    model = Model().to(device=device, dtype=dtype)
    dist_print(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    x, y = _common.synthetic_inputs(args.batch_size, args.num_tokens, args.model_dim, dtype, device)
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
        factor, r, overlap, top_k = model.setting
        tflops = _common.flops_tflops(args.batch_size, args.num_tokens, args.model_dim, args.hidden_size, top_k,
                                      num_global_experts, seconds, args.eval)
        dist_print("STEP-%s: loss = %.5f, step_time = %.6f sec, perf = %.2f tflops. (f = %.1f, r = %d, o = %d)"
                   % (i, loss, seconds, tflops, factor, r, overlap)
                   + (" (k = %d)" % top_k if args.switch_top_k else ""))

    times = _common.train_steps(args.num_steps, step, _common.make_record_time(args.device), print_step)
    dist_print(times.summary_line())


if __name__ == "__main__":
    main()

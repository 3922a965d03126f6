"""helloworld under automatic mixed precision (autocast: float16 on CUDA, bfloat16 on CPU).

    python3 -m tutel.examples.helloworld_amp --batch_size=16 [--device cpu]
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
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    parallel_env = _common.init_parallel(args.device)
    dist_print, world_size, device = parallel_env.dist_print, parallel_env.global_size, parallel_env.local_device
    autocast_dtype = torch.float16 if args.device == "cuda" else torch.bfloat16

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self._moe_layer = tutel_moe.moe_layer(
                gate_type={"type": "top", "k": args.top, "fp32_gate": args.fp32_gate},
                experts={"type": "ffn", "num_experts_per_device": args.num_local_experts,
                         "hidden_size_per_expert": args.hidden_size, "activation_fn": lambda x: F.relu(x)},
                model_dim=args.model_dim,
                scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
                seeds=(1, parallel_env.global_rank + 1, 1),
                a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
            )

        def forward(self, input):
            with torch.autocast(device_type=args.device, dtype=autocast_dtype):
                result = self._moe_layer(input)
            return F.log_softmax(torch.sum(result.float(), dim=2), dim=1)

    model = Model().to(device)
    dist_print(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    x, y = _common.synthetic_inputs(args.batch_size, args.num_tokens, args.model_dim,
                                    _common.DTYPES[args.dtype], device)
    dist_print("[Benchmark] world_size = %s, dtype = %s, model_dim = %s, hidden_size = %s, samples = %s, "
               "num_local_experts = %s, topK = %s, a2a_ffn_overlap_degree = %s, device = `%s`, autocast = %s"
               % (world_size, args.dtype, args.model_dim, args.hidden_size, args.batch_size * args.num_tokens,
                  args.num_local_experts, args.top, args.a2a_ffn_overlap_degree, device, autocast_dtype))
    shared = _common.shared_parameters(model)

    def step(_):
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)
        if args.l_aux_wt:
            loss = loss + args.l_aux_wt * model._moe_layer.l_aux
        loss.backward()
        _common.average_gradients(shared, world_size)
        optimizer.step()
        return loss

    num_global_experts = model._moe_layer.num_global_experts

    def print_step(i, loss, seconds):
        tflops = _common.flops_tflops(args.batch_size, args.num_tokens, args.model_dim, args.hidden_size, args.top,
                                      num_global_experts, seconds, False)
        dist_print("STEP-%s: loss = %.5f, step_time = %.6f sec, perf = %.2f tflops." % (i, loss, seconds, tflops))

    times = _common.train_steps(args.num_steps, step, _common.make_record_time(args.device), print_step)
    dist_print(times.summary_line())


if __name__ == "__main__":
    main()

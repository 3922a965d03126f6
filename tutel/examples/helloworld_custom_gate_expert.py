"""An MoE layer with a user-defined gate and user-defined experts.

    python3 -m tutel.examples.helloworld_custom_gate_expert --batch_size=16 [--device cpu]

Shows the two extension points: gate_type={'type': 'custom', 'module': GateClass, ...} and
experts={'type': 'custom', 'module': ExpertClass, ...}.  Every option a custom module receives is
logged as a warning, so you can see what the layer passes in.
"""
import logging

import torch
import torch.nn.functional as F

from tutel import moe as tutel_moe
from tutel.examples import _common

logger = logging.getLogger("tutel.examples")


class CustomGate(torch.nn.Module):
    """A linear gate; receives model_dim, num_global_experts and the gate dict's other keys."""

    def __init__(self, model_dim, num_global_experts, top_k=1, **options):
        super().__init__()
        for key, value in dict(model_dim=model_dim, num_global_experts=num_global_experts, top_k=top_k,
                               **options).items():
            logger.warning("CustomGate received option %s = %s", key, value)
        self.top_k = top_k
        self.wg = torch.nn.Linear(model_dim, num_global_experts, bias=False)

    def forward(self, x):
        return self.wg(x)


class CustomExpert(torch.nn.Module):
    """One weight matrix per local expert followed by an activation; receives model_dim,
    num_experts_per_device, sharded_count and the experts dict's other keys."""

    def __init__(self, model_dim, num_experts_per_device, sharded_count, my_activ_type="relu", **options):
        super().__init__()
        for key, value in dict(model_dim=model_dim, num_experts_per_device=num_experts_per_device,
                               sharded_count=sharded_count, my_activ_type=my_activ_type, **options).items():
            logger.warning("CustomExpert received option %s = %s", key, value)
        if sharded_count > 1:
            raise ValueError("CustomExpert keeps whole experts on each process: it does not support "
                             "sharded_count > 1 (use at least as many experts as processes)")
        self.W = torch.nn.Parameter(torch.empty(num_experts_per_device, model_dim, model_dim))
        torch.nn.init.normal_(self.W, 0, model_dim ** -0.5)
        activations = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}
        if my_activ_type not in activations:
            raise ValueError(f"my_activ_type must be one of {sorted(activations)}, got {my_activ_type!r}")
        self.activation = activations[my_activ_type]

    def forward(self, x, ctx):
        return self.activation(torch.matmul(x, self.W))


def parse_args(argv=None):
    return _common.parser_for(__doc__, "eval", hidden_size=False).parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    parallel_env, dist_print, world_size, device, dtype = _common.start(args)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self._moe_layer = tutel_moe.moe_layer(
                gate_type={"type": "custom", "module": CustomGate, "top_k": args.top},
                experts={"type": "custom", "module": CustomExpert, "num_experts_per_device": args.num_local_experts,
                         "my_activ_type": "relu"},
                model_dim=args.model_dim,
                scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
                seeds=(1, parallel_env.global_rank + 1, 1),
                a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
            )

        def forward(self, input):
            return F.log_softmax(torch.sum(self._moe_layer(input), dim=2), dim=1)

    model = Model().to(device=device, dtype=dtype)
    dist_print(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    x, y = _common.synthetic_inputs(args.batch_size, args.num_tokens, args.model_dim, dtype,
                                    device)
    step = _common.training_step(model, optimizer, x, y, model._moe_layer, l_aux_wt=args.l_aux_wt,
                                 eval_mode=args.eval, shared=_common.shared_parameters(model), world_size=world_size)
    times = _common.train_steps(
        args.num_steps, step, _common.make_record_time(args.device),
        lambda i, loss, seconds: dist_print("STEP-%s: loss = %.5f, step_time = %.6f sec." % (i, loss, seconds)))
    dist_print(times.summary_line())


if __name__ == "__main__":
    main()

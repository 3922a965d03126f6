"""An MoE layer assembled by hand from the low-level routing API.

    python3 -m tutel.examples.helloworld_from_scratch [--device cpu] [--num_samples N --model_dim M]

gate -> softmax -> moe.top_k_routing -> moe.fast_encode -> net.all_to_all -> experts ->
net.all_to_all -> moe.fast_decode: the same steps moe_layer runs, written out.
"""
import argparse

import torch
import torch.nn.functional as F

from tutel import moe, net
from tutel.examples import _common


class CustomGate(torch.nn.Module):
    def __init__(self, model_dim, num_global_experts):
        super().__init__()
        torch.manual_seed(1)
        self.wg = torch.nn.Linear(model_dim, num_global_experts, bias=False)

    def forward(self, x):
        return self.wg(x)


class CustomExpert(torch.nn.Module):
    def __init__(self, model_dim, local_experts, rank):
        super().__init__()
        torch.manual_seed(rank + 1)
        self.W = torch.nn.Parameter(torch.empty(local_experts, model_dim, model_dim))
        torch.nn.init.normal_(self.W, 0, model_dim ** -0.5)

    def forward(self, x):
        return torch.matmul(x, self.W)


class CustomMoE(torch.nn.Module):
    def __init__(self, model_dim, local_experts, rank, world_size):
        super().__init__()
        self.gate = CustomGate(model_dim, local_experts * world_size)
        self.expert = CustomExpert(model_dim, local_experts, rank)
        for param in self.expert.parameters():
            param.skip_allreduce = True

    def forward(self, x, k=2):
        scores = F.softmax(self.gate(x), dim=1)
        crit, l_aux = moe.top_k_routing(scores, top_k=k)
        y = moe.fast_encode(x, crit)                   # [E, C, M]
        y = net.all_to_all(y, 1, 0)                    # [E / W, W * C, M]: the experts' own tokens
        y = self.expert(y)
        y = net.all_to_all(y, 0, 1)                    # back to [E, C, M]
        output = moe.fast_decode(y, crit)
        return output, l_aux


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=str, default=_common.default_device(), choices=["cpu", "cuda"])
    parser.add_argument("--num_samples", type=int, default=16384)
    parser.add_argument("--model_dim", type=int, default=2048)
    parser.add_argument("--num_local_experts", type=int, default=2)
    parser.add_argument("--num_steps", type=int, default=10)
    args = parser.parse_args(argv)

    parallel_env = _common.init_parallel(args.device)
    device = parallel_env.local_device
    model = CustomMoE(args.model_dim, args.num_local_experts, parallel_env.global_rank,
                      parallel_env.global_size).to(device)
    torch.manual_seed(0)
    x = torch.randn(args.num_samples, args.model_dim, device=device)
    y = torch.zeros(args.num_samples, dtype=torch.long, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    shared = _common.shared_parameters(model)

    def step(_):
        optimizer.zero_grad()
        output, l_aux = model(x)
        loss = F.nll_loss(F.log_softmax(output, dim=1), y) + 1e-4 * l_aux
        loss.backward()
        _common.average_gradients(shared, parallel_env.global_size)
        optimizer.step()
        return loss

    _common.train_steps(args.num_steps, step, _common.make_record_time(args.device),
                        lambda i, loss, seconds: parallel_env.dist_print(
                            "STEP-%d: loss = %.5f, step_time = %.3f s" % (i, loss, seconds)))


if __name__ == "__main__":
    main()

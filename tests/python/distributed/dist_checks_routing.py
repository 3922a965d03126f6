"""Scored routing across real processes against the float64 reference of reference_scored.py.

* Expert parallel: each rank routes its own tokens with sigmoid scores, a selection bias, group
  limiting, scaling, the global-batch loss (choices counted over every rank), the z-loss and a
  gated shared expert; outputs, l_aux and every gradient equal the reference run on the global
  weights (expert gradients summed over the ranks).
* Aux-loss-free balancing: after several steps on different tokens per rank (the layer inside
  DistributedDataParallel), the bias is identical on every rank and equals the single-process
  update computed from all ranks' tokens.
* Processes that built the layer with different routing options or shared experts are named.
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/python: the float64 references

import reference_moe  # noqa: E402
import reference_scored as ref  # noqa: E402
from dist_checks import CheckList, close, expect_error, rank, world  # noqa: E402
from dist_checks_layer import MODEL_DIM, HIDDEN, global_ffn, local_slice  # noqa: E402
from dist_harness import init_gloo  # noqa: E402
from tutel import moe, net  # noqa: E402

checks = CheckList()
GROUPS, TOPK_GROUPS = 3, 2


def make_layer(k, experts_per_rank, **gate_options):
    gate = dict({"type": "top", "k": k, "score_function": "sigmoid", "selection_bias": True, "n_group": GROUPS,
                 "topk_group": TOPK_GROUPS, "routed_scaling_factor": 1.5, "balance_loss": "global_batch",
                 "z_loss_weight": 0.01}, **gate_options)
    experts = {"type": "ffn", "num_experts_per_device": experts_per_rank, "hidden_size_per_expert": HIDDEN,
               "shared_experts": {"hidden_size": 4, "gated": True}}
    layer = moe.moe_layer(gate_type=gate, model_dim=MODEL_DIM, experts=experts, seeds=(1, rank() + 1, 1)).double()
    torch.manual_seed(77)  # the same bias on every rank
    with torch.no_grad():
        layer.gates[0].selection_bias.bias.normal_(0, 0.3)
    return layer


def gathered_ids(ids):
    table = net.simple_all_gather(torch.tensor(ids, dtype=torch.int64).unsqueeze(0))
    return [row for part in table.tolist() for row in part]


def compare(layer, tokens, k, capacity_factor, adaptive_r):
    torch.manual_seed(1000 + rank())
    x = torch.randn(tokens, MODEL_DIM, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(tokens, MODEL_DIM, dtype=torch.float64)
    layer.zero_grad(set_to_none=True)
    y = layer(x, capacity_factor=capacity_factor, adaptive_r=adaptive_r)
    ((y * upstream).sum() + 0.3 * y.l_aux).backward()

    params = global_ffn(layer)
    gate64 = layer.gates[0].wg.weight.detach().clone().requires_grad_()
    shared = layer.shared_experts
    shared64 = [m.weight.detach().clone().requires_grad_() for m in (shared.gate_proj, shared.up_proj,
                                                                    shared.down_proj, shared.gate)]
    x64 = x.detach().clone().requires_grad_()
    route = dict(score_function="sigmoid", bias=layer.gates[0].selection_bias.bias.detach(), n_group=GROUPS,
                 topk_group=TOPK_GROUPS, renormalize=k > 1, scale=1.5)
    out64, l_aux64, _, _ = ref.scored_moe(
        x64, x64 @ gate64.t(), lambda e, h: reference_moe.ffn_expert(params, e, h, torch.relu), k, capacity_factor,
        route, loss="global_batch", z_loss_weight=0.01, all_ids=gathered_ids,
        agree_capacity=lambda c: net.all_reduce_max_int(c, torch.device("cpu")))
    out64 = out64 + torch.stack([ref.shared_swiglu(h, *shared64) for h in x64])
    ((out64 * upstream).sum() + 0.3 * l_aux64).backward()

    close(y, out64.detach(), "output", 1e-10)
    close(y.l_aux, l_aux64.detach(), "l_aux", 1e-10)
    close(x.grad, x64.grad, "input gradient", 1e-10)
    close(layer.gates[0].wg.weight.grad, gate64.grad, "gate gradient", 1e-10)
    for module, copy in zip((shared.gate_proj, shared.up_proj, shared.down_proj, shared.gate), shared64):
        close(module.weight.grad, copy.grad, "shared expert gradient", 1e-10)
    for name, copy in zip(["batched_fc1_w", "batched_fc1_bias", "batched_fc2_w", "batched_fc2_bias"], params):
        total = net.simple_all_reduce(copy.grad if copy.grad is not None else torch.zeros_like(copy))
        close(getattr(layer.experts, name).grad, local_slice(layer, name, total), name, 1e-10)


@checks.add
def expert_parallel_scored_routing_equals_reference():
    layer = make_layer(3, GROUPS)  # 3 experts per rank: the experts always split into GROUPS groups
    for capacity_factor in (1.0, 0.0, 0.5):
        for adaptive_r in (0, 1):
            compare(layer, 23, 3, capacity_factor, adaptive_r)


@checks.add
def expert_parallel_clamped_swiglu_experts_equal_reference():
    """gpt-oss style: router bias, softmax over the chosen logits, clamped SwiGLU experts (whole
    experts per rank, also gathered everywhere with adaptive_r = 0)."""
    names = ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"]
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2, "router_bias": True, "softmax_after_topk": True},
                          model_dim=MODEL_DIM, seeds=(1, rank() + 1, 1),
                          experts={"type": "clamped_swiglu", "num_experts_per_device": 2, "hidden_size_per_expert": 3,
                                   "limit": 0.5}).double()
    for capacity_factor, adaptive_r in ((1.0, 1), (0.0, 0), (0.5, 0)):
        torch.manual_seed(2000 + rank())
        x = torch.randn(13, MODEL_DIM, dtype=torch.float64, requires_grad=True)
        upstream = torch.randn(13, MODEL_DIM, dtype=torch.float64)
        layer.zero_grad(set_to_none=True)
        y = layer(x, capacity_factor=capacity_factor, adaptive_r=adaptive_r)
        ((y * upstream).sum() + 0.3 * y.l_aux).backward()

        params = [net.simple_all_gather(getattr(layer.experts, n).detach().contiguous()).requires_grad_()
                  for n in names]
        wg, bg = (p.detach().clone().requires_grad_() for p in (layer.gates[0].wg.weight, layer.gates[0].wg.bias))
        x64 = x.detach().clone().requires_grad_()

        def expert_fn(e, h):
            return ref.clamped_swiglu(h, *(p[e] for p in params), limit=0.5)
        out64, l_aux64, _, _ = ref.scored_moe(
            x64, x64 @ wg.t() + bg, expert_fn, 2, capacity_factor, dict(softmax_after_topk=True, renormalize=True),
            agree_capacity=lambda c: net.all_reduce_max_int(c, torch.device("cpu")))
        ((out64 * upstream).sum() + 0.3 * l_aux64).backward()
        close(y, out64.detach(), "output", 1e-10)
        close(y.l_aux, l_aux64.detach(), "l_aux", 1e-10)
        close(x.grad, x64.grad, "input gradient", 1e-10)
        close(layer.gates[0].wg.weight.grad, wg.grad, "gate gradient", 1e-10)
        close(layer.gates[0].wg.bias.grad, bg.grad, "router bias gradient", 1e-10)
        for name, copy in zip(names, params):
            total = net.simple_all_reduce(copy.grad if copy.grad is not None else torch.zeros_like(copy))
            close(getattr(layer.experts, name).grad, total[rank() * 2:(rank() + 1) * 2], name, 1e-10)


@checks.add
def selection_bias_identical_on_every_rank_and_equal_to_one_process():
    rate, k = 0.02, 2
    layer = make_layer(k, 3, bias_update_rate=rate, balance_loss="none", z_loss_weight=0.0)
    # DistributedDataParallel (for the replicated parameters) broadcasts rank 0's buffers before every
    # forward: each rank's counts must survive it
    layer._ddp_params_and_buffers_to_ignore = [name for name, p in layer.named_parameters()
                                               if getattr(p, "_tutel_expert", False)]
    model = torch.nn.parallel.DistributedDataParallel(layer)
    experts = layer.num_global_experts
    expected = layer.gates[0].selection_bias.bias.tolist()
    weight = layer.gates[0].wg.weight.detach()
    sizes = [7 + 4 * r for r in range(world())]  # ranks see different numbers of different tokens
    for step in range(4):
        loads = [0] * experts
        for micro in range(2):  # gradient accumulation: both micro-batches count
            torch.manual_seed(100 * step + 10 * micro + rank())
            x = torch.randn(sizes[rank()], MODEL_DIM, dtype=torch.float64) + rank()
            model(x).sum().backward()
            padded = torch.zeros(max(sizes), MODEL_DIM, dtype=torch.float64)
            padded[:x.shape[0]] = x
            table = net.simple_all_gather(padded.unsqueeze(0))
            for logits in torch.cat([table[r, :sizes[r]] for r in range(world())]) @ weight.t():
                for e in ref.route_token(logits, k, score_function="sigmoid", bias=expected, n_group=GROUPS,
                                         topk_group=TOPK_GROUPS)[0]:
                    loads[e] += 1
        assert moe.update_selection_biases(model) == 1
        expected = ref.bias_step(expected, loads, rate)
        bias = layer.gates[0].selection_bias.bias
        close(bias, torch.tensor(expected, dtype=bias.dtype), "bias after the update", 1e-12)
        everyone = net.simple_all_gather(bias.unsqueeze(0))
        assert all(torch.equal(row, everyone[0]) for row in everyone), f"biases differ: {everyone}"


@checks.add
def processes_with_different_routing_options_are_named():
    score_function = "sigmoid" if rank() == 0 else "sqrt_softplus"
    expect_error(ValueError, ["gates[0] scored-routing options"], make_layer, 2, 3, score_function=score_function)
    gated = rank() == 0
    expect_error(ValueError, ["shared expert parameter count"], moe.moe_layer, gate_type={"type": "top", "k": 1},
                 model_dim=MODEL_DIM, experts={"type": "ffn", "num_experts_per_device": 1, "hidden_size_per_expert": 4,
                                               "shared_experts": {"hidden_size": 4, "gated": gated}})


def run_all():
    init_gloo()
    import dist_checks
    dist_checks.run([checks])

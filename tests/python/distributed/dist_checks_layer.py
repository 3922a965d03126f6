"""The MoE layer across real processes against the token-by-token float64 reference.

Every rank builds the same layer (expert weights differ per rank, as in training), routes its
own random tokens, and compares its output, l_aux and every gradient with the reference run on
the global weights (assembled from all ranks' shards):

* outputs, l_aux, input and gate gradients: the reference on this rank's tokens;
* expert gradients: the reference gradients summed over all ranks (every rank's loss reaches
  every expert), sliced to this rank's shard.
"""
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/python: the float64 references

import reference_moe  # noqa: E402
from dist_checks import CheckList, close, expect_error, rank, world  # noqa: E402
from dist_harness import init_gloo  # noqa: E402
from tutel import moe, net  # noqa: E402

checks = CheckList()
MODEL_DIM, HIDDEN = 6, 8


def make_layer(experts_per_rank, k, capacity_factor=1.0, expert_type="ffn", output_dim=None, **layer_kwargs):
    experts = {"type": expert_type, "num_experts_per_device": experts_per_rank, "hidden_size_per_expert": HIDDEN}
    if output_dim is not None:
        experts["output_dim"] = output_dim
    layer = moe.moe_layer(gate_type={"type": "top", "k": k, "capacity_factor": capacity_factor},
                          model_dim=MODEL_DIM, experts=experts, seeds=(1, rank() + 1, 1), **layer_kwargs)
    return layer.double()


def _gathered(param):
    return net.simple_all_gather(param.detach().double().contiguous())


def global_ffn(layer):
    """Float64 leaf copies of the global ffn weights [E, H, M], [E, H], [E, H, O], [E, O]."""
    e, out = layer.num_global_experts, layer.experts.output_dim
    ex = layer.experts
    w1 = _gathered(ex.batched_fc1_w).reshape(e, -1, MODEL_DIM)
    b1 = _gathered(ex.batched_fc1_bias).reshape(e, -1)
    w2 = _gathered(ex.batched_fc2_w).reshape(e, -1, out)
    b2 = _gathered(ex.batched_fc2_bias).reshape(e, -1)[:, :out]
    return [t.clone().requires_grad_() for t in (w1, b1, w2, b2)]


def local_slice(layer, name, global_grad):
    """This rank's shard of a global expert gradient."""
    s, local = layer.sharded_count, getattr(layer.experts, name)
    if s == 1:
        n = local.shape[0]
        return global_grad[rank() * n:(rank() + 1) * n]
    expert, piece = rank() // s, rank() % s
    if name == "batched_fc2_bias":
        width = local.shape[-1]
        padded = global_grad.new_zeros(global_grad.shape[0], width * s)
        padded[:, :global_grad.shape[1]] = global_grad
        return padded[expert, piece * width:(piece + 1) * width].unsqueeze(0)
    rows = local.shape[1]
    return global_grad[expert, piece * rows:(piece + 1) * rows].unsqueeze(0)


def compare(layer, tokens, top_k, capacity_factor, forward_kwargs=None, tol=1e-10, normalize_gate=True,
            is_postscore=True):
    """Forward/backward on this rank's tokens; checks against the reference (see module doc).

    normalize_gate / is_postscore: the options the check built the layer with (moe_layer's
    defaults unless given), passed to the reference by the check, never read from the layer."""
    forward_kwargs = forward_kwargs or {}
    torch.manual_seed(1000 + rank())
    x = torch.randn(tokens, MODEL_DIM, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(tokens, layer.experts.output_dim, dtype=torch.float64)
    layer.zero_grad(set_to_none=True)
    y = layer(x, **forward_kwargs)
    ((y * upstream).sum() + 0.3 * y.l_aux).backward()

    params = global_ffn(layer)
    gate64 = layer.gates[0].wg.weight.detach().clone().requires_grad_()
    x64 = x.detach().clone().requires_grad_()
    overlap = forward_kwargs.get("a2a_ffn_overlap_degree", layer.a2a_ffn_overlap_degree)
    out64, l_aux64, _, _ = reference_moe.moe_forward(
        x64, x64 @ gate64.t(), lambda e, h: reference_moe.ffn_expert(params, e, h, torch.relu), top_k,
        capacity_factor, normalize_gate=normalize_gate, is_postscore=is_postscore,
        alignment=layer.sharded_count * overlap,
        agree_capacity=lambda c: net.all_reduce_max_int(c, torch.device("cpu")))
    ((out64 * upstream).sum() + 0.3 * l_aux64).backward()

    close(y, out64.detach(), "output", tol)
    close(y.l_aux, l_aux64.detach(), "l_aux", tol)
    close(x.grad, x64.grad, "input gradient", tol)
    close(layer.gates[0].wg.weight.grad, gate64.grad, "gate gradient", tol)
    names = ["batched_fc1_w", "batched_fc1_bias", "batched_fc2_w", "batched_fc2_bias"]
    for name, ref in zip(names, params):
        total = net.simple_all_reduce(ref.grad if ref.grad is not None else torch.zeros_like(ref))
        close(getattr(layer.experts, name).grad, local_slice(layer, name, total), name, tol)


@checks.add
def expert_parallel_every_capacity_mode_overlap_and_r():
    layer = make_layer(2, 2)
    for capacity_factor in (1.0, 0.5, 0.0, -0.6):
        for overlap in (1, 2, 4):
            for r in (0, 1):
                # 47 tokens: even at capacity factor 0.5 on 4 processes every expert has >= 4 slots
                compare(layer, 47, 2, capacity_factor,
                        dict(capacity_factor=capacity_factor, a2a_ffn_overlap_degree=overlap, adaptive_r=r))


@checks.add
def expert_parallel_top1_and_output_dim():
    layer = make_layer(1, 1, output_dim=5)
    for r in (0, 1):
        compare(layer, 19, 1, 1.0, dict(adaptive_r=r))


@checks.add
def sharded_experts_every_valid_r():
    for share in [s for s in (2, 4) if s <= world() and world() % s == 0]:
        k = min(2, world() // share)  # at most the number of global experts
        layer = make_layer(-share, k, capacity_factor=0.75)
        assert layer.sharded_count == share and layer.valid_rs == [0] + [r for r in range(1, share + 1) if share % r == 0]
        for r in layer.valid_rs:
            for overlap in (1, 2):
                compare(layer, 17, k, 0.75, dict(adaptive_r=r, a2a_ffn_overlap_degree=overlap))


@checks.add
def parallel_types_pick_the_default_r():
    if world() < 2:
        return
    data = make_layer(-2, 1, parallel_type="data")
    model = make_layer(-2, 1, parallel_type="model")
    assert data.adaptive_degree == 1 and model.adaptive_degree == 2
    compare(model, 12, 1, 1.0)


@checks.add
def different_token_counts_per_rank():
    layer = make_layer(2, 2)
    for capacity_factor in (1.0, 0.0):
        for inequivalent in (False, True):
            compare(layer, 11 + 9 * rank(), 2, capacity_factor,
                    dict(capacity_factor=capacity_factor, inequivalent_tokens=inequivalent))


@checks.add
def prescore_and_unnormalized_gates():
    for is_postscore, normalize_gate in ((False, True), (True, False), (False, False)):
        layer = make_layer(2, 2, capacity_factor=0.75, is_postscore=is_postscore, normalize_gate=normalize_gate)
        compare(layer, 23, 2, 0.75, is_postscore=is_postscore, normalize_gate=normalize_gate)


@checks.add
def two_level_all_to_all_equals_flat():
    layer = make_layer(1, 2, use_2dh=True)
    compare(layer, 21, 2, 1.0)
    compare(layer, 21, 2, 1.0, dict(a2a_ffn_overlap_degree=2))


def global_llama(layer):
    e = layer.num_global_experts
    shapes = {name: layer.experts.full_shapes[name][1:] for name in ("W_fc1", "W_fc2", "W_fc3")}
    weights = []
    for name in ("W_fc1", "W_fc2", "W_fc3"):
        numel = shapes[name][0] * shapes[name][1]
        flat = _gathered(getattr(layer.experts, name)).reshape(e, -1)[:, :numel * (layer.experts.local_experts
                                                                                     if layer.sharded_count == 1 else 1)]
        weights.append(flat.reshape(e * 1, -1)[:, :].reshape(-1)[:e * numel].reshape(e, *shapes[name]))
    return weights


@checks.add
def llama_ffn_experts_match_every_r():
    for share in [s for s in (1, 2) if world() % s == 0]:
        layer = make_layer(1 if share == 1 else -share, 1, expert_type="llama_ffn")
        for r in layer.valid_rs:
            torch.manual_seed(7 + rank())
            x = torch.randn(13, MODEL_DIM, dtype=torch.float64)
            y = layer(x, adaptive_r=r)
            w1, w2, w3 = global_llama(layer)
            expected, _, _, _ = reference_moe.moe_forward(
                x, x @ layer.gates[0].wg.weight.detach().t(),
                lambda e, h: (F.silu(h @ w1[e]) * (h @ w2[e])) @ w3[e], 1, 1.0, alignment=layer.sharded_count,
                agree_capacity=lambda c: net.all_reduce_max_int(c, torch.device("cpu")))
            close(y.detach(), expected, f"llama_ffn output (S={share}, r={r})")


@checks.add
def bad_configurations_fail_clearly():
    if world() == 4:
        expect_error(ValueError, ["num_experts_per_device=-3", "multiple of 3"], make_layer, -3, 1)
    layer = make_layer(1, 1)
    expect_error(ValueError, ["adaptive_r=2", "allowed: [0, 1]"], layer, torch.randn(4, MODEL_DIM, dtype=torch.float64),
                 adaptive_r=2)
    # processes that disagree on the overlap degree get an error instead of a crashed exchange
    expect_error(ValueError, ["disagree on a2a_ffn_overlap_degree"], layer,
                 torch.randn(8, MODEL_DIM, dtype=torch.float64), a2a_ffn_overlap_degree=1 + rank() % 2)


@checks.add
def layer_on_a_subgroup_with_sharded_experts():
    """Two independent MoE groups of 2 processes each (Tutel could not split subgroups, issue #292)."""
    if world() != 4:
        return
    subgroup = net.create_groups_from_world(group_count=2).model_group  # ranks {0,1} and {2,3}
    layer = moe.moe_layer(gate_type={"type": "top", "k": 1, "capacity_factor": 1.0}, model_dim=MODEL_DIM,
                          experts={"type": "ffn", "num_experts_per_device": -2, "hidden_size_per_expert": HIDDEN},
                          seeds=(1, rank() + 1, 1), group=subgroup).double()
    assert layer.sharded_count == 2 and layer.world_size == 2
    outputs = {}
    for r in layer.valid_rs:
        torch.manual_seed(50 + rank())
        outputs[r] = layer(torch.randn(10, MODEL_DIM, dtype=torch.float64), adaptive_r=r).detach()
    for r in layer.valid_rs:
        close(outputs[r], outputs[1], f"subgroup output with adaptive_r={r}")


@checks.add
def mismatched_layers_are_named_at_construction():
    expect_error(ValueError, ["built different layers", "model_dim"], moe.moe_layer,
                 gate_type={"type": "top", "k": 1}, model_dim=4 + 2 * (rank() % 2),
                 experts={"type": "ffn", "num_experts_per_device": 1, "hidden_size_per_expert": 4})


def run_all():
    init_gloo()
    import dist_checks
    dist_checks.run([checks])

"""Runs an MoE layer and the token-by-token float64 reference on the same inputs and compares
outputs, l_aux and every gradient."""
import torch

import reference_moe


def float64_copy(param):
    return None if param is None else param.detach().double().clone().requires_grad_()


def linear_gate_reference(gate):
    """Reference logits of the 'top' gate: (logits_fn, [(layer param, float64 copy)])."""
    wg64 = float64_copy(gate.wg.weight)
    return (lambda x64: x64 @ wg64.t()), [(gate.wg.weight, wg64)]


def ffn_expert_reference(experts, activation=torch.relu):
    """Reference of the 'ffn' experts: (expert_fn(e, h), [(layer param, float64 copy)])."""
    names = ["batched_fc1_w", "batched_fc1_bias", "batched_fc2_w", "batched_fc2_bias"]
    pairs = [(getattr(experts, n), float64_copy(getattr(experts, n))) for n in names]
    params = [copy for _, copy in pairs]
    output_dim = experts.output_dim
    if params[3] is not None:
        params[3] = params[3][:, :output_dim]
    return (lambda e, h: reference_moe.ffn_expert(params, e, h, activation)), pairs


def run_and_compare(layer, x, *, forward_kwargs=None, top_k, capacity_factor, alignment=1, activation=torch.relu,
                    tol=None, use_layer_logits=False, l_aux_weight=0.3, gate_reference=None,
                    expert_reference=None, normalize_gate=True, is_postscore=True, batch_prioritized=False,
                    no_grad=False):
    """Forward + backward through `layer` and through the reference; asserts they agree.
    With `no_grad` the layer runs under torch.no_grad() (inference) and only the output and
    l_aux are compared.

    normalize_gate / is_postscore / batch_prioritized are the options the test built the layer
    with (moe_layer's defaults unless given): the reference takes them from the test, never from
    the layer's attributes, so a constructor that dropped one of them fails here.

    gate_reference(gate) / expert_reference(experts) build the float64 reference pieces (default:
    the linear 'top' gate and 'ffn' experts).  With use_layer_logits the reference routes with the
    layer's own logits (for low-precision layers whose near-ties may break differently).
    Returns the reference capacity and the [T, k] kept mask."""
    forward_kwargs = forward_kwargs or {}
    tol = tol or dict(rtol=1e-10, atol=1e-10)
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(not no_grad)
    gate = layer.gates[forward_kwargs.get("gate_index", 0)]
    captured = {}
    hook = gate.register_forward_hook(lambda module, inputs, output: captured.__setitem__("logits", output))
    try:
        with torch.set_grad_enabled(not no_grad):
            y = layer(x, **forward_kwargs)
    finally:
        hook.remove()
    upstream = torch.randn(y.shape, dtype=torch.float64)
    if not no_grad:
        ((y.double() * upstream).sum() + l_aux_weight * y.l_aux.double()).backward()

    model_dim = layer.model_dim
    x64 = x.detach().double().reshape(-1, model_dim).requires_grad_()
    logits_fn, gate_pairs = (gate_reference or linear_gate_reference)(gate)
    expert_fn, expert_pairs = (expert_reference or (lambda m: ffn_expert_reference(m, activation)))(layer.experts)
    route_with = captured["logits"].detach() if use_layer_logits else None
    out64, l_aux64, capacity, kept = reference_moe.moe_forward(
        x64, logits_fn(x64), expert_fn, top_k, capacity_factor,
        normalize_gate=normalize_gate, is_postscore=is_postscore,
        batch_prioritized=batch_prioritized, alignment=alignment, route_with=route_with)
    out64 = out64.reshape(y.shape)
    ((out64 * upstream).sum() + l_aux_weight * l_aux64).backward()

    torch.testing.assert_close(y.double(), out64.detach(), **tol)
    torch.testing.assert_close(y.l_aux.double(), l_aux64.detach(), **tol)
    if no_grad:
        assert not y.requires_grad
        return capacity, kept
    torch.testing.assert_close(x.grad.double().reshape(-1, model_dim), x64.grad, **tol)
    for param, ref in gate_pairs + expert_pairs:
        if param is None:
            continue
        # A parameter no kept token reached has no reference gradient: it must be zero.
        expected = ref.grad if ref.grad is not None else torch.zeros_like(ref)
        torch.testing.assert_close(param.grad.double(), expected, **tol, msg=lambda m: f"{tuple(param.shape)}: {m}")
    return capacity, kept

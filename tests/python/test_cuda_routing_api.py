"""Tutel's routing API (extract_critical, fast_encode, fast_decode) gives the same
results and gradients on CUDA as on the CPU, and a whole routing + encode +
decode training step can be captured in a CUDA graph.  Skipped without CUDA."""
import pytest
import torch

from conftest import ALL_DTYPES, tolerance
from cuda_compare import assert_data_matches, assert_dots_match, assert_identical, cuda_available
from tutel import moe

pytestmark = pytest.mark.skipif(not cuda_available, reason="needs a CUDA device")


def run_step(scores, x, top_k, capacity_factor, batch_prioritized):
    """Routing, encode, a stand-in expert, decode and a loss; returns what to compare."""
    crit, l_aux = moe.top_k_routing(scores, top_k=top_k, capacity_factor=capacity_factor,
                                    batch_prioritized_routing=batch_prioritized)
    dispatched = moe.fast_encode(x, crit)
    combined = moe.fast_decode(dispatched * 2 + 1, crit)
    loss = combined.float().square().sum() + l_aux.float()
    loss.backward()
    return crit, l_aux, dispatched, combined


@pytest.mark.parametrize("batch_prioritized", [False, True])
@pytest.mark.parametrize("capacity_factor", [1.0, 0.0, -0.5])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k,model_dim", [(64, 4, 2, 8), (301, 16, 1, 12), (97, 7, 3, 5)])
def test_routing_api_equals_cpu(tokens, experts, top_k, model_dim, dtype, capacity_factor, batch_prioritized):
    scores = torch.randn(tokens, experts).softmax(1).to(dtype)
    x = torch.randn(tokens, model_dim).to(dtype)
    results = {}
    for device in ("cpu", "cuda"):
        s = scores.detach().to(device).requires_grad_()
        v = x.detach().to(device).requires_grad_()
        results[device] = run_step(s, v, top_k, capacity_factor, batch_prioritized) + (s.grad, v.grad)
    (crit, l_aux, dispatched, combined, scores_grad, x_grad) = results["cpu"]
    (g_crit, g_l_aux, g_dispatched, g_combined, g_scores_grad, g_x_grad) = results["cuda"]
    assert crit.capacity == g_crit.capacity and crit.num_global_experts == g_crit.num_global_experts
    for name in ("indices_s", "locations_s", "gates_s"):
        for cpu, gpu in zip(getattr(crit, name), getattr(g_crit, name)):
            assert_data_matches(cpu.detach(), gpu.detach(), name)
    assert_identical(crit.dispatch_count, g_crit.dispatch_count, "dispatch_count")
    torch.testing.assert_close(g_l_aux.cpu(), l_aux, rtol=1e-5, atol=1e-6)
    assert_data_matches(dispatched.detach(), g_dispatched.detach(), "fast_encode")
    assert_data_matches(x_grad, g_x_grad, "x.grad")
    # decode sums k weighted rows in the accumulation type; the score gradient adds a dot product
    # over model_dim.  Both devices sum in another order: float32 / float64 agree to their own
    # rounding, 16-bit results to one rounding of the 16-bit type.
    if dtype in (torch.float32, torch.float64):
        assert_dots_match(combined.detach(), g_combined.detach(), "fast_decode")
        # The score gradient sums products of the loss gradient (2 * combined) and the expert rows
        # (2 * dispatched + 1), then goes through the gates' normalisation, which cancels.
        terms = float((2 * combined.detach()).abs().max() * (2 * dispatched.detach() + 1).abs().max())
        assert_dots_match(scores_grad, g_scores_grad, "scores.grad", terms=terms)
    else:
        torch.testing.assert_close(g_combined.detach().cpu(), combined.detach(), **tolerance(dtype))
        torch.testing.assert_close(g_scores_grad.cpu(), scores_grad, **tolerance(dtype))


@pytest.mark.parametrize("batch_prioritized", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_training_step_is_captured_in_a_cuda_graph(dtype, batch_prioritized):
    """capacity_factor > 0 never synchronises with the host, so routing, encode,
    decode and their backward pass can be captured and replayed with new data."""
    tokens, experts, top_k, model_dim = 256, 8, 2, 64
    weight = torch.randn(model_dim, experts, device="cuda", dtype=dtype, requires_grad=True)
    static_x = torch.randn(tokens, model_dim, device="cuda", dtype=dtype, requires_grad=True)

    def step():
        scores = torch.softmax(static_x.detach() @ weight, dim=1)
        crit, l_aux = moe.top_k_routing(scores, top_k=top_k, capacity_factor=1.0,
                                        batch_prioritized_routing=batch_prioritized)
        out = moe.fast_decode(moe.fast_encode(static_x, crit) * 3, crit)
        loss = out.float().square().mean() + l_aux.float()
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: compiles and loads every kernel outside the capture
            static_x.grad = weight.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    static_x.grad = weight.grad = None
    with torch.cuda.graph(graph):
        static_loss = step()
    # Backward made these during the capture; every replay writes them again.
    graph_x_grad, graph_w_grad = static_x.grad, weight.grad

    for _ in range(2):
        static_x.detach().copy_(torch.randn(tokens, model_dim, device="cuda", dtype=dtype))
        graph.replay()
        replayed = (static_loss.clone(), graph_x_grad.clone(), graph_w_grad.clone())
        static_x.grad = weight.grad = None
        eager = (step(), static_x.grad, weight.grad)
        for name, got, expected in zip(("loss", "x.grad", "weight.grad"), replayed, eager):
            torch.testing.assert_close(got, expected, msg=name)

"""The CPU grouped product's large groups: PyTorch GEMMs spread over the threads (each one
single-threaded, big ones cut into pieces by rows or, for weight gradients, by features),
against a float64 loop over the experts, at several thread counts, forward and every gradient,
through autograd (the pool's threads must run below autograd like the caller)."""
import pytest
import torch

from tutel.ops.grouped_mm import grouped_rows_mm

TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 5e-2), torch.float16: (3e-3, 3e-3)}

# Groups above the skinny products' 32 rows: many mid-sized ones with idle experts between
# them (spread whole), one large group (cut into row pieces, its weight gradient into
# feature pieces), and a mix with small groups that the skinny products take.
COUNTS = [
    [70, 0, 41, 97, 33, 0, 128],
    [701],
    [5, 300, 1, 0, 64, 33, 32, 250],
]


@pytest.fixture(params=[1, 2, 3])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def reference(rows, weight, bias, counts, transposed):
    out = torch.zeros(rows.shape[0], weight.shape[2] if transposed else weight.shape[1], dtype=torch.float64)
    start = 0
    for expert, count in enumerate(counts):
        right = weight[expert] if transposed else weight[expert].t()
        out[start:start + count] = rows[start:start + count] @ right + bias[expert]
        start += count
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("counts", COUNTS)
def test_threaded_products_match_float64(threads, dtype, transposed, counts):
    k_dim, o_dim, tail = 263, 301, 3  # odd features: pieces of the weight gradient end mid-vector
    gen = torch.Generator().manual_seed(len(counts) * 1000 + sum(counts) + threads)
    experts = len(counts)
    rows64 = torch.randn(sum(counts) + tail, k_dim, generator=gen, dtype=torch.float64)
    shape = (experts, k_dim, o_dim) if transposed else (experts, o_dim, k_dim)
    weight64 = torch.randn(shape, generator=gen, dtype=torch.float64) / k_dim ** 0.5
    bias64 = torch.randn(experts, o_dim, generator=gen, dtype=torch.float64)
    grad64 = torch.randn(rows64.shape[0], o_dim, generator=gen, dtype=torch.float64)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)

    # The reference takes the values in the tested dtype, so only the products' rounding differs.
    leaves = [t.to(dtype).requires_grad_() for t in (rows64, weight64, bias64)]
    out = grouped_rows_mm(leaves[0], leaves[1], offsets, transposed, leaves[2])
    got = torch.autograd.grad(out, leaves, grad64.to(dtype))

    exact = [t.detach().double().requires_grad_() for t in leaves]
    want = reference(exact[0], exact[1], exact[2], counts, transposed)
    want[sum(counts):] = 0
    wanted = torch.autograd.grad(want, exact, grad64)

    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol)
    # Gradients sum up to 701 products per entry: the tolerance grows with that length's square root.
    for name, g, w in zip(("rows", "weight", "bias"), got, wanted):
        torch.testing.assert_close(g.double(), w, rtol=rtol * 4, atol=atol * 30, msg=lambda m: f"d {name}: {m}")
    assert not out[sum(counts):].any() and not got[0][sum(counts):].any()


def test_threaded_products_without_grad(threads):
    """The direct path (no custom operator, no autograd) cuts and spreads the same products."""
    gen = torch.Generator().manual_seed(threads)
    counts = [400, 0, 90, 45]
    rows = torch.randn(sum(counts), 130, generator=gen)
    weight = torch.randn(len(counts), 77, 130, generator=gen)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    with torch.no_grad():
        out = grouped_rows_mm(rows, weight, offsets)
    want = reference(rows.double(), weight.double(), torch.zeros(len(counts), 77, dtype=torch.float64), counts,
                     False)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("transposed", [False, True])
def test_long_rows_around_the_skinny_bound(transposed):
    """float32 rows of 2600 features: [O, K] groups of up to 20 rows take the skinny products (whatever
    their length), longer ones the GEMM (past 160 KiB of token rows); both sides of the bound against
    float64."""
    gen = torch.Generator().manual_seed(9)
    counts, k_dim, o_dim = [14, 19, 20, 21, 0, 33], 2600, 70
    rows = torch.randn(sum(counts), k_dim, generator=gen)
    shape = (len(counts), k_dim, o_dim) if transposed else (len(counts), o_dim, k_dim)
    weight = torch.randn(shape, generator=gen) / k_dim ** 0.5
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    leaves = (rows.clone().requires_grad_(), weight.clone().requires_grad_())
    out = grouped_rows_mm(leaves[0], leaves[1], offsets, transposed)
    grad = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, leaves, grad)
    exact = [t.double().requires_grad_() for t in (rows, weight)]
    want = reference(exact[0], exact[1], torch.zeros(len(counts), o_dim, dtype=torch.float64), counts, transposed)
    wanted = torch.autograd.grad(want, exact, grad.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    for g, w in zip(got, wanted):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=5e-4)

"""Checks of every tutel.net collective and its gradient against dist_reference (run in each rank)."""
import datetime
import os

import torch
import torch.distributed as dist

import dist_reference as ref
from dist_checks import CheckList, close, compare_with_reference, expect_error, rank, side_channel, world
from tutel import net

checks = CheckList()
ReduceOp = dist.ReduceOp


@checks.add
def simple_all_reduce_every_op():
    for op in ("SUM", "MAX", "MIN", "PRODUCT", "AVG"):
        inputs = [ref.seeded("allreduce", r, [3, 5]) for r in range(world())]
        x = inputs[rank()].clone()
        out = net.simple_all_reduce(x, op=getattr(ReduceOp, op))
        close(out, ref.reduce(inputs, op), f"simple_all_reduce {op}")
        close(x, inputs[rank()], "simple_all_reduce must not modify its input")
    y = inputs[rank()].clone().t()  # non-contiguous, reduced in place
    assert net.simple_all_reduce(y, inplace=True) is y
    close(y, ref.reduce(inputs, "SUM").t(), "simple_all_reduce inplace")
    expect_error(TypeError, ["op", "ReduceOp"], net.simple_all_reduce, x, op="sum")
    # gloo averages by a sum divided here (it refuses AVG before PyTorch 2.8): integers have no average
    expect_error(ValueError, ["op=AVG", "floating-point", "torch.int32"], net.simple_all_reduce,
                 torch.ones(3, dtype=torch.int32), op=ReduceOp.AVG)


@checks.add
def simple_all_to_all_split_gather():
    inputs = [ref.seeded("a2a", r, [world() * 3, 5]) for r in range(world())]
    expected = ref.all_to_all(inputs, 0, 0)[rank()]
    close(net.simple_all_to_all(inputs[rank()]), expected, "simple_all_to_all")
    output, wait = net.simple_all_to_all(inputs[rank()], background=True)
    wait()
    close(output, expected, "simple_all_to_all background")
    os.environ["SKIP_A2A"] = "1"
    try:
        assert torch.equal(net.simple_all_to_all(inputs[rank()]), inputs[rank()]), "SKIP_A2A=1 must bypass"
    finally:
        del os.environ["SKIP_A2A"]
    close(net.simple_split(inputs[rank()]), ref.split(inputs[rank()], 0, world())[rank()], "simple_split")
    close(net.simple_all_gather(inputs[rank()]), torch.cat(inputs), "simple_all_gather")
    scalar = torch.tensor(float(rank()) + 0.5, dtype=torch.float64)
    close(net.simple_all_gather(scalar), torch.arange(world(), dtype=torch.float64) + 0.5, "all_gather of 0-d")
    bf16 = [ref.seeded("ag16", r, [2, 3], torch.bfloat16) for r in range(world())]
    assert torch.equal(net.simple_all_gather(bf16[rank()]), torch.cat(bf16)), "simple_all_gather bfloat16"
    expect_error(ValueError, ["dim 0", "not divisible", str(world())],
                 net.simple_all_to_all, torch.zeros([world() * 2 + 1, 2]))
    if world() > 1:
        expect_error(ValueError, ["dim 0", "not divisible"], net.simple_split, torch.zeros([world() + 1]))


@checks.add
def simple_reduce_scatter_every_op():
    for op in ("SUM", "MAX", "MIN", "PRODUCT", "AVG"):
        inputs = [ref.seeded("rs", r, [world() * 2, 3]) for r in range(world())]
        out = net.simple_reduce_scatter(inputs[rank()], op=getattr(ReduceOp, op))
        close(out, ref.split(ref.reduce(inputs, op), 0, world())[rank()], f"simple_reduce_scatter {op}")
    bits = [torch.tensor(ref.seeded_ints("bits", r, 0, 256, world() * 4), dtype=torch.int32) for r in range(world())]
    for op, function in ((ReduceOp.BAND, torch.bitwise_and), (ReduceOp.BOR, torch.bitwise_or),
                         (ReduceOp.BXOR, torch.bitwise_xor)):
        expected = bits[0]
        for other in bits[1:]:
            expected = function(expected, other)
        out = net.simple_reduce_scatter(bits[rank()], op=op)
        assert torch.equal(out, expected.chunk(world())[rank()]), f"simple_reduce_scatter {op}"
    halves = [ref.seeded("rs16", r, [world() * 4], torch.bfloat16) for r in range(world())]
    exact = sum(h.double() for h in halves).chunk(world())[rank()]
    close(net.simple_reduce_scatter(halves[rank()]).double(), exact, "reduce_scatter bfloat16", tol=2e-2)


@checks.add
def all_to_all_every_dim_pair():
    w = world()
    shape = [2 * w, 3 * w, 2 * w]
    for input_dim, output_dim in ((1, 0), (0, 1), (0, 2), (2, 0), (1, 2), (2, 1), (0, 0), (2, 2), (-1, 1)):
        name = f"all_to_all({input_dim},{output_dim})"
        compare_with_reference(name, lambda r: ref.seeded(name, r, shape),
                               lambda x: net.all_to_all(x, input_dim, output_dim),
                               lambda xs: ref.all_to_all(xs, input_dim % 3, output_dim % 3))
        compare_with_reference(name + " background", lambda r: ref.seeded(name, r, shape),
                               lambda x: net.all_to_all(x, input_dim, output_dim, background=True)(),
                               lambda xs: ref.all_to_all(xs, input_dim % 3, output_dim % 3))
    compare_with_reference("all_to_all_single", lambda r: ref.seeded("single", r, [w * 2, 3]),
                           net.all_to_all_single, lambda xs: ref.all_to_all(xs, 0, 0))
    if w > 1:
        expect_error(ValueError, ["output_dim", "not divisible", str(w)], net.all_to_all,
                     torch.zeros([w, w + 1]), 0, 1)
    expect_error(ValueError, ["input_dim", "allowed"], net.all_to_all, torch.zeros([w, 2]), 2, 0)
    expect_error(TypeError, ["input", "torch.Tensor"], net.all_to_all, [1, 2], 0, 0)


@checks.add
def background_all_to_all_returns_before_the_peers_join():
    # Rank 0 starts the exchange while the other ranks wait for its signal that the call
    # returned: the call must return without them; the result arrives at wait() once they join.
    # A call that blocked would never send the signal: the peers then join after a generous
    # timeout (below the groups' 60 s; only a failing run waits for it) and every rank reports it.
    w = world()
    if w == 1:
        return
    store = side_channel()
    net.barrier()
    inputs = [ref.seeded("async", r, [w, 4]) for r in range(w)]
    signalled = True
    if rank() == 0:
        finish = net.all_to_all(inputs[0], 0, 0, background=True)
        store.set("background call returned", "1")
    else:
        try:
            store.wait(["background call returned"], datetime.timedelta(seconds=45))
        except RuntimeError:  # timed out: rank 0's call did not return without us
            signalled = False
        finish = net.all_to_all(inputs[rank()], 0, 0, background=True)
    result = finish()
    assert finish() is result, "calling the background function again must return the same tensor"
    close(result, ref.all_to_all(inputs, 0, 0)[rank()], "background all_to_all")
    missed = int(net.simple_all_reduce(torch.tensor([0 if signalled else 1]))[0])
    assert missed == 0, f"background all_to_all blocked rank 0 until the peers joined ({missed} rank(s) timed out)"
    net.barrier()  # rank 0 serves the store: keep it until every peer is done with it


@checks.add
def all_gather_split_reduce_scatter_with_gradients():
    w = world()
    for dim in (0, 1, -1):
        shape = [2, 3, 2]
        compare_with_reference(f"all_gather dim {dim} fused", lambda r: ref.seeded("ag", r, shape),
                               lambda x: net.all_gather(x, dim, fused=True), lambda xs: ref.all_gather(xs, dim))
        compare_with_reference(f"all_gather dim {dim}", lambda r: ref.seeded("ag", r, shape),
                               lambda x: net.all_gather(x, dim), lambda xs: ref.all_gather(xs, dim),
                               single_loss=True)
        split_shape = [2 * w, 3 * w, w]
        compare_with_reference(f"spatial_split dim {dim}", lambda r: ref.seeded("split", r, split_shape),
                               lambda x: net.spatial_split(x, dim), lambda xs: ref.split(xs[0], dim, w),
                               replicated_input=True)
        compare_with_reference(f"reduce_scatter dim {dim}", lambda r: ref.seeded("rsd", r, split_shape),
                               lambda x: net.reduce_scatter(x, dim), lambda xs: ref.reduce_scatter(xs, dim))
    if w > 1:
        expect_error(ValueError, ["dim", "not divisible"], net.spatial_split, torch.zeros([2, w + 1]), 1)
        expect_error(ValueError, ["dim", "not divisible"], net.reduce_scatter, torch.zeros([w + 1]), 0)


@checks.add
def allreduce_forward_and_backward_honour_op():
    w = world()
    shape = [3, 4]
    compare_with_reference("allreduce_forward", lambda r: ref.seeded("arf", r, shape), net.allreduce_forward,
                           lambda xs: [sum(xs)] * w, single_loss=True)
    compare_with_reference("allreduce_backward", lambda r: ref.seeded("arb", r, shape), net.allreduce_backward,
                           lambda xs: list(xs), replicated_input=True)
    inputs = [ref.seeded("arf-max", r, shape) for r in range(w)]
    x = inputs[rank()].clone().requires_grad_()
    y = net.allreduce_forward(x, op=ReduceOp.MAX)
    close(y, ref.reduce(inputs, "MAX"), "allreduce_forward MAX")
    grad = ref.seeded("arf-max-grad", rank(), shape)
    y.backward(grad)
    close(x.grad, grad, "allreduce_forward backward is the identity")
    x = inputs[0].clone().requires_grad_()
    y = net.allreduce_backward(x, op=ReduceOp.MAX)
    close(y, inputs[0], "allreduce_backward forward is the identity")
    grads = [ref.seeded("arb-max-grad", r, shape) for r in range(w)]
    y.backward(grads[rank()])
    close(x.grad, ref.reduce(grads, "MAX"), "allreduce_backward MAX")


@checks.add
def zero_gather_and_zero_scatter():
    w = world()
    full_shape = [3, 5]  # 15 elements: padded to a multiple of the group size
    shard = -(-15 // w)

    def reference(xs):
        return [torch.cat(xs).reshape(-1)[:15].view(full_shape)] * w
    compare_with_reference("zero_gather", lambda r: ref.seeded("zg", r, [shard]),
                           lambda x: net.zero_gather(x, full_shape), reference)
    compare_with_reference("zero_gather default shape", lambda r: ref.seeded("zg2", r, [2, 3]),
                           net.zero_gather, lambda xs: [torch.cat(xs)] * w)
    full = ref.seeded("zs", 0, full_shape)
    padded = torch.cat([full.reshape(-1), torch.zeros([shard * w - 15], dtype=full.dtype)])
    piece, shape = net.zero_scatter(full, net.simple_split)
    assert shape == full.shape
    close(piece, padded.chunk(w)[rank()], "zero_scatter simple_split")
    per_rank = [ref.seeded("zs-rs", r, full_shape) for r in range(w)]
    summed = torch.cat([sum(per_rank).reshape(-1), torch.zeros([shard * w - 15], dtype=full.dtype)])
    piece, _ = net.zero_scatter(per_rank[rank()], net.simple_reduce_scatter)
    close(piece, summed.chunk(w)[rank()], "zero_scatter simple_reduce_scatter")
    expect_error(ValueError, ["full_shape", "elements"], net.zero_gather, torch.zeros([2]), [3, w + 1])

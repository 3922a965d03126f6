"""Bad input raises a clear Python exception naming the argument and what is allowed."""
import pytest
import torch

from tutel import moe, ops


def routing(tokens=8, experts=4, k=2):
    return ops.route_topk(torch.rand(tokens, experts).softmax(1), k)


@pytest.mark.parametrize("k,match", [(0, "top_k|k"), (-1, "k"), (5, "top_k=5 exceeds num_global_experts=4")])
def test_invalid_k(k, match):
    with pytest.raises(ValueError, match=match):
        ops.route_topk(torch.rand(3, 4), k)
    with pytest.raises(ValueError, match=match):
        moe.top_k_routing(torch.rand(3, 4), top_k=k)


def test_wrong_dtypes_and_shapes():
    with pytest.raises(TypeError, match="scores.*float32, float64, bfloat16 or float16"):
        ops.route_topk(torch.ones(3, 4, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="`scores` must be 2-D"):
        ops.route_topk(torch.rand(3, 4, 5), 1)
    with pytest.raises(TypeError, match="k.*integer"):
        ops.route_topk(torch.rand(3, 4), 1.5)
    r = routing()
    with pytest.raises(TypeError, match="`x` must be float32"):
        ops.encode(torch.ones(8, 3, dtype=torch.int32), r.indices, r.locations, 4, 4)
    with pytest.raises(ValueError, match="`x` has 7 tokens but `indices` describes 8"):
        ops.encode(torch.rand(7, 3), r.indices, r.locations, 4, 4)
    with pytest.raises(ValueError, match="`y` must be 3-D"):
        ops.decode(torch.rand(4, 3), r.indices, r.locations)
    with pytest.raises(TypeError, match="`indices` must hold integers"):
        ops.encode(torch.rand(8, 3), r.indices.float(), r.locations, 4, 4)
    with pytest.raises(ValueError, match="same \\[k, tokens\\] shape"):
        ops.encode(torch.rand(8, 3), r.indices, r.locations[:1], 4, 4)
    with pytest.raises(ValueError, match="`gates` must have shape"):
        ops.decode(torch.rand(4, 4, 3), r.indices, r.locations, gates=torch.rand(2, 7))
    with pytest.raises(ValueError, match="`capacity` must be >= 0"):
        ops.encode(torch.rand(8, 3), r.indices, r.locations, 4, -1)
    with pytest.raises(ValueError, match="`num_experts` must be >= 1"):
        ops.encode(torch.rand(8, 3), r.indices, r.locations, 0, 3)


def test_indices_out_of_range_and_negative_locations():
    x = torch.rand(3, 2)
    good_loc = torch.zeros(1, 3, dtype=torch.int32)
    with pytest.raises(IndexError, match="expert index 9 .*token 1.*0 <= index < num_experts"):
        ops.encode(x, torch.tensor([[0, 9, 1]]), good_loc, 4, 2)
    with pytest.raises(IndexError, match="expert index -1"):
        ops.decode(torch.rand(4, 2, 2), torch.tensor([[0, 1, -1]]), good_loc)
    with pytest.raises(ValueError, match="location -3 .*must be >= 0"):
        ops.decode(torch.rand(4, 2, 2), torch.tensor([[0, 1, 2]]), torch.tensor([[0, -3, 0]]))
    with pytest.raises(ValueError, match="location -3"):
        ops.encode(x, torch.tensor([[0, 1, 2]]), torch.tensor([[0, -3, 0]]), 4, 2)
    with pytest.raises(IndexError, match="expert index 4"):
        ops.assign_locations(torch.tensor([[0, 4]]), 4)
    dispatcher = moe.fast_dispatcher(4, 2, 2, torch.float32)
    dispatcher.update([torch.tensor([0, 7, 1])], [torch.tensor([0, 0, 0])], [torch.ones(3)])
    with pytest.raises(IndexError, match="expert index 7"):
        dispatcher.encode(x)


def test_capacity_factor_must_be_finite():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="capacity_factor"):
            moe.top_k_routing(torch.rand(3, 4).softmax(1), top_k=1, capacity_factor=bad)
    with pytest.raises(TypeError, match="capacity_factor"):
        moe.top_k_routing(torch.rand(3, 4).softmax(1), top_k=1, capacity_factor="1.0")
    with pytest.raises(ValueError, match="alignment"):
        moe.top_k_routing(torch.rand(3, 4).softmax(1), top_k=1, alignment=0)


def test_decode_buffer_must_split_into_experts():
    crit, _ = moe.top_k_routing(torch.rand(6, 4).softmax(1), top_k=1)
    with pytest.raises(ValueError, match="num_global_experts=4"):
        moe.fast_decode(torch.rand(7, 3), crit)


def _buffers_that_disagree_with(experts: int, capacity: int, model_dim: int = 5):
    """Expert buffers whose row count divides by `experts` (so a plain reshape would succeed) but
    whose experts x capacity is not the routing's."""
    return [torch.rand(experts - 1, capacity, model_dim),             # [3, C, M] for 4 experts
            torch.rand(experts, capacity + 1, model_dim),             # one slot too many
            torch.rand(experts * (capacity + 1), model_dim),          # flat, one slot per expert too many
            torch.rand(experts * 2, capacity // 2, model_dim)]        # same rows, other split


def test_every_decode_entry_point_checks_experts_and_capacity():
    experts = 4
    crit, _ = moe.top_k_routing(torch.rand(12, experts).softmax(1), top_k=2, alignment=4)  # capacity 8
    capacity = crit[4]
    assert capacity % 2 == 0 and (experts - 1) * capacity % experts == 0, "the shapes below must divide evenly"
    dispatcher = moe.fast_dispatcher(experts, capacity, 5, torch.float32)
    dispatcher.update(crit[1], crit[2], crit[3], capacity=capacity)
    from tutel.impls.fast_dispatch import GatingDecoder
    decoders = {"fast_decode": lambda y: moe.fast_decode(y, crit),
                "fast_dispatcher.decode": dispatcher.decode,
                "GatingDecoder": lambda y: GatingDecoder.apply(dispatcher, y, *crit[3])}
    for name, decode in decoders.items():
        for buffer in _buffers_that_disagree_with(experts, capacity):
            with pytest.raises(ValueError, match=f"num_global_experts={experts} and capacity={capacity}"):
                decode(buffer)
        # the routing's own shapes are accepted, [E, C, M] and [E*C, M]
        assert decode(torch.rand(experts, capacity, 5)).shape == (12, 5), name
        assert decode(torch.rand(experts * capacity, 5)).shape == (12, 5), name


def test_direct_operator_calls_are_checked_too():
    idx = torch.zeros(1, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="indices"):
        torch.ops.tutel.gather_slots(torch.rand(2, 2, 2), idx.long(), idx, None, None)
    with pytest.raises(ValueError, match="k=0"):
        torch.ops.tutel.route_topk(torch.rand(3, 3), 0, False)
    with pytest.raises(TypeError, match="weights"):  # any floating dtype is read in place, integers are not
        torch.ops.tutel.gather_slots(torch.rand(2, 2, 2), idx, idx, torch.ones(1, 3, dtype=torch.int32), None)
    with pytest.raises(ValueError, match="capacity"):
        torch.ops.tutel.scatter_slots(torch.rand(3, 2), idx, idx, None, None, 2, -1)

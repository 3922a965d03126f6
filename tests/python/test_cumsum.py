"""fast_cumsum_sub_one against torch.cumsum(x) - 1."""
import pytest
import torch

from tutel import moe


@pytest.mark.parametrize("shape", [(0, 3), (1, 1), (37, 5), (4097, 64), (70000, 3), (3, 70000)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8, torch.int16,
                                   torch.bool, torch.float32, torch.float64])
def test_matches_torch_cumsum(shape, dtype):
    mask = torch.randint(0, 2, shape).to(dtype)
    out = moe.fast_cumsum_sub_one(mask)
    expected = torch.cumsum(mask, dim=0) - 1
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)


def test_one_hot_mask_gives_slots():
    ids = torch.tensor([2, 0, 2, 1, 2])
    mask = torch.nn.functional.one_hot(ids, 3)
    slots = (moe.fast_cumsum_sub_one(mask) * mask).sum(1)
    assert slots.tolist() == [0, 0, 1, 0, 2]


@pytest.mark.parametrize("dim", [0, 1, -1, 2])
def test_any_dim_and_non_contiguous_views(dim):
    data = torch.randint(0, 3, (5, 6, 7)).transpose(0, 2)
    assert torch.equal(moe.fast_cumsum_sub_one(data, dim=dim), torch.cumsum(data, dim=dim) - 1)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one dimension"):
        moe.fast_cumsum_sub_one(torch.tensor(3))
    with pytest.raises(ValueError, match="dim=5"):
        moe.fast_cumsum_sub_one(torch.zeros(3, 4), dim=5)
    with pytest.raises(TypeError, match="mask"):
        moe.fast_cumsum_sub_one(torch.zeros(3, 4, dtype=torch.float16))
    with pytest.raises(TypeError, match="torch.Tensor"):
        moe.fast_cumsum_sub_one([[1, 0]])

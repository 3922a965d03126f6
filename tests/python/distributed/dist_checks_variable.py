"""Checks of batch_all_to_all_v / batch_all_gather_v: random sizes (zeros included), several dtypes."""
import torch

import dist_reference as ref
from dist_checks import CheckList, expect_error, rank, world
from tutel import net

checks = CheckList()
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool,
          torch.complex64)


def _data(tag: str, source: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    values = ref.seeded(tag, source, [numel]) * 50
    if dtype == torch.bool:
        return values > 0
    if dtype == torch.complex64:
        return torch.complex(values, -values).to(dtype)
    return values.to(dtype)


def _partition(tag: str, source: int, numel: int) -> list:
    """A random split of numel into world() non-negative parts (zeros are frequent)."""
    cuts = sorted(ref.seeded_ints(tag + "/cuts", source, 0, numel + 1, world() - 1))
    bounds = [0] + cuts + [numel]
    return [bounds[i + 1] - bounds[i] for i in range(world())]


def _trial(tag: str, trial: int, special: dict):
    """(element count of every rank, dtypes, this rank's tensors) of one trial; special[trial] fixes the counts."""
    numels = special.get(trial) or ref.seeded_ints(tag + "/numel", 0, 0, 9, world())
    dtypes = DTYPES[trial % 2::2]
    return numels, dtypes, [_data(f"{tag}/{d}", rank(), numels[rank()], d) for d in dtypes]


@checks.add
def all_to_all_v_random_sizes_every_dtype():
    for trial in range(4):
        tag = f"a2av/{trial}"
        numels, dtypes, datas = _trial(tag, trial, {1: [0] * world()})  # trial 1: nothing at all to send
        partitions = [_partition(tag, s, numels[s]) for s in range(world())]
        datas[0] = datas[0].view(1, -1)  # any shape: flattened
        sizes = partitions[rank()] if trial % 2 else torch.tensor(partitions[rank()])
        outputs, out_sizes = net.batch_all_to_all_v(datas, sizes)
        assert out_sizes.dtype == torch.int64
        assert out_sizes.tolist() == [partitions[s][rank()] for s in range(world())], out_sizes
        for dtype, output in zip(dtypes, outputs):
            every = [_data(f"{tag}/{dtype}", s, numels[s], dtype) for s in range(world())]
            expected = ref.all_to_all_v(every, partitions)[rank()]
            assert output.dtype == dtype and torch.equal(output, expected), (dtype, output, expected)


@checks.add
def all_gather_v_random_sizes_every_dtype():
    for trial in range(3):
        tag = f"agv/{trial}"
        # trial 0: rank 0 has nothing; trial 2: equal sizes
        numels, dtypes, datas = _trial(tag, trial, {0: [0] + [5] * (world() - 1), 2: [3] * world()})
        outputs, sizes = net.batch_all_gather_v(datas)
        assert sizes.tolist() == numels, (sizes, numels)
        for dtype, output in zip(dtypes, outputs):
            expected = torch.cat([_data(f"{tag}/{dtype}", s, numels[s], dtype) for s in range(world())])
            assert output.dtype == dtype and torch.equal(output, expected), (dtype, output, expected)


@checks.add
def variable_size_bad_input():
    x = torch.arange(6.0)
    expect_error(ValueError, ["partition_sizes", "entries", str(world())], net.batch_all_to_all_v, [x],
                 [6] + [0] * world())
    expect_error(ValueError, ["partition_sizes", "sum to", "6"], net.batch_all_to_all_v, [x], [7] + [0] * (world() - 1))
    expect_error(ValueError, ["partition_sizes", "non-negative"], net.batch_all_to_all_v, [x],
                 [8, -2] + [0] * (world() - 2) if world() > 1 else [-1])
    expect_error(TypeError, ["partition_sizes", "integers"], net.batch_all_to_all_v, [x], [6.0] * world())
    expect_error(ValueError, ["same number of elements", "datas[1]"], net.batch_all_to_all_v, [x, x[:2]],
                 [6] + [0] * (world() - 1))
    expect_error(TypeError, ["datas", "list"], net.batch_all_gather_v, x)
    expect_error(TypeError, ["datas[1]", "torch.Tensor"], net.batch_all_gather_v, [x, 3])


@checks.add
def variable_size_mismatched_dtypes_raise_on_every_rank():
    # Rank 0 passes float32, the others float64: every rank must raise (none may wait).
    if world() == 1:
        return
    dtype = torch.float32 if rank() == 0 else torch.float64
    data = torch.ones([world()], dtype=dtype)
    others = "[1" if rank() == 0 else "[0]"
    expect_error(ValueError, ["rank(s)", others, "dtype"], net.batch_all_to_all_v, [data], [1] * world())
    expect_error(ValueError, ["rank(s)", others, "dtype"], net.batch_all_gather_v, [data])
    # The group is still usable afterwards.
    outputs, _ = net.batch_all_gather_v([torch.ones([1])])
    assert outputs[0].tolist() == [1.0] * world()

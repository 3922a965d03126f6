"""Variable-size collectives: ``batch_all_to_all_v`` and ``batch_all_gather_v``.

Both go through torch.distributed on any process group and any backend
(gloo on CPU, NCCL on CUDA) and move every element type, bfloat16, bool and
complex included: the payload travels as raw bytes.  The element counts are
exchanged first with one small collective, which also carries each rank's
number of tensors and element types, so that a rank passing something else
makes every rank raise the same ValueError instead of waiting.  The counts are
copied to the host once (the collectives need them there).
"""
import zlib
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..ops.checks import require_tensor
from .process_groups import get_world_size
from .simple_collectives import all_gather_single, collective_errors, simple_all_gather, simple_all_to_all, waiter

# Columns of the small metadata tensor exchanged before the payload.
_COUNT, _NUM_TENSORS, _DTYPES = 0, 1, 2


def _require_tensor_list(datas: Any, where: str) -> List[torch.Tensor]:
    if not isinstance(datas, (list, tuple)) or not datas:
        raise TypeError(f"{where}: `datas` must be a non-empty list or tuple of tensors, got {type(datas).__name__}")
    for index, data in enumerate(datas):
        require_tensor(data, f"datas[{index}]", where)
    first = datas[0]
    for index, data in enumerate(datas):
        if data.numel() != first.numel():
            raise ValueError(f"{where}: every tensor of `datas` must have the same number of elements; datas[0] has "
                             f"{first.numel()}, datas[{index}] has {data.numel()}")
        if data.device != first.device:
            raise ValueError(f"{where}: every tensor of `datas` must be on one device; datas[0] is on {first.device}, "
                             f"datas[{index}] on {data.device}")
    return list(datas)


def _dtype_signature(datas: Sequence[torch.Tensor]) -> int:
    return zlib.crc32(",".join(str(data.dtype) for data in datas).encode()) & 0x7FFFFFFF


def _metadata(counts: torch.Tensor, datas: Sequence[torch.Tensor]) -> torch.Tensor:
    meta = torch.empty([counts.numel(), 3], dtype=torch.int64)
    meta[:, _COUNT] = counts.cpu()
    meta[:, _NUM_TENSORS] = len(datas)
    meta[:, _DTYPES] = _dtype_signature(datas)
    return meta.to(datas[0].device)


def _check_peers_agree(peer_meta: torch.Tensor, datas: Sequence[torch.Tensor], where: str) -> None:
    differing = [rank for rank, (num, sig) in enumerate(peer_meta[:, _NUM_TENSORS:].tolist())
                 if num != len(datas) or sig != _dtype_signature(datas)]
    if differing:
        raise ValueError(f"{where}: rank(s) {differing} of the group pass a different number of tensors or other "
                         f"element types than this rank ({len(datas)} tensor(s) of dtype(s) "
                         f"{[str(data.dtype) for data in datas]}); every rank must pass the same list of dtypes")


def _as_bytes(data: torch.Tensor) -> torch.Tensor:
    flat = data.contiguous().view(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _partition_sizes(partition_sizes: Any, world_size: int, numel: int, device: torch.device,
                     where: str) -> torch.Tensor:
    try:
        sizes = torch.as_tensor(partition_sizes).reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{where}: `partition_sizes` must be a list or tensor of {world_size} integers, "
                        f"got {partition_sizes!r}") from None
    if sizes.is_floating_point() or sizes.is_complex() or sizes.dtype == torch.bool:
        raise TypeError(f"{where}: `partition_sizes` must hold integers, got dtype {sizes.dtype}")
    sizes = sizes.to(device=device, dtype=torch.int64)
    if sizes.numel() != world_size:
        raise ValueError(f"{where}: `partition_sizes` has {sizes.numel()} entries; allowed: exactly one per rank "
                         f"of the group ({world_size})")
    host = sizes.cpu()
    if bool((host < 0).any()) or int(host.sum()) != numel:
        raise ValueError(f"{where}: `partition_sizes`={host.tolist()} must be non-negative and sum to the "
                         f"{numel} elements of each tensor of `datas`")
    return sizes


def batch_all_to_all_v(datas: Sequence[torch.Tensor], partition_sizes: Any,
                       group: Optional[Any] = None) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """Variable-size all-to-all of several tensors that share one partition.

    Each tensor of ``datas`` (same number of elements, any shape and dtype) is
    flattened; its first ``partition_sizes[0]`` elements go to rank 0, the next
    ``partition_sizes[1]`` to rank 1, and so on.

    Returns:
        ``(outputs, out_sizes)``: one flat tensor per input holding the pieces
        received from ranks 0..W-1 in order, and the int64 tensor [W] of the
        received counts (on the device of ``datas``).  With one process the
        inputs are returned unchanged, with ``partition_sizes`` as a tensor.
    """
    where = "tutel.net.batch_all_to_all_v"
    datas = _require_tensor_list(datas, where)
    world_size = get_world_size(group)
    device = datas[0].device
    in_sizes = _partition_sizes(partition_sizes, world_size, datas[0].numel(), device, where)
    if world_size == 1:
        return datas, in_sizes
    peer_meta = simple_all_to_all(_metadata(in_sizes, datas), group)
    _check_peers_agree(peer_meta, datas, where)
    out_sizes = peer_meta[:, _COUNT].contiguous()
    send_counts, recv_counts = in_sizes.tolist(), peer_meta[:, _COUNT].tolist()
    outputs, waits = [], []
    for data in datas:
        output = torch.empty([sum(recv_counts)], dtype=data.dtype, device=device)
        itemsize = data.element_size()
        with collective_errors(where, group):
            work = dist.all_to_all_single(_as_bytes(output), _as_bytes(data),
                                          output_split_sizes=[count * itemsize for count in recv_counts],
                                          input_split_sizes=[count * itemsize for count in send_counts],
                                          group=group, async_op=True)
        outputs.append(output)
        waits.append(waiter(work, where, group))
    for wait in waits:
        wait()
    return outputs, out_sizes


def batch_all_gather_v(datas: Sequence[torch.Tensor],
                       group: Optional[Any] = None) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """Variable-size all-gather of several tensors (same number of elements on a rank).

    Returns:
        ``(outputs, output_sizes)``: one flat tensor per input holding the
        elements of ranks 0..W-1 in order, and the int64 tensor [W] of every
        rank's count (on the device of ``datas``).  With one process the
        flattened inputs and ``[numel]``.
    """
    where = "tutel.net.batch_all_gather_v"
    datas = _require_tensor_list(datas, where)
    world_size = get_world_size(group)
    device = datas[0].device
    numel = datas[0].numel()
    if world_size == 1:
        return [data.reshape(-1) for data in datas], torch.tensor([numel], dtype=torch.int64, device=device)
    peer_meta = simple_all_gather(_metadata(torch.tensor([numel]), datas), group)
    _check_peers_agree(peer_meta, datas, where)
    output_sizes = peer_meta[:, _COUNT].contiguous()
    counts = output_sizes.tolist()
    largest = max(counts)
    gathered, waits = [], []
    for data in datas:
        # Equal-size slots (padded to the largest count), compacted after the wait.
        padded = torch.zeros([largest], dtype=data.dtype, device=device)
        padded[:numel] = data.reshape(-1)
        slots = torch.empty([world_size, largest], dtype=data.dtype, device=device)
        with collective_errors(where, group):
            work = all_gather_single(_as_bytes(slots), _as_bytes(padded), group=group, async_op=True)
        gathered.append(slots)
        waits.append(waiter(work, where, group))
    outputs = []
    for slots, wait in zip(gathered, waits):
        wait()
        if all(count == largest for count in counts):
            outputs.append(slots.view(-1))
        else:
            outputs.append(torch.cat([slots[rank, :count] for rank, count in enumerate(counts)]))
    return outputs, output_sizes

"""Rows grouped by expert, as plain PyTorch operations: ``add_expert_bias_`` (in place),
``expert_row_sums`` and ``choice_rows``, with the arguments and results of ``torch.ops.tutel``'s.

rows [N, C] hold expert 0's rows, then expert 1's, ...: ``offsets`` [E] int32 is the non-decreasing
end of each expert's rows, and the rows past ``offsets[E - 1]`` belong to no expert.  The expert of
row i is the first e with offsets[e] > i (E for none), found with one ``searchsorted``.

No host synchronisation: every size comes from the shapes and ``k``, so these can be captured in a
CUDA graph; for the same reason the values of ``offsets`` and ``slot_choices`` are not checked (the
CPU operators check them and raise).  ``add_expert_bias_`` and ``choice_rows`` are bit for bit the
compiled operators'; ``expert_row_sums`` adds in the accumulation dtype in ``index_add_``'s order
(atomics on CUDA), so it agrees with the operator's row-order sums to rounding.
"""
import torch
import torch.nn.functional as F

from .experts import check_offsets, row_experts


def check_rows(rows: torch.Tensor, name: str, where: str) -> None:
    """ValueError / TypeError (from `where`) unless `rows` is a 2-D floating tensor of a data dtype."""
    if rows.dim() != 2:
        raise ValueError(f"{where}: `{name}` must be 2-D, got shape {tuple(rows.shape)}")
    if rows.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise TypeError(f"{where}: `{name}` must be float32, float64, bfloat16 or float16, got {rows.dtype}")


def add_expert_bias_(rows: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor) -> None:
    """rows[i] += bias[e(i)] in place for the rows of some expert (rows [N, C], bias [E, C] in
    rows' dtype), as tutel::add_expert_bias_: the addition of two tensors of one dtype, which
    PyTorch computes in the accumulation dtype and rounds once.  Returns None, like the operator."""
    where = "tutel::add_expert_bias_"
    check_rows(rows, "rows", where)
    check_offsets(offsets, rows, where)
    if bias.dtype != rows.dtype:
        raise TypeError(f"{where}: `bias` must have dtype {rows.dtype}, got {bias.dtype}")
    if bias.device != rows.device:
        raise ValueError(f"{where}: `bias` is on {bias.device} but the data is on {rows.device}")
    if bias.dim() != 2 or tuple(bias.shape) != (offsets.shape[0], rows.shape[1]):
        raise ValueError(f"{where}: `bias` must have shape [E, C] = [{offsets.shape[0]}, {rows.shape[1]}], got "
                         f"{list(bias.shape)}")
    # The rows of no expert take the extra row of -0.0: x + -0.0 is x for every x, -0.0 and NaN
    # included (a +0.0 row would turn their -0.0 into +0.0), so they keep their bits.
    padded = F.pad(bias, (0, 0, 0, 1), value=-0.0)
    rows.add_(padded.index_select(0, row_experts(rows.shape[0], offsets)))


def expert_row_sums(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[E, C] in rows' dtype: the sum of each expert's rows in the accumulation dtype (float32 for
    16-bit data, float64 for float64), 0 for an idle expert, the rows of no expert ignored; as
    tutel::expert_row_sums."""
    where = "tutel::expert_row_sums"
    check_rows(rows, "rows", where)
    check_offsets(offsets, rows, where)
    experts = offsets.shape[0]
    accumulation = torch.float64 if rows.dtype == torch.float64 else torch.float32
    # Row E gathers the rows of no expert and is dropped.
    sums = rows.new_zeros((experts + 1, rows.shape[1]), dtype=accumulation)
    sums.index_add_(0, row_experts(rows.shape[0], offsets), rows.to(accumulation))
    return sums[:experts].to(rows.dtype)


def choice_rows(x: torch.Tensor, slot_choices: torch.Tensor, k: int) -> torch.Tensor:
    """[N, H]: out[s] = x[slot_choices[s] // k] (x [T, H], slot_choices [N] int64 in [0, T k)), as
    tutel::choice_rows.  A choice outside that range gives a zero row, as in the CUDA kernel (the
    CPU operator raises): an index_select of out-of-range rows would stop the device instead."""
    where = "tutel::choice_rows"
    check_rows(x, "x", where)
    if slot_choices.dim() != 1:
        raise ValueError(f"{where}: `slot_choices` must be 1-D, got shape {tuple(slot_choices.shape)}")
    if slot_choices.dtype != torch.int64:
        raise TypeError(f"{where}: `slot_choices` must have dtype torch.int64, got {slot_choices.dtype}")
    if slot_choices.device != x.device:
        raise ValueError(f"{where}: `slot_choices` is on {slot_choices.device} but the data is on {x.device}")
    if k < 1:
        raise ValueError(f"{where}: `k` must be >= 1, got {k}")
    tokens = x.shape[0]
    if tokens == 0:  # every choice is out of range
        return x.new_zeros((slot_choices.shape[0], x.shape[1]))
    token = torch.div(slot_choices, k, rounding_mode="floor")
    valid = (slot_choices >= 0) & (token < tokens)
    out = x.index_select(0, token.clamp(0, tokens - 1))
    return out.masked_fill_(~valid.unsqueeze(1), 0)

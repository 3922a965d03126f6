"""W8A8's dynamic activation quantization in plain PyTorch (DeepSeek-V3's ``act_quant``, the rule
transformers' finegrained-fp8 experts apply inline): each row of [n, K] activations, per group of
``group`` columns (the last group may be partial), is quantized to E4M3 with the float32 scale
amax / 448, codes = E4M3 rounding (nearest, ties to even) of value / max(scale, 1e-12) (the floor
transformers' kernels put on the scale: an all-zero group gives zero codes), and returned
dequantized, codes * scale.  The reference of tutel's ``quantized_grouped_linear`` operator's
``activation_group`` (which applies the same rule on the CPU, bit for bit, and inside its CUDA
launch), and the quantization of float64 rows.
"""
import torch

# E4M3's largest magnitude, and the smallest activation scale divided by.
_E4M3_MAX = 448.0
_SMALLEST_ACTIVATION_SCALE = 1e-12


def dynamic_activations(values: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, K] activations quantized per row and per `group` columns to E4M3 with the float32 scale
    amax / 448, returned dequantized (codes * scale) in `dtype` (see the module docstring).

    Elementwise PyTorch operators only, no value read on the host (on CUDA: seven launches, one more
    to widen 16-bit values, one more to pad a last partial group)."""
    rows, columns = values.shape
    groups = -(-columns // group)
    if groups * group == columns:  # whole groups: no padding
        wide = values if values.dtype == torch.float32 else values.float()
    else:  # the last group padded with zeros, which change no group's largest magnitude
        wide = values.new_zeros((rows, groups * group), dtype=torch.float32)
        wide[:, :columns] = values
    grouped = wide.reshape(rows, groups, group)
    scale = torch.linalg.vector_norm(grouped, float("inf"), dim=2, keepdim=True).div_(_E4M3_MAX)  # amax / 448
    # |value| / (amax / 448) exceeds 448 by rounding only (two roundings of 2^-24 each): E4M3's
    # round-to-nearest takes it to 448 (the next code, 480, lies past the midpoint 464), so no clamp
    # of the codes is needed for finite values.
    codes = (grouped / scale.clamp(min=_SMALLEST_ACTIVATION_SCALE)).to(torch.float8_e4m3fn).to(dtype)
    codes = codes.mul_(scale if dtype == torch.float32 else scale.to(dtype)).view(rows, groups * group)
    return codes if groups * group == columns else codes[:, :columns]


__all__ = ["dynamic_activations"]

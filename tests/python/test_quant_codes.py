"""tutel.quant.codes: the E2M1, E4M3 and E8M0 tables against their bit layouts, and the encoders'
rounding (nearest, ties to even, saturating) against quant_spec's search over every code."""
import math

import pytest
import torch

import quant_spec
from tutel.quant import codes


def same_floats(actual, expected):
    """Equal lists of floats, NaN matching NaN and the sign of zero counted."""
    return len(actual) == len(expected) and all(
        (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
        for a, b in zip(actual, expected))


def test_the_tables_follow_the_bit_layouts():
    assert same_floats(codes.E2M1_VALUES, [quant_spec.e2m1_value(c) for c in range(16)])
    assert same_floats(codes.E4M3FN_VALUES, [quant_spec.e4m3fn_value(b) for b in range(256)])
    assert codes.E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert max(v for v in codes.E4M3FN_VALUES if not math.isnan(v)) == codes.E4M3_MAX == 448.0


def test_e4m3_decoding_agrees_with_torchs_float8_cast():
    every = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(torch.float8_e4m3fn)
    assert same_floats(codes.decode_e4m3fn(every).tolist(), every.to(torch.float64).tolist())
    assert codes.e4m3fn_nan(every).nonzero().flatten().tolist() == [0x7F, 0xFF]


def test_e8m0_decoding_gives_the_powers_of_two_and_nan():
    every = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    assert same_floats(codes.decode_e8m0(every).tolist(), [quant_spec.e8m0_value(b) for b in range(256)])
    if codes.FLOAT8_E8M0FNU is not None:
        assert same_floats(codes.decode_e8m0(every.view(codes.FLOAT8_E8M0FNU)).tolist(),
                           every.view(codes.FLOAT8_E8M0FNU).to(torch.float64).tolist())


def neighbourhoods(magnitudes):
    """Each magnitude, the midpoints between neighbours and the numbers just beside them, both signs."""
    values = []
    for low, high in zip(magnitudes, magnitudes[1:]):
        middle = (low + high) / 2
        values += [low, middle, math.nextafter(middle, 0), math.nextafter(middle, math.inf)]
    values += [magnitudes[-1], magnitudes[-1] * 1.01, magnitudes[-1] * 1.5, magnitudes[-1] * 1000]
    return values + [-v for v in values] + [0.0, -0.0]


def test_e2m1_encoding_rounds_to_nearest_with_ties_to_even():
    values = neighbourhoods([quant_spec.e2m1_value(c) for c in range(8)])
    encoded = codes.encode_e2m1(torch.tensor(values, dtype=torch.float64)).tolist()
    assert encoded == [quant_spec.nearest_e2m1(v) for v in values]
    # the ties themselves: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    ties = codes.encode_e2m1(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64))
    assert codes.decode_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_e4m3_encoding_rounds_to_nearest_with_ties_to_even():
    values = neighbourhoods([quant_spec.e4m3fn_value(b) for b in range(0x7F)])
    encoded = codes.encode_e4m3fn(torch.tensor(values, dtype=torch.float64))
    assert encoded.view(torch.uint8).tolist() == [quant_spec.nearest_e4m3(v) for v in values]


def test_e4m3_encoding_agrees_with_torchs_cast_of_float32_values():
    """float32 values reach torch's cast without a first rounding, so both round once."""
    values = torch.randn(4096) * torch.exp2(torch.randint(-12, 9, (4096,)).float())
    ours = codes.encode_e4m3fn(values.to(torch.float64)).view(torch.uint8)
    theirs = values.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, theirs)


def test_pack_puts_the_even_element_in_the_low_nibble():
    codes_ = torch.tensor([[1, 2, 15, 8, 0, 7]], dtype=torch.uint8)
    packed = codes.pack_e2m1(codes_)
    assert packed.tolist() == [[0x21, 0x8F, 0x70]]
    assert torch.equal(codes.unpack_e2m1(packed), codes_)
    every = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(1, 256)
    assert torch.equal(codes.pack_e2m1(codes.unpack_e2m1(every)), every)
    with pytest.raises(ValueError, match="codes: shape \\(1, 3\\) has an odd last dimension"):
        codes.pack_e2m1(codes_[:, :3])


def test_the_power_of_two_helpers_are_exact():
    exponents = torch.arange(-1022, 1024)
    assert codes.power_of_two(exponents).tolist() == [math.ldexp(1.0, int(e)) for e in exponents]
    samples = [math.ldexp(m, e) for e in range(-140, 140, 7) for m in (0.5, 0.75, 0.9999, 1.0 - 2 ** -53)]
    values = torch.tensor(samples, dtype=torch.float64)
    assert codes.floor_log2(values).tolist() == [max(k for k in range(-200, 200) if math.ldexp(1, k) <= v)
                                                 for v in samples]
    assert codes.ceil_log2(values).tolist() == [min(k for k in range(-200, 200) if math.ldexp(1, k) >= v)
                                                for v in samples]

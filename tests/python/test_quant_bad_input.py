"""Bad checkpoint tensors and arguments get one ValueError (TypeError for a wrong kind of object) that
names the tensor, what it holds and what is allowed."""
import re

import pytest
import torch

import quant_spec
from tutel.quant import Fp8BlockWeights, Mxfp4Weights, Nvfp4Weights
from tutel.quant.codes import FLOAT8_E8M0FNU


def e4m3(shape):
    return quant_spec.random_e4m3_bytes(shape)


def fp8(weight=None, scale_inv=None, block=(128, 128), **kwargs):
    weight = e4m3((2, 130, 200)) if weight is None else weight
    scale_inv = torch.ones(2, 2, 2) if scale_inv is None else scale_inv
    return Fp8BlockWeights(weight, scale_inv, block=block, **kwargs)


def mx(packed=None, scales=None, **kwargs):
    packed = quant_spec.random_packed((2, 5, 32)) if packed is None else packed
    scales = quant_spec.random_e8m0((2, 5, 2)) if scales is None else scales
    return Mxfp4Weights(packed, scales, **kwargs)


def nv(packed=None, block_scales=None, global_scales=None, **kwargs):
    packed = quant_spec.random_packed((2, 5, 24)) if packed is None else packed
    block_scales = e4m3((2, 5, 3)) if block_scales is None else block_scales
    global_scales = torch.ones(2) if global_scales is None else global_scales
    return Nvfp4Weights(packed, block_scales, global_scales, **kwargs)


def with_byte(tensor, index, byte):
    raw = tensor.view(torch.uint8).clone()
    raw[index] = byte
    return raw.view(tensor.dtype)


NAN_SCALE = torch.ones(2, 2, 2)
NAN_SCALE[1, 0, 1] = float("nan")
INF_SCALE = torch.ones(2, 2, 2, dtype=torch.bfloat16)
INF_SCALE[0, 1, 0] = float("inf")

CASES = {
    # fp8_block
    "fp8 weight dtype": (lambda: fp8(weight=torch.ones(2, 130, 200, dtype=torch.bfloat16)),
                         "weight: dtype torch.bfloat16 (shape (2, 130, 200)) is not allowed; expected torch.float8_e4m3fn"),
    "fp8 weight 2-D": (lambda: fp8(weight=e4m3((130, 200))),
                       "weight: shape (130, 200) has 2 dimensions; expected 3"),
    "fp8 scale rows": (lambda: fp8(scale_inv=torch.ones(2, 1, 2)),
                       "scale_inv: shape (2, 1, 2) does not match weight (shape (2, 130, 200)) in blocks of (128, 128)"
                       ": (experts, ceil(out_features / 128), ceil(in_features / 128)); expected (2, 2, 2)"),
    "fp8 partial block column forgotten": (lambda: fp8(scale_inv=torch.ones(2, 2, 1)),
                                           "scale_inv: shape (2, 2, 1) does not match weight"),
    "fp8 scale experts": (lambda: fp8(scale_inv=torch.ones(3, 2, 2)),
                          "scale_inv: shape (3, 2, 2) holds 3 experts but weight (shape (2, 130, 200)) holds 2; "
                          "expected (2, 2, 2)"),
    "fp8 scale dtype": (lambda: fp8(scale_inv=torch.ones(2, 2, 2, dtype=torch.float16)),
                        "scale_inv: dtype torch.float16 (shape (2, 2, 2)) is not allowed"),
    "fp8 uint8 scales": (lambda: fp8(scale_inv=torch.ones(2, 2, 2, dtype=torch.uint8)),
                         "scale_inv.view(torch.float8_e8m0fnu)"),
    "fp8 nan scale": (lambda: fp8(scale_inv=NAN_SCALE),
                      "scale_inv: a non-finite scale at index (1, 0, 1)"),
    "fp8 inf scale": (lambda: fp8(scale_inv=INF_SCALE),
                      "scale_inv: a non-finite scale at index (0, 1, 0)"),
    "fp8 block zero": (lambda: fp8(block=(0, 128)), "block[0]=0 is not allowed; expected an integer > 0"),
    "fp8 block one number": (lambda: fp8(block=(128,)), "block=(128,) is not allowed; expected two integers"),
    "fp8 devices": (lambda: fp8(scale_inv=torch.ones(2, 2, 2, device="meta")),
                    "scale_inv: on meta but weight on cpu"),
    "gate_up_rows name": (lambda: fp8(gate_up_rows="stacked"),
                          "gate_up_rows='stacked' is not allowed; expected 'concatenated', 'interleaved' or None"),
    "gate_up_rows odd rows": (lambda: fp8(weight=e4m3((2, 129, 200)), gate_up_rows="interleaved"),
                              "gate_up_rows='interleaved' needs an even out_features"),
    # mxfp4
    "mx K not a multiple of 32": (lambda: mx(packed=quant_spec.random_packed((2, 5, 8)),
                                             scales=quant_spec.random_e8m0((2, 5, 1))),
                                  "packed: shape (2, 5, 8) gives in_features (2 per byte) = 16, which is no multiple "
                                  "of 32 (one E8M0 scale per 32 elements)"),
    "mx packed dtype": (lambda: mx(packed=torch.ones(2, 5, 32, dtype=torch.float16)),
                        "packed: dtype torch.float16 (shape (2, 5, 32)) is not allowed; expected torch.uint8"),
    "mx packed 2-D": (lambda: mx(packed=quant_spec.random_packed((5, 32))),
                      "packed: shape (5, 32) has 2 dimensions; expected 3"),
    "mx blocks of 8": (lambda: mx(packed=quant_spec.random_packed((2, 5, 4, 8))),
                       "packed: shape (2, 5, 4, 8) is 4-D but its last dimension is not 16"),
    "mx blocks and scales": (lambda: mx(packed=quant_spec.random_packed((2, 5, 2, 16)),
                                        scales=quant_spec.random_e8m0((2, 5, 3))),
                             "scales: shape (2, 5, 3) does not match packed (shape (2, 5, 2, 16)): (experts, "
                             "out_features, in_features / 32); expected (2, 5, 2)"),
    "mx scales rows": (lambda: mx(scales=quant_spec.random_e8m0((2, 4, 2))),
                       "scales: shape (2, 4, 2) does not match packed (shape (2, 5, 32))"),
    "mx scale experts": (lambda: mx(scales=quant_spec.random_e8m0((1, 5, 2))),
                         "scales: shape (1, 5, 2) holds 1 experts but packed (shape (2, 5, 32)) holds 2"),
    "mx scale dtype": (lambda: mx(scales=torch.ones(2, 5, 2)),
                       "scales: dtype torch.float32 (shape (2, 5, 2)) is not allowed; expected torch.uint8"),
    "mx nan scale": (lambda: mx(scales=with_byte(quant_spec.random_e8m0((2, 5, 2)), (1, 3, 1), 255)),
                     "scales: E8M0 byte 255 (NaN) at index (1, 3, 1)"),
    "mx devices": (lambda: mx(scales=torch.ones(2, 5, 2, dtype=torch.uint8, device="meta")),
                   "scales: on meta but packed on cpu"),
    # nvfp4
    "nv K not a multiple of 16": (lambda: nv(packed=quant_spec.random_packed((2, 5, 4)), block_scales=e4m3((2, 5, 0))),
                                  "packed: shape (2, 5, 4) gives in_features (2 per byte) = 8, which is no multiple "
                                  "of 16 (one E4M3 scale per 16 elements)"),
    "nv block scale dtype": (lambda: nv(block_scales=torch.ones(2, 5, 3)),
                             "block_scales: dtype torch.float32 (shape (2, 5, 3)) is not allowed; expected "
                             "torch.float8_e4m3fn"),
    "nv block scale shape": (lambda: nv(block_scales=e4m3((2, 5, 6))),
                             "block_scales: shape (2, 5, 6) does not match packed (shape (2, 5, 24)): (experts, "
                             "out_features, in_features / 16); expected (2, 5, 3)"),
    "nv block scale nan": (lambda: nv(block_scales=with_byte(e4m3((2, 5, 3)), (0, 4, 2), 0xFF)),
                           "block_scales: E4M3 NaN at index (0, 4, 2)"),
    "nv global shape": (lambda: nv(global_scales=torch.ones(2, 1)),
                        "global_scales: shape (2, 1) does not match packed (shape (2, 5, 24)): one scale per expert; "
                        "expected (2,)"),
    "nv global experts": (lambda: nv(global_scales=torch.ones(3)),
                          "global_scales: shape (3,) holds 3 experts but packed (shape (2, 5, 24)) holds 2"),
    "nv global dtype": (lambda: nv(global_scales=torch.ones(2, dtype=torch.bfloat16)),
                        "global_scales: dtype torch.bfloat16 (shape (2,)) is not allowed; expected torch.float32"),
    "nv global inf": (lambda: nv(global_scales=torch.tensor([1.0, float("inf")])),
                      "global_scales: a non-finite scale at index (1,)"),
    "modelopt counts": (lambda: Nvfp4Weights.from_modelopt([quant_spec.random_packed((4, 8))] * 2, [e4m3((4, 1))],
                                                           [torch.tensor(1.0)] * 2),
                        "weight_scale: 1 tensors but weight has 2; expected one per expert"),
    "modelopt shapes": (lambda: Nvfp4Weights.from_modelopt(
        [quant_spec.random_packed((4, 8)), quant_spec.random_packed((4, 16))], [e4m3((4, 1))] * 2,
        [torch.tensor(1.0)] * 2), "weight[1]: shape (4, 16) does not match weight[0] (shape (4, 8)); expected (4, 8)"),
    "modelopt dtypes": (lambda: Nvfp4Weights.from_modelopt(
        [quant_spec.random_packed((4, 8))] * 2, [e4m3((4, 1))] * 2, [torch.tensor(1.0), torch.tensor(1.0).double()]),
        "weight_scale_2[1]: dtype torch.float64 (shape ()) is not allowed; expected torch.float32 (the dtype of "
        "weight_scale_2[0])"),
    "modelopt global not scalar": (lambda: Nvfp4Weights.from_modelopt(
        [quant_spec.random_packed((4, 8))], [e4m3((4, 1))], [torch.ones(2)]),
        "weight_scale_2[0]: shape (2,); expected a scalar"),
    "modelopt empty": (lambda: Nvfp4Weights.from_modelopt([], [], []), "weight: an empty sequence"),
    # quantizers
    "fp8 quantize nan": (lambda: Fp8BlockWeights.quantize(torch.ones(2, 3, 4).index_put_(
        (torch.tensor(1), torch.tensor(2), torch.tensor(3)), torch.tensor(float("nan")))),
        "weight: nan at index (1, 2, 3) (dtype torch.float32); a quantizer takes finite values only"),
    "fp8 quantize scale dtype": (lambda: Fp8BlockWeights.quantize(torch.ones(1, 3, 4), scale_dtype=torch.float16),
                                 "scale_dtype=torch.float16 is not allowed"),
    "fp8 quantize too large": (lambda: Fp8BlockWeights.quantize(torch.full((1, 3, 4), 1e300, dtype=torch.float64)),
                               "weight: expert 0's largest magnitude 1e+300 needs a scale beyond torch.float32's range"),
    "fp8 quantize int": (lambda: Fp8BlockWeights.quantize(torch.ones(1, 3, 4, dtype=torch.int32)),
                         "weight: dtype torch.int32 (shape (1, 3, 4)) is not allowed"),
    "fp8 quantize 2-D": (lambda: Fp8BlockWeights.quantize(torch.ones(3, 4)),
                         "weight: shape (3, 4) has 2 dimensions; expected 3"),
    "mx quantize K": (lambda: Mxfp4Weights.quantize(torch.ones(1, 3, 48)),
                      "weight: shape (1, 3, 48) gives in_features = 48, which is no multiple of 32"),
    "mx quantize inf": (lambda: Mxfp4Weights.quantize(torch.tensor([[[float("-inf")] * 32]])),
                        "weight: -inf at index (0, 0, 0)"),
    "mx quantize too large": (lambda: Mxfp4Weights.quantize(torch.full((2, 1, 32), 1e300, dtype=torch.float64)),
                              "weight: expert 0's largest magnitude 1e+300 needs a shared exponent above 127"),
    "nv quantize K": (lambda: Nvfp4Weights.quantize(torch.ones(1, 3, 24)),
                      "weight: shape (1, 3, 24) gives in_features = 24, which is no multiple of 16"),
    "nv quantize too large": (lambda: Nvfp4Weights.quantize(torch.full((1, 1, 16), 1e300, dtype=torch.float64)),
                              "weight: expert 0's largest magnitude 1e+300 needs a global scale beyond float32's"),
}

if FLOAT8_E8M0FNU is not None:
    CASES["fp8 ue8m0 nan"] = (
        lambda: fp8(scale_inv=with_byte(torch.ones(2, 2, 2, dtype=torch.uint8).view(FLOAT8_E8M0FNU), (0, 1, 1), 255)),
        "scale_inv: E8M0 byte 255 (NaN) at index (0, 1, 1)")
    CASES["fp8 quantize ue8m0 too large"] = (
        lambda: Fp8BlockWeights.quantize(torch.full((1, 1, 4), 1e300, dtype=torch.float64),
                                         scale_dtype=FLOAT8_E8M0FNU),
        "needs a scale above 2^127, the largest E8M0 scale")


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_a_value_error_naming_the_tensor(case):
    build, message = CASES[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


@pytest.mark.parametrize("build, message", [
    (lambda: Fp8BlockWeights([[1.0]], torch.ones(1, 1, 1), block=(1, 1)), "weight: expected a torch.Tensor, got list"),
    (lambda: Mxfp4Weights(quant_spec.random_packed((1, 1, 16)), 127), "scales: expected a torch.Tensor, got int"),
    (lambda: Nvfp4Weights(quant_spec.random_packed((1, 1, 8)), e4m3((1, 1, 1)), 1.0),
     "global_scales: expected a torch.Tensor, got float"),
    (lambda: fp8(block=(128.0, 128)), "block[0]: expected an integer, got float"),
    (lambda: Mxfp4Weights.quantize("weights"), "weight: expected a torch.Tensor, got str"),
])
def test_a_wrong_kind_of_object_raises_a_type_error(build, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        build()


@pytest.mark.parametrize("ids, error, message", [
    ([0, 5], ValueError, "ids: expert id 5 is out of range; expected ids in [0, 4)"),
    ([-1], ValueError, "ids: expert id -1 is out of range"),
    (torch.tensor([1, 4]), ValueError, "ids: expert id 4 is out of range"),
    (torch.tensor([1.0]), ValueError, "ids: dtype torch.float32, shape (1,); expected a 1-D integer tensor"),
    (torch.tensor([[1]]), ValueError, "ids: dtype torch.int64, shape (1, 1); expected a 1-D integer tensor"),
    ([True], TypeError, "ids: expected a slice, a sequence of ints or a 1-D integer tensor"),
    (slice(3, 0, -1), ValueError, "has step -1; expected a step > 0"),
])
def test_bad_expert_ids(ids, error, message):
    stack = mx(packed=quant_spec.random_packed((4, 5, 32)), scales=quant_spec.random_e8m0((4, 5, 2)))
    with pytest.raises(error, match=re.escape(message)):
        stack.select_experts(ids)


def test_a_bad_expert_index():
    stack = mx()
    with pytest.raises(ValueError, match=re.escape("index=2 is out of range; expected an expert id in [0, 2)")):
        stack.expert(2)
    with pytest.raises(ValueError, match=re.escape("index=-1 is out of range")):
        stack.expert(-1)
    with pytest.raises(TypeError, match="index: expected an int, got float"):
        stack.expert(1.0)

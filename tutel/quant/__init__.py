"""Quantized expert weights: typed stacks of packed codes and scales, in plain PyTorch.

One object holds one stack of E expert matrices (N, K) in one format, validated once when it is
built from checkpoint tensors, never dequantized whole except by ``dequantize_reference`` (the
specification's formula in float64, for tests):

* ``Fp8BlockWeights`` ("fp8_block"): float8_e4m3fn codes, one float32 / bfloat16 / E8M0 scale per
  (b0 x b1) block (DeepSeek-V3, transformers' FP8Experts);
* ``Mxfp4Weights`` ("mxfp4", OCP MX v1.0): E2M1 codes, one E8M0 scale per 32 elements (gpt-oss);
* ``Nvfp4Weights`` ("nvfp4"): E2M1 codes, one E4M3 scale per 16 elements and a float32 scale per
  matrix (ModelOpt).

Each offers ``quantize(weight, ...)`` for a floating (E, N, K) stack.  ``tutel.quant.codes`` holds
the element and scale codes they share.  This package imports nothing of tutel but itself
(docs/design.md, "Layers of the code"), so kernels and front ends at any layer can take its objects.
"""
from typing import Dict, Type

from .base import ExpertIds, GateUpRows, QuantizedWeights
from .fp8_block import Fp8BlockWeights
from .mxfp4 import Mxfp4Weights
from .nvfp4 import Nvfp4Weights

# format name -> class (QuantizedWeights.format)
FORMATS: Dict[str, Type[QuantizedWeights]] = {
    cls.format: cls for cls in (Fp8BlockWeights, Mxfp4Weights, Nvfp4Weights)}

__all__ = ["ExpertIds", "FORMATS", "Fp8BlockWeights", "GateUpRows", "Mxfp4Weights", "Nvfp4Weights",
           "QuantizedWeights"]

"""Hugging Face transformers' MoE models with their experts run by tutel.

Importing this package registers the experts implementation "tutel" in transformers'
``ExpertsInterface``::

    import tutel.integrations.transformers  # registers "tutel"
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="tutel")
    # or, on a model already built:
    model.set_experts_implementation("tutel")

Every experts class declared with ``@use_experts_implementation(...)`` (Mixtral, Qwen2/3-MoE,
DeepSeek-V2/V3, gpt-oss, OLMoE, GLM-4.5, PhiMoE and the other families of transformers 5.x) then
runs its experts through ``tutel.experts.routed_experts``: the routing metadata, the dispatch
into expert-sorted rows, the grouped expert GEMMs and the weighted combine, forward and backward,
traceable by ``torch.compile(fullgraph=True)``.  The model's router, shared experts and every
other layer are unchanged.  ``enable(model)`` checks every experts module first and raises
``UnsupportedExpertsLayout`` (naming the module class and the flag) for a layout tutel cannot
run; otherwise the same error comes at the module's first call.  A model with no experts module tutel
can run (a dense model; Llama 4, whose experts transformers does not dispatch) raises
``NoExpertsModule`` there.

transformers' FP8 experts (``FP8Experts``, fine-grained FP8 checkpoints such as DeepSeek-V3's),
which transformers dispatches through a registry of their own, run through "tutel" on the CPU and
CUDA (``fp8_experts``).

gpt-oss' MXFP4 experts, which transformers dequantizes at load on a CPU and runs outside the
registries on a GPU (``Mxfp4GptOssExperts``), keep their packed bytes with
``use_mxfp4_experts(model, expert_tensors)`` (``gpt_oss_mxfp4``; the CPU and CUDA).

Supported: transformers 5.7.0 (the first release whose ``experts_implementation`` accepts a
registered implementation) and later 5.x releases, tested against 5.7.0 and the newest; an older
release raises ``UnsupportedTransformersVersion`` (an ImportError) at this import.
"""
from .versions import UnsupportedTransformersVersion, check_supported

check_supported()

from .forward import tutel_experts_forward  # noqa: E402  (after the version check)
from .fp8_experts import Fp8ExpertsLayout, read_fp8_layout, tutel_fp8_experts_forward  # noqa: E402
from .gpt_oss_mxfp4 import TutelGptOssMxfp4Experts, use_mxfp4_experts  # noqa: E402
from .layout import ExpertsLayout, UnsupportedExpertsLayout, read_layout  # noqa: E402
from .registration import (NAME, NoExpertsModule, check_model, enable, experts_modules,  # noqa: E402
                           experts_registries, register)
from .replace import replace_moe_blocks  # noqa: E402

register()

__all__ = ["NAME", "ExpertsLayout", "Fp8ExpertsLayout", "NoExpertsModule", "UnsupportedExpertsLayout",
           "UnsupportedTransformersVersion", "check_model", "enable", "experts_modules", "experts_registries",
           "read_fp8_layout", "read_layout", "register", "replace_moe_blocks", "TutelGptOssMxfp4Experts",
           "tutel_experts_forward", "tutel_fp8_experts_forward", "use_mxfp4_experts"]

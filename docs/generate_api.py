"""Writes docs/api.md from the docstrings and signatures of the public API.

    python3 docs/generate_api.py            # rewrite docs/api.md
    python3 docs/generate_api.py --check    # exit 1 if docs/api.md is out of date

tests/python/test_docs_commands.py runs the check, so the reference follows the code.
"""
import importlib
import inspect
import os
import re
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
OUTPUT = os.path.join(HERE, "api.md")

# (section title, module, names or None for the module's __all__)
SECTIONS = [
    ("tutel.moe — the MoE layer and routing", "tutel.moe",
     ["moe_layer", "MOELayer.forward", "MOELayer.update_selection_bias", "MOELayer.quantize_experts",
      "update_selection_biases",
      "top_k_routing", "fast_encode", "fast_decode", "fast_dispatcher",
      "fast_cumsum_sub_one", "get_dispatch_count"]),
    ("Gates (`gate_type={'type': ...}`)", "tutel.gates", ["top.LinearTopKGate", "cosine_top.CosineTopKGate"]),
    ("Experts (`experts={'type': ...}`)", "tutel.experts", ["ffn.FusedExpertsNetwork", "llama_ffn.LlamaFFNNetwork",
                                                          "clamped_swiglu.ClampedSwiGLUExperts",
                                                          "quantized_swiglu.QuantizedSwiGLUExperts",
                                                          "shared.SharedExperts"]),
    ("tutel.net — collectives", "tutel.net", None),
    ("tutel.system — processes and helpers", "tutel.system",
     ["init_data_model_parallel", "get_local_session", "record_time", "cache", "LocalCache", "save", "load",
      "apply_rank_size_from_pattern", "init_affinity_at_program_beginning"]),
    ("tutel.checkpoint — checkpoints across world sizes", "tutel.checkpoint",
     ["load_resharded", "gather_state_dicts", "scatter_state_dict", "reshard_state_dicts", "Placement",
      "ExpertCoverageError", "ShapeError"]),
    ("tutel.torch_versions — the PyTorch releases supported", "tutel.torch_versions",
     ["check_supported", "is_supported", "release", "UnsupportedTorchVersion"]),
    ("tutel.ops — Tutel's fast gating calls", "tutel.ops.tutel_gating_calls",
     ["qwen3_moe_scaled_topk", "deepseek_moe_sigmoid_scaled_topk", "kimi_moe_sigmoid_scaled_topk"]),
    ("tutel.ops.host_buffers — the CPU operators' buffer cache", "tutel.ops.host_buffers",
     ["cached_buffer_stats", "release_cached_buffers", "set_cached_buffer_limit"]),
    ("tutel.ops.decode_experts — routed gated experts at decoding sizes", "tutel.ops.decode_experts",
     ["decode_experts", "decode_experts_supported"]),
    ("tutel.ops.decode_quantized_experts — routed experts with quantized weights on the CPU",
     "tutel.ops.decode_quantized_experts",
     ["decode_quantized_experts", "quantized_decode_kernels", "quantized_decode_kernel_sets",
      "set_quantized_decode_kernels", "using_quantized_decode_kernels"]),
    ("tutel.ops.quantized_linear — rows grouped by expert times a quantized stack on the CPU",
     "tutel.ops.quantized_linear",
     ["quantized_grouped_linear", "quantized_linear_kernels", "quantized_linear_kernel_sets",
      "set_quantized_linear_kernels", "using_quantized_linear_kernels"]),
    ("tutel.ops.decode_lines — where the decode kernel hands over to the grouped path", "tutel.ops.decode_lines",
     ["DecodeLine", "read_lines", "write_lines", "merge_lines", "lines_in_effect", "device_capability", "line_for",
      "within_line"]),
]


def _resolve(module, dotted):
    obj = module
    for part in dotted.split("."):
        if not hasattr(obj, part):
            obj = importlib.import_module(f"{obj.__name__}.{part}")
        else:
            obj = getattr(obj, part)
    return obj


def _signature(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return "(...)"
    parameters = [p for name, p in signature.parameters.items() if name != "self"]
    text = str(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))
    text = re.sub(r" at 0x[0-9a-f]+", "", text)  # default values that are functions
    return re.sub(r"<function (\w+)>", r"\1", text)


def _own_doc(obj) -> "str | None":
    """obj's docstring when tutel's code wrote it, else None.  inspect.getdoc would fall back to what
    a base class says (nn.Module.__init__'s "Initialize internal Module state, ..."), which describes
    PyTorch or Python, not the documented object."""
    doc = getattr(obj, "__doc__", None)
    if not doc or (getattr(obj, "__module__", None) or "").split(".")[0] != "tutel":
        return None
    return inspect.cleandoc(doc)


def _entry(module, name):
    obj = _resolve(module, name)
    doc = _own_doc(obj) or "(no docstring)"
    if inspect.isclass(obj) and _own_doc(obj.__init__):
        doc += "\n\n" + _own_doc(obj.__init__)
    title = f"{module.__name__}.{name}"
    return f"### `{title}{_signature(obj)}`\n\n```text\n{doc}\n```\n"


def render() -> str:
    parts = ["# API reference\n",
             "Generated from the docstrings by `python3 docs/generate_api.py` (do not edit by hand). Tutel's "
             "names, arguments and defaults; see [migration.md](migration.md) for the behaviour we changed.\n"]
    for title, module_name, names in SECTIONS:
        module = importlib.import_module(module_name)
        parts.append(f"## {title}\n")
        if inspect.getdoc(module):
            parts.append(inspect.getdoc(module) + "\n")
        for name in names if names is not None else sorted(module.__all__):
            parts.append(_entry(module, name))
    return "\n".join(parts)


def main(argv) -> int:
    from generated_page import write_or_check  # beside this script

    sys.path.insert(0, os.path.dirname(HERE))
    return write_or_check(OUTPUT, render(), argv, "docs/generate_api.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""How each transformers family's sparse-MoE block maps onto a ``tutel.moe.moe_layer``.

A block is recognised by its class name and read into a ``BlockLayout``: the router's tensors
and routing rule as a tutel gate dict, the routed experts' layout (read by ``layout.read_layout``,
the reader the experts implementation uses too) and the tutel experts type it maps onto, the
shared experts, and the block's calling convention.  ``read_block`` checks everything it reads and
raises ``UnsupportedMoeBlock`` naming the module and the attribute or setting tutel cannot
reproduce exactly.

Families (transformers 5.x class names):

==========================  ====================  ============================================
block class                 router                shared experts
==========================  ====================  ============================================
MixtralSparseMoeBlock       softmax, renormalised none
Qwen2MoeSparseMoeBlock      softmax (norm_topk)   sigmoid-gated ``shared_expert``
Qwen3MoeSparseMoeBlock      softmax (norm_topk)   none
OlmoeSparseMoeBlock         softmax (norm_topk)   none
DeepseekV3MoE, Glm4MoeMoE   sigmoid, bias, groups ``shared_experts``
GptOssMLP                   biased, top-k softmax none
Llama4TextMoe               sigmoid, score first  ``shared_expert``
==========================  ====================  ============================================

Routed experts whose layout is SwiGLU without biases (Mixtral's ``gate_up_proj`` [E, 2I, H], Llama
4's transposed [E, H, 2I], ...) become ``llama_ffn`` experts; gpt-oss's clamped interleaved unit with
biases on transposed weights becomes ``clamped_swiglu``.  transformers' FP8 experts (``FP8Experts``:
block-FP8 codes and scales, SwiGLU) become ``quantized_swiglu`` experts over the same codes and scales.
"""
from typing import Any, Dict, NamedTuple, Optional, Union

import torch

from ...ops.gated_units import SWIGLU, GatedUnit
from .fp8_experts import Fp8ExpertsLayout, is_fp8_experts, read_fp8_layout
from .layout import ExpertsLayout, UnsupportedExpertsLayout, has_default_gate, is_silu, read_layout
from .versions import installed_version


class UnsupportedMoeBlock(ValueError):
    """A transformers MoE block that ``replace_moe_blocks`` cannot turn into an equal moe_layer."""

    def __init__(self, name: str, module: torch.nn.Module, problem: str):
        self.module_name, self.module_class, self.problem = name, type(module).__name__, problem
        super().__init__(f"replace_moe_blocks: module '{name}' ({self.module_class}): {problem}")


class BlockLayout(NamedTuple):
    """Everything needed to build and fill the moe_layer that replaces one block."""
    family: str
    model_dim: int
    num_experts: int
    gate: Dict[str, Any]                      # gate dict options (routing rule, k)
    logits: str                               # TransformersRouter's logits mode
    router: torch.nn.Module                   # holds ``weight`` [E, H] (and ``bias`` for gpt-oss)
    selection_bias: Optional[torch.Tensor]    # e_score_correction_bias [E]
    experts: torch.nn.Module
    experts_layout: Union[ExpertsLayout, Fp8ExpertsLayout]  # the routed experts, as the experts
                                              # implementation reads them (Fp8ExpertsLayout: FP8 experts)
    experts_type: str                         # the tutel experts type: 'llama_ffn', 'clamped_swiglu', or
                                              # 'quantized_swiglu' (FP8 experts, their stacks kept)
    shared: Optional[torch.nn.Module]         # gate_proj / up_proj / down_proj MLP
    shared_gate: Optional[torch.nn.Module]    # Linear(H, 1) of Qwen2-MoE
    is_postscore: bool
    returns: str                              # 'hidden', 'hidden_and_weights' or 'hidden_and_logits'


# family: (router attribute, routing rule, shared attribute, shared-gate attribute, returns)
_FAMILIES = {
    "MixtralSparseMoeBlock": ("mixtral", "gate", "softmax_renormalised", None, None, "hidden"),
    "Qwen2MoeSparseMoeBlock": ("qwen2_moe", "gate", "softmax", "shared_expert", "shared_expert_gate", "hidden"),
    "Qwen3MoeSparseMoeBlock": ("qwen3_moe", "gate", "softmax", None, None, "hidden"),
    "OlmoeSparseMoeBlock": ("olmoe", "gate", "softmax", None, None, "hidden"),
    "DeepseekV3MoE": ("deepseek_v3", "gate", "sigmoid_grouped", "shared_experts", None, "hidden"),
    "Glm4MoeMoE": ("glm4_moe", "gate", "sigmoid_grouped", "shared_experts", None, "hidden"),
    "GptOssMLP": ("gpt_oss", "router", "topk_softmax", None, None, "hidden_and_weights"),
    "Llama4TextMoe": ("llama4", "router", "sigmoid_before_expert", "shared_expert", None, "hidden_and_logits"),
}

SUPPORTED_BLOCKS = tuple(_FAMILIES)


def is_known_block(module: torch.nn.Module) -> bool:
    """Whether `module` is one of the sparse-MoE block classes of ``SUPPORTED_BLOCKS``."""
    return type(module).__name__ in _FAMILIES


def looks_like_moe_block(module: torch.nn.Module) -> bool:
    """Whether `module` holds routed experts: a child ``experts`` with 3-D stacked expert weights
    (transformers 5.x) or a ModuleList / ModuleDict of experts beside a gate / router."""
    experts = getattr(module, "experts", None)
    if not isinstance(experts, torch.nn.Module):
        return False
    stacked = any(p.dim() == 3 for p in experts.parameters(recurse=False))
    listed = isinstance(experts, (torch.nn.ModuleList, torch.nn.ModuleDict)) and \
        any(hasattr(module, n) for n in ("gate", "router"))
    return stacked or listed


def _child(name: str, block: torch.nn.Module, attribute: str) -> torch.nn.Module:
    child = getattr(block, attribute, None)
    if not isinstance(child, torch.nn.Module):
        raise UnsupportedMoeBlock(name, block, f"expected a submodule `{attribute}`, found {type(child).__name__}")
    return child


def _tensor(name: str, block: torch.nn.Module, owner: torch.nn.Module, attribute: str, shape) -> torch.Tensor:
    tensor = getattr(owner, attribute, None)
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise UnsupportedMoeBlock(name, block, f"`{type(owner).__name__}.{attribute}` must be a floating-point "
                                               f"tensor, found {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise UnsupportedMoeBlock(name, block, f"`{type(owner).__name__}.{attribute}` has shape "
                                               f"{tuple(tensor.shape)}, expected {tuple(shape)}")
    return tensor


def _require_silu(name: str, block: torch.nn.Module, owner: torch.nn.Module) -> None:
    """The experts' activation must compute SiLU exactly (tutel's SwiGLU experts use F.silu)."""
    act_fn = getattr(owner, "act_fn", None) or getattr(owner, "activation_fn", None)  # Llama 4's MLP: activation_fn
    if not is_silu(act_fn):
        raise UnsupportedMoeBlock(name, block, f"the activation of `{type(owner).__name__}` is {act_fn!r}; only SiLU "
                                               f"(hidden_act='silu') experts can be replaced")


def _read_fp8_experts(name: str, block: torch.nn.Module, experts: torch.nn.Module, model_dim: int):
    """(FP8 experts' layout, 'quantized_swiglu'): SwiGLU experts over block-FP8 stacks."""
    try:
        layout = read_fp8_layout(experts)
    except UnsupportedExpertsLayout as error:
        raise UnsupportedMoeBlock(name, block, f"its FP8 experts: {error}") from error
    if layout.unit != SWIGLU or layout.gate_fn is not None or layout.activation is not None:
        raise UnsupportedMoeBlock(name, block, f"its FP8 experts ({type(experts).__name__}) are not SwiGLU experts "
                                               f"(transformers' own gate with a SiLU act_fn)")
    if layout.expert_parallel:
        raise UnsupportedMoeBlock(name, block, f"its FP8 experts ({type(experts).__name__}) hold one process's "
                                               f"share of the experts (_is_expert_parallel)")
    if layout.model_dim != model_dim:
        raise UnsupportedMoeBlock(name, block, f"the router takes tokens of {model_dim} features, the experts "
                                               f"{layout.model_dim}")
    return layout, "quantized_swiglu"


def _read_experts(name: str, block: torch.nn.Module, experts: torch.nn.Module, model_dim: int):
    """(the routed experts' layout, the tutel experts type holding them exactly)."""
    if is_fp8_experts(experts):
        return _read_fp8_experts(name, block, experts, model_dim)
    try:
        layout = read_layout(experts)
    except UnsupportedExpertsLayout as error:
        raise UnsupportedMoeBlock(name, block, f"its experts: {error}") from error
    if layout.model_dim != model_dim:
        raise UnsupportedMoeBlock(name, block, f"the router takes tokens of {model_dim} features, the experts "
                                               f"{layout.model_dim}")
    if layout.inner_dim < 1:
        raise UnsupportedMoeBlock(name, block, "the experts' gate_up_proj has no hidden units")
    unit = layout.gate
    if isinstance(unit, GatedUnit) and unit.up_offset == 1.0 and layout.transposed and layout.up_bias is not None \
            and layout.post_fn is None:
        return layout, "clamped_swiglu"  # gpt-oss's own unit and layout
    if unit == "swiglu" and layout.up_bias is None and layout.post_fn is None:
        return layout, "llama_ffn"
    if unit is None and layout.activation is None and has_default_gate(experts):
        _require_silu(name, block, experts)  # names a gate rule of another activation
    raise UnsupportedMoeBlock(name, block, f"the experts ({type(experts).__name__}) are not SwiGLU experts without "
                                           f"biases or post-expert norm, nor gpt-oss's clamped unit with biases")


def _integer(name: str, block: torch.nn.Module, owner: torch.nn.Module, attribute: str) -> int:
    value = getattr(owner, attribute, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedMoeBlock(name, block, f"`{type(owner).__name__}.{attribute}` must be an integer >= 1, "
                                               f"found {value!r}")
    return value


def _routing(name: str, block: torch.nn.Module, router: torch.nn.Module, rule: str):
    """(gate options, logits mode, is_postscore) reproducing the family's router."""
    # The settings are read where the release's routing code reads them: the block where it routes
    # the tokens itself (DeepSeek-V3 and GLM-4.5 before transformers 5.13), else the router.
    settings = block if callable(getattr(type(block), "route_tokens_to_experts", None)) else router
    k = _integer(name, block, settings, "top_k")
    if rule == "softmax_renormalised":  # Mixtral: softmax in float32 over the model-dtype logits
        jitter = getattr(block, "jitter_noise", 0.0) or 0.0
        if jitter > 0:
            raise UnsupportedMoeBlock(name, block, f"router_jitter_noise={jitter} (a multiplicative input noise "
                                                   f"in training) has no tutel equivalent; set it to 0")
        return {"k": k, "renormalize": True, "balance_loss": "global_batch"}, "float32_logits", True
    if rule == "softmax":  # Qwen2/3-MoE, OLMoE: softmax(dtype=float32), optional renormalisation
        return ({"k": k, "renormalize": bool(getattr(settings, "norm_topk_prob", False)),
                 "balance_loss": "global_batch"}, "float32_logits", True)
    if rule == "sigmoid_grouped":  # DeepSeek-V3, GLM-4.5: float32 router, bias, group-limited top-k
        scale = getattr(settings, "routed_scaling_factor", 1.0)
        options = {"k": k, "score_function": "sigmoid", "selection_bias": True,
                   "renormalize": bool(getattr(settings, "norm_topk_prob", False)),
                   "routed_scaling_factor": float(scale), "balance_loss": "sequence"}
        n_group = getattr(settings, "num_group", getattr(settings, "n_group", None))  # "n_group" before 5.13
        topk_group = getattr(settings, "topk_group", None)
        if n_group is not None or topk_group is not None:  # the layer names any contradiction
            options.update(n_group=n_group, topk_group=topk_group)
        return options, "float32_inputs", True
    if rule == "topk_softmax":  # gpt-oss: biased logits, softmax over the k chosen, model dtype
        return {"k": k, "router_bias": True, "softmax_after_topk": True, "balance_loss": "global_batch"}, \
            "model", True
    if rule == "sigmoid_before_expert":  # Llama 4: sigmoid (float32) of the chosen logits, before the expert
        return {"k": k, "score_function": "sigmoid", "renormalize": False, "balance_loss": "none"}, \
            "float32_logits", False
    raise AssertionError(rule)


def read_block(name: str, block: torch.nn.Module) -> BlockLayout:
    """Reads one sparse-MoE block of a ``SUPPORTED_BLOCKS`` class (``name`` is its path in the
    model, for messages).  Raises UnsupportedMoeBlock for anything tutel cannot reproduce; for a
    block of a known family the message names the family and the installed transformers release."""
    entry = _FAMILIES.get(type(block).__name__)
    if entry is None:
        raise UnsupportedMoeBlock(name, block, f"no known layout; supported blocks: {', '.join(SUPPORTED_BLOCKS)}")
    try:
        return _read_family_block(name, block, *entry)
    except UnsupportedMoeBlock as error:
        raise UnsupportedMoeBlock(name, block, f"{error.problem} (family {entry[0]}, transformers "
                                               f"{installed_version()})") from None


def _read_family_block(name: str, block: torch.nn.Module, family: str, router_attr: str, rule: str,
                       shared_attr: Optional[str], shared_gate_attr: Optional[str], returns: str) -> BlockLayout:
    """read_block for a block of a known family, its ``_FAMILIES`` entry spread out."""
    router = _child(name, block, router_attr)
    experts = _child(name, block, "experts")
    num_experts = _integer(name, block, experts, "num_experts")
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != num_experts:
        raise UnsupportedMoeBlock(name, block, f"`{router_attr}.weight` must be [num_experts={num_experts}, "
                                               f"hidden], found {getattr(weight, 'shape', None)}")
    model_dim = weight.shape[1]
    gate, logits, is_postscore = _routing(name, block, router, rule)
    if gate["k"] > num_experts:
        raise UnsupportedMoeBlock(name, block, f"top_k={gate['k']} exceeds the {num_experts} experts")

    experts_layout, experts_type = _read_experts(name, block, experts, model_dim)
    E, H = num_experts, model_dim
    if experts_type == "clamped_swiglu":
        _tensor(name, block, router, "bias", (E,))

    selection_bias = None
    if gate.get("selection_bias"):
        selection_bias = _tensor(name, block, router, "e_score_correction_bias", (E,))
    shared = shared_gate = None
    if shared_attr is not None:
        shared = _child(name, block, shared_attr)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(shared, proj, None)
            if not isinstance(linear, torch.nn.Linear) or linear.bias is not None:
                raise UnsupportedMoeBlock(name, block, f"`{shared_attr}.{proj}` must be a Linear without bias")
        _require_silu(name, block, shared)
    if shared_gate_attr is not None:
        shared_gate = _child(name, block, shared_gate_attr)
        if not isinstance(shared_gate, torch.nn.Linear) or shared_gate.bias is not None or \
                tuple(shared_gate.weight.shape) != (1, H):
            raise UnsupportedMoeBlock(name, block, f"`{shared_gate_attr}` must be a Linear({H}, 1) without bias")
    return BlockLayout(family, H, E, gate, logits, router, selection_bias, experts, experts_layout, experts_type,
                       shared, shared_gate, is_postscore, returns)

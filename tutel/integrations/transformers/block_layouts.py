"""How each transformers family's sparse-MoE block maps onto a ``tutel.moe.moe_layer``.

A block is recognised by its class name (so nothing of transformers is imported here) and read
into a ``BlockLayout``: the router's tensors and routing rule as a tutel gate dict, the routed
experts' tensors and their layout, the shared experts, and the block's calling convention.
``read_block`` checks everything it reads and raises ``UnsupportedMoeBlock`` naming the module
and the attribute or setting tutel cannot reproduce exactly.

Families (transformers 5.x class names):

==========================  ====================  ============================================
block class                 router                experts / shared experts
==========================  ====================  ============================================
MixtralSparseMoeBlock       softmax, renormalised gate_up_proj [E, 2I, H] (gate rows first)
Qwen2MoeSparseMoeBlock      softmax (norm_topk)   same + sigmoid-gated ``shared_expert``
Qwen3MoeSparseMoeBlock      softmax (norm_topk)   same
OlmoeSparseMoeBlock         softmax (norm_topk)   same
DeepseekV3MoE, Glm4MoeMoE   sigmoid, bias, groups same + ``shared_experts``
GptOssMLP                   biased, top-k softmax clamped SwiGLU, interleaved, with biases
Llama4TextMoe               sigmoid, score first  gate_up_proj [E, H, 2I] + ``shared_expert``
==========================  ====================  ============================================
"""
from typing import Any, Dict, NamedTuple, Optional

import torch
import torch.nn.functional as F


class UnsupportedMoeBlock(ValueError):
    """A transformers MoE block that ``replace_moe_blocks`` cannot turn into an equal moe_layer."""

    def __init__(self, name: str, module: torch.nn.Module, problem: str):
        self.module_name, self.module_class = name, type(module).__name__
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
    experts_kind: str                         # 'rows', 'columns' (llama_ffn) or 'gpt_oss' (clamped_swiglu)
    hidden_size: int                          # I, per expert
    shared: Optional[torch.nn.Module]         # gate_proj / up_proj / down_proj MLP
    shared_gate: Optional[torch.nn.Module]    # Linear(H, 1) of Qwen2-MoE
    is_postscore: bool
    returns: str                              # 'hidden', 'hidden_and_weights' or 'hidden_and_logits'


# family: (router attribute, routing rule, experts kind, shared attribute, shared-gate attribute, returns)
_FAMILIES = {
    "MixtralSparseMoeBlock": ("mixtral", "gate", "softmax_renormalised", "rows", None, None, "hidden"),
    "Qwen2MoeSparseMoeBlock": ("qwen2_moe", "gate", "softmax", "rows", "shared_expert", "shared_expert_gate",
                               "hidden"),
    "Qwen3MoeSparseMoeBlock": ("qwen3_moe", "gate", "softmax", "rows", None, None, "hidden"),
    "OlmoeSparseMoeBlock": ("olmoe", "gate", "softmax", "rows", None, None, "hidden"),
    "DeepseekV3MoE": ("deepseek_v3", "gate", "sigmoid_grouped", "rows", "shared_experts", None, "hidden"),
    "Glm4MoeMoE": ("glm4_moe", "gate", "sigmoid_grouped", "rows", "shared_experts", None, "hidden"),
    "GptOssMLP": ("gpt_oss", "router", "topk_softmax", "gpt_oss", None, None, "hidden_and_weights"),
    "Llama4TextMoe": ("llama4", "router", "sigmoid_before_expert", "columns", "shared_expert", None,
                      "hidden_and_logits"),
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
    probe = torch.linspace(-6, 6, 25, dtype=torch.float64)
    if not callable(act_fn) or not torch.equal(act_fn(probe), F.silu(probe)):
        raise UnsupportedMoeBlock(name, block, f"the activation of `{type(owner).__name__}` is {act_fn!r}; only SiLU "
                                               f"(hidden_act='silu') experts can be replaced")


def _integer(name: str, block: torch.nn.Module, owner: torch.nn.Module, attribute: str) -> int:
    value = getattr(owner, attribute, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedMoeBlock(name, block, f"`{type(owner).__name__}.{attribute}` must be an integer >= 1, "
                                               f"found {value!r}")
    return value


def _routing(name: str, block: torch.nn.Module, router: torch.nn.Module, rule: str):
    """(gate options, logits mode, is_postscore) reproducing the family's router."""
    k = _integer(name, block, router, "top_k")
    if rule == "softmax_renormalised":  # Mixtral: softmax in float32 over the model-dtype logits
        jitter = getattr(block, "jitter_noise", 0.0) or 0.0
        if jitter > 0:
            raise UnsupportedMoeBlock(name, block, f"router_jitter_noise={jitter} (a multiplicative input noise "
                                                   f"in training) has no tutel equivalent; set it to 0")
        return {"k": k, "renormalize": True, "balance_loss": "global_batch"}, "float32_logits", True
    if rule == "softmax":  # Qwen2/3-MoE, OLMoE: softmax(dtype=float32), optional renormalisation
        return ({"k": k, "renormalize": bool(getattr(router, "norm_topk_prob", False)),
                 "balance_loss": "global_batch"}, "float32_logits", True)
    if rule == "sigmoid_grouped":  # DeepSeek-V3, GLM-4.5: float32 router, bias, group-limited top-k
        scale = getattr(router, "routed_scaling_factor", 1.0)
        options = {"k": k, "score_function": "sigmoid", "selection_bias": True,
                   "renormalize": bool(getattr(router, "norm_topk_prob", False)),
                   "routed_scaling_factor": float(scale), "balance_loss": "sequence"}
        n_group, topk_group = getattr(router, "num_group", None), getattr(router, "topk_group", None)
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
    model, for messages).  Raises UnsupportedMoeBlock for anything tutel cannot reproduce."""
    entry = _FAMILIES.get(type(block).__name__)
    if entry is None:
        raise UnsupportedMoeBlock(name, block, f"no known layout; supported blocks: {', '.join(SUPPORTED_BLOCKS)}")
    family, router_attr, rule, kind, shared_attr, shared_gate_attr, returns = entry
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

    E, H = num_experts, model_dim
    if kind == "rows":
        up = getattr(experts, "gate_up_proj", None)
        inner = up.shape[1] // 2 if isinstance(up, torch.Tensor) and up.dim() == 3 else -1
        _tensor(name, block, experts, "gate_up_proj", (E, 2 * inner, H))
        _tensor(name, block, experts, "down_proj", (E, H, inner))
        _require_silu(name, block, experts)
        for flag, allowed in (("has_bias", False), ("is_transposed", False), ("is_concatenated", True)):
            if getattr(experts, flag, allowed) is not allowed:
                raise UnsupportedMoeBlock(name, block, f"experts flag {flag}={getattr(experts, flag)!r}; "
                                                       f"this family's layout has {flag}={allowed}")
    elif kind == "columns":
        up = getattr(experts, "gate_up_proj", None)
        inner = up.shape[2] // 2 if isinstance(up, torch.Tensor) and up.dim() == 3 else -1
        _tensor(name, block, experts, "gate_up_proj", (E, H, 2 * inner))
        _tensor(name, block, experts, "down_proj", (E, inner, H))
        _require_silu(name, block, experts)
    else:  # gpt_oss
        up = getattr(experts, "gate_up_proj", None)
        inner = up.shape[2] // 2 if isinstance(up, torch.Tensor) and up.dim() == 3 else -1
        _tensor(name, block, experts, "gate_up_proj", (E, H, 2 * inner))
        _tensor(name, block, experts, "gate_up_proj_bias", (E, 2 * inner))
        _tensor(name, block, experts, "down_proj", (E, inner, H))
        _tensor(name, block, experts, "down_proj_bias", (E, H))
        _tensor(name, block, router, "bias", (E,))
    if inner < 1:
        raise UnsupportedMoeBlock(name, block, "the experts' gate_up_proj has no hidden units")

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
    return BlockLayout(family, H, E, gate, logits, router, selection_bias, experts, kind, inner, shared,
                       shared_gate, is_postscore, returns)

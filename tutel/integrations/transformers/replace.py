"""``replace_moe_blocks``: every sparse-MoE block of a transformers model becomes a tutel moe_layer.

The new layers hold the blocks' weights -- the same tensors where the layouts agree (routers,
shared experts, gpt-oss's experts on one process), copies otherwise (the SwiGLU experts, stored
flat by ``llama_ffn``; transformers' FP8 experts keep their block-FP8 codes and scales, in
``quantized_swiglu`` experts) -- route dropless by default, and compute what the blocks computed.  They
then offer tutel's per-call switches, ``l_aux``, expert parallelism over a process group and the
checkpoint tools (``tutel.checkpoint``).  Every block is read and its layer built before the
first one is swapped in, so an error leaves the model untouched.
"""
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ...collectives.process_groups import get_world_rank, get_world_size
from ...impls.moe_layer import MOELayer
from .block_layouts import (SUPPORTED_BLOCKS, BlockLayout, UnsupportedMoeBlock, is_known_block, looks_like_moe_block,
                            read_block)
from .replaced_layer import CALL_SWITCHES, ReplacedMoeBlock, TransformersRouter

# Gate options replace_moe_blocks accepts besides the per-call switches (they override the family's).
GATE_OVERRIDES = ("balance_loss", "z_loss_weight", "bias_update_rate", "gate_noise")


def find_moe_blocks(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(name, module) of every sparse-MoE block of `model`, known or not, outermost first (a block's
    own submodules are not searched)."""
    found: List[Tuple[str, torch.nn.Module]] = []

    def visit(prefix: str, module: torch.nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if isinstance(child, MOELayer):
                continue  # already a tutel layer
            if is_known_block(child) or looks_like_moe_block(child):
                found.append((name, child))
            else:
                visit(name, child)
    visit("", model)
    return found


def _split_options(switches: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    unknown = [name for name in switches if name not in CALL_SWITCHES + GATE_OVERRIDES]
    if unknown:
        raise TypeError(f"replace_moe_blocks: unknown option(s) {unknown}; allowed: per-call switches "
                        f"{', '.join(CALL_SWITCHES)} and gate options {', '.join(GATE_OVERRIDES)}")
    calls = {name: value for name, value in switches.items() if name in CALL_SWITCHES}
    gates = {name: value for name, value in switches.items() if name in GATE_OVERRIDES}
    return calls, gates


def _build_layer(name: str, block: torch.nn.Module, layout: BlockLayout, group, call_defaults: Dict[str, Any],
                 gate_overrides: Dict[str, Any]) -> ReplacedMoeBlock:
    """A moe_layer for one block, its weights loaded; raises naming the module on any contradiction."""
    world_size = get_world_size(group)
    if layout.num_experts % world_size != 0:
        raise UnsupportedMoeBlock(name, block, f"num_experts={layout.num_experts} cannot be split over "
                                                f"the group's {world_size} processes (it must divide them)")
    gate = dict(layout.gate, type="custom", module=TransformersRouter, logits=layout.logits, capacity_factor=0.0)
    gate.update(gate_overrides)
    local_experts = layout.num_experts // world_size
    experts: Dict[str, Any] = {"type": layout.experts_type, "num_experts_per_device": local_experts}
    if layout.experts_type == "quantized_swiglu":  # FP8 experts: this process's share of their stacks, kept
        experts.update(_fp8_stacks(layout.experts_layout, get_world_rank(group) * local_experts, local_experts))
    else:
        experts["hidden_size_per_expert"] = layout.experts_layout.inner_dim
    if layout.experts_type == "clamped_swiglu":
        unit = layout.experts_layout.gate
        experts.update(alpha=unit.alpha, limit=unit.limit, interleaved=unit.interleaved)
    if layout.shared is not None:
        experts["shared_experts"] = {"hidden_size": layout.shared.gate_proj.out_features,
                                     "gated": layout.shared_gate is not None}
    # the experts' device and dtype (the router's for FP8 experts: the model's dtype)
    reference = layout.router.weight if layout.experts_type == "quantized_swiglu" else \
        layout.experts_layout.down_weight
    try:
        with torch.random.fork_rng(devices=[]):  # the throw-away initialisation leaves the user's RNG alone
            layer = ReplacedMoeBlock(call_defaults=call_defaults, returns=layout.returns, family=layout.family,
                                     gate_type=gate, model_dim=layout.model_dim, experts=experts, group=group,
                                     is_postscore=layout.is_postscore)
        layer.check_switches(call_defaults, "replace_moe_blocks")
    except (ValueError, TypeError) as error:
        raise UnsupportedMoeBlock(name, block, str(error)) from error
    layer.to(device=reference.device, dtype=reference.dtype)
    _load_weights(layer, layout, get_world_rank(group), world_size)
    layer.train(layout.experts.training)
    return layer


def _fp8_stacks(fp8, first: int, count: int) -> Dict[str, Any]:
    """The quantized_swiglu experts options of an Fp8ExpertsLayout: the stacks of experts first ..
    first + count - 1 (views of the module's codes and scales), the unit and the activations."""
    local = slice(first, first + count)
    return {"up": fp8.up.select_experts(local), "down": fp8.down.select_experts(local),
            "gate_weight": None if fp8.gate_weight is None else fp8.gate_weight.select_experts(local),
            "unit": fp8.unit, "activations": fp8.activations}


def _local(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This process's experts (rows rank*L .. rank*L + L - 1 of the leading dim)."""
    if world_size == 1:
        return tensor
    local = tensor.shape[0] // world_size
    return tensor[rank * local:(rank + 1) * local]


def _share_parameter(owner: torch.nn.Module, attribute: str, tensor: torch.Tensor, expert: bool) -> None:
    """owner.<attribute> becomes `tensor` itself when it is a Parameter, else a Parameter on a copy."""
    param = tensor if isinstance(tensor, torch.nn.Parameter) else torch.nn.Parameter(tensor.detach().clone())
    if expert:
        param._tutel_expert = True
    setattr(owner, attribute, param)


def _load_weights(layer: ReplacedMoeBlock, layout: BlockLayout, rank: int, world_size: int) -> None:
    gate = layer.gates[0]
    _share_parameter(gate.wg, "weight", layout.router.weight, expert=False)
    if gate.wg.bias is not None:
        _share_parameter(gate.wg, "bias", layout.router.bias, expert=False)
    with torch.no_grad():
        if layout.selection_bias is not None:
            gate.selection_bias.bias.copy_(layout.selection_bias)
        experts = layout.experts_layout
        if layout.experts_type == "quantized_swiglu":
            pass  # the layer was built over the FP8 experts' own stacks
        elif layout.experts_type == "clamped_swiglu":  # the same layout: shared on one process, sliced on several
            for attribute, source in (("gate_up_proj", experts.up_weight), ("gate_up_proj_bias", experts.up_bias),
                                      ("down_proj", experts.down_weight), ("down_proj_bias", experts.down_bias)):
                _share_parameter(layer.experts, attribute, _local(source, rank, world_size).detach()
                                 if world_size > 1 else source, expert=True)
        else:
            inner = experts.inner_dim
            up, down = _local(experts.up_weight, rank, world_size), _local(experts.down_weight, rank, world_size)
            if experts.transposed:  # [L, M, 2I] gate columns first, down [L, I, M]
                gate_w, up_w, down_w = up[..., :inner], up[..., inner:], down
            else:  # [L, 2I, M] gate rows first, down [L, M, I]
                gate_w, up_w, down_w = (up[:, :inner].transpose(1, 2), up[:, inner:].transpose(1, 2),
                                        down.transpose(1, 2))
            for attribute, value in (("W_fc1", gate_w), ("W_fc2", up_w), ("W_fc3", down_w)):
                getattr(layer.experts, attribute).copy_(value.reshape(-1))
    if layout.shared is not None:
        shared = layer.shared_experts
        shared.gate_proj, shared.up_proj, shared.down_proj = (layout.shared.gate_proj, layout.shared.up_proj,
                                                              layout.shared.down_proj)
        if layout.shared_gate is not None:
            shared.gate = layout.shared_gate


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def replace_moe_blocks(model: torch.nn.Module, group=None, **switches) -> int:
    """Replaces every sparse-MoE block of a transformers model by a ``tutel.moe.moe_layer``
    (a ``ReplacedMoeBlock``) computing the same output; returns how many were replaced.

    Args:
        model: a transformers model (or any module) holding blocks of the classes in
            ``block_layouts.SUPPORTED_BLOCKS``: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3,
            GLM-4.5, gpt-oss and Llama 4.
        group: process group for expert parallelism (default: WORLD when torch.distributed is
            initialised, else none).  Each process keeps experts rank*E/W .. (rank+1)*E/W - 1 of
            every block, so every process of the group must call this on the same model, and then
            run every forward together (the layers exchange tokens).  Routers and shared experts
            are replicated.
        **switches: defaults for the layers' per-call switches (``capacity_factor`` -- 0, dropless,
            unless given -- ``top_k``, ``a2a_ffn_overlap_degree``, ``adaptive_r``,
            ``megablocks_size``), and gate options overriding the family's (``balance_loss``,
            ``z_loss_weight``, ``bias_update_rate``, ``gate_noise``).  A call can still pass any
            switch: ``layer(hidden, top_k=1)``.

    Raises:
        ValueError: no MoE block in `model`; UnsupportedMoeBlock (a ValueError) naming the first
            module whose layout is not known or whose options contradict each other; TypeError for
            an unknown option.  Nothing is replaced then.
    """
    call_defaults, gate_overrides = _split_options(switches)
    blocks = find_moe_blocks(model)
    if not blocks:
        done = any(isinstance(module, MOELayer) for module in model.modules())
        raise ValueError(f"replace_moe_blocks: {type(model).__name__} has no sparse-MoE block to replace"
                         + (" (its MoE blocks are moe_layers already)" if done else "")
                         + f"; supported blocks: {', '.join(SUPPORTED_BLOCKS)}")
    layouts = [(name, block, read_block(name, block)) for name, block in blocks]  # all checked before any change
    layers = [(name, _build_layer(name, block, layout, group, call_defaults, gate_overrides))
              for name, block, layout in layouts]
    install_hook = _router_logits_hook(model)
    for name, layer in layers:
        _set_module(model, name, layer)
    for _, layer in layers:
        for gate in layer.gates:
            install_hook(gate, "router_logits", 0)
    return len(layers)


def _router_logits_hook(model: torch.nn.Module) -> Callable[[torch.nn.Module, str, int], None]:
    """transformers records router logits (``output_router_logits=True``) with forward hooks on its
    router classes, which the replacement removes; the same hook on the new routers (whose output
    is the logits [T, E]) keeps the option and the model's own balance loss working.  Returns the
    release's hook installer, or a no-op where `model` records no router logits."""
    try:
        from transformers.utils import output_capturing
        registry = output_capturing._CAN_RECORD_REGISTRY
    except (ImportError, AttributeError):  # a release without recorded outputs
        return lambda *_: None
    if not any("router_logits" in (registry.get(m) or getattr(type(m), "_can_record_outputs", None) or {})
               for m in model.modules() if hasattr(type(m), "_can_record_outputs")):
        return lambda *_: None
    # spelt "capturing" in transformers 5.6-5.8, "capuring" in the other releases
    for name in ("install_output_capuring_hook", "install_output_capturing_hook"):
        if hasattr(output_capturing, name):
            return getattr(output_capturing, name)
    import transformers
    raise ValueError(f"replace_moe_blocks: {type(model).__name__} records router logits, but transformers "
                     f"{transformers.__version__} has no output-capturing hook tutel knows "
                     f"(transformers.utils.output_capturing.install_output_capuring_hook); nothing was replaced")


def set_moe_switches(model: torch.nn.Module, **switches) -> int:
    """Changes the per-call switch defaults (``capacity_factor``, ``top_k``,
    ``a2a_ffn_overlap_degree``, ``adaptive_r``, ``megablocks_size``) of every layer that
    ``replace_moe_blocks`` put into `model`, so that the model's own forward (which cannot pass
    them) uses them; a value None restores the gate's own setting.  Every layer is checked before
    any changes; returns how many layers changed.

    Raises:
        TypeError: an unknown switch; ValueError naming the layer and the switch for a value a
            layer does not allow (e.g. top_k above the experts its groups allow).
    """
    unknown = [name for name in switches if name not in CALL_SWITCHES]
    if unknown:
        raise TypeError(f"set_moe_switches: unknown switch(es) {unknown}; allowed: {', '.join(CALL_SWITCHES)}")
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, ReplacedMoeBlock)]
    if not layers:
        raise ValueError(f"set_moe_switches: {type(model).__name__} has no layer made by replace_moe_blocks")
    updated = []
    for name, layer in layers:
        defaults = {key: value for key, value in {**layer.call_defaults, **switches}.items() if value is not None}
        try:
            layer.check_switches(defaults, "set_moe_switches")
        except (ValueError, TypeError) as error:
            raise ValueError(f"set_moe_switches: layer '{name}': {error}") from error
        updated.append((layer, defaults))
    for layer, defaults in updated:
        layer.call_defaults = defaults
    return len(updated)


def moe_aux_loss(model: torch.nn.Module) -> Optional[torch.Tensor]:
    """The sum of ``l_aux`` over the model's moe_layers after a forward (None when none has one)."""
    losses = [m.l_aux for m in model.modules() if isinstance(m, MOELayer) and m.l_aux is not None]
    return torch.stack([loss.float() for loss in losses]).sum() if losses else None

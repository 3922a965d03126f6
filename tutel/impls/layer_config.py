"""Parsing and validation of moe_layer(...) constructor arguments.

Each rule lives here once: the parallel type, and how gate / expert dicts turn into
modules.  The expert counts live in placement.py, the capacity alignment in capacity.py.
"""
import importlib
import math
import os
import re
import warnings
from typing import Any, Dict, List

import torch

from ..gates.balancing import SelectionBias
from ..gates.scoring import OPTION_NAMES, check_top_k, pop_routing_options
from ..ops.checks import require_finite_number


GATE_OPTIONS = ("k", "capacity_factor", "gate_noise", "fp32_gate", "proj_dim", "init_t", "router_bias") + OPTION_NAMES
_NAME = re.compile(r"^[a-zA-Z0-9_]+$")


def valid_adaptive_rs(sharded_count: int) -> List[int]:
    """adaptive_r values allowed for S processes per expert: 0 and the divisors of S."""
    return [0] + [r for r in range(1, sharded_count + 1) if sharded_count % r == 0]


def parse_parallel_type(parallel_type: str, sharded_count: int) -> int:
    """The default adaptive_r for ``parallel_type``: 'adaptive:r', 'data' (1), 'model' (S) or 'auto' (1)."""
    if not isinstance(parallel_type, str):
        raise TypeError(f"parallel_type must be a string, got {type(parallel_type).__name__}")
    valid = valid_adaptive_rs(sharded_count)
    if parallel_type.startswith("adaptive:"):
        try:
            r = int(parallel_type[len("adaptive:"):])
        except ValueError:
            raise ValueError(f"parallel_type={parallel_type!r}: expected 'adaptive:<int>'") from None
        r = min(max(r, 0), sharded_count)
        if r not in valid:
            raise ValueError(f"Unexpected value of adaptive_degree: {r}, expecting a candidate within {valid}.")
        return r
    if parallel_type in ("data", "auto"):
        return 1
    if parallel_type == "model":
        return sharded_count
    raise ValueError(f"Unrecognized parallel type specified: {parallel_type!r}; allowed: 'adaptive:<r>' "
                     f"with r in {valid}, 'data', 'model', 'auto'")


def gate_configs(gate_type) -> List[Dict[str, Any]]:
    """Gate dicts (copied, never mutated) from a dict, a list of dicts or a legacy 'Top<K>Gate' string."""
    if isinstance(gate_type, str):
        match = re.match(r"^Top([0-9]+)Gate$", gate_type)
        if not match:
            raise ValueError(f"Unrecognized gate_type: {gate_type!r}; use a dict like {{'type': 'top', 'k': 2}}")
        top_k = int(match.group(1))
        warnings.warn(f"gate_type value `{gate_type}` has been deprecated, please use "
                      f"gate_type={{'type': 'top', 'k': {top_k}}} instead.", DeprecationWarning, stacklevel=3)
        return [{"type": "top", "k": top_k}]
    configs = gate_type if isinstance(gate_type, (list, tuple)) else [gate_type]
    if len(configs) == 0:
        raise ValueError("gate_type must be a gate dict or a non-empty list of gate dicts")
    result = []
    for i, config in enumerate(configs):
        if not isinstance(config, dict) or "type" not in config:
            raise ValueError(f"gate_type[{i}] must be a dict with a 'type' key, got {config!r}")
        result.append(dict(config))
    return result


def build_gate(config: Dict[str, Any], model_dim: int, num_global_experts: int) -> torch.nn.Module:
    """Instantiates one gate and attaches its routing options: capacity_factor, gate_noise, the
    scored-routing options (``gate.routing_options``, tutel.gates.scoring) and, with
    ``selection_bias=True``, the bias module ``gate.selection_bias`` (tutel.gates.balancing)."""
    config = dict(config)
    gate_name = config.pop("type")
    routing_options = pop_routing_options(config, num_global_experts)  # scored routing (gates/scoring.py)
    if gate_name == "custom":
        if "module" not in config:
            raise ValueError("gate_type {'type': 'custom'} needs 'module': the gate class")
        gate_class = config.pop("module")
        gate = gate_class(model_dim=model_dim, num_global_experts=num_global_experts, **config)
        if not hasattr(gate, "top_k"):
            raise ValueError(f"custom gate {gate_class.__name__} must define `top_k`")
    else:
        if not isinstance(gate_name, str) or not _NAME.match(gate_name):
            raise ValueError(f"Gate type must only include digits, letters and underscores, got {gate_name!r}")
        try:
            module = importlib.import_module(f"tutel.gates.{gate_name}")
        except ModuleNotFoundError:
            raise ValueError(f"Unrecognized gate_type: {gate_name!r}; built-in gates: 'top', 'cosine_top', "
                             f"or 'custom' with 'module'") from None
        gate = module.Gate(model_dim=model_dim, num_global_experts=num_global_experts, **config)
    if not hasattr(gate, "gate_noise"):
        gate.gate_noise = require_finite_number(config.get("gate_noise", 0.0), "gate_noise", "gate_type")
        if gate.gate_noise < 0:
            raise ValueError(f"gate_type: `gate_noise` must be >= 0, got {gate.gate_noise}")
    if not hasattr(gate, "capacity_factor"):
        if "capacity_factor" in config:
            gate.capacity_factor = require_finite_number(config["capacity_factor"], "capacity_factor", "gate_type")
        else:
            gate.capacity_factor = _capacity_factor_from_environment()
    gate.routing_options = routing_options
    check_top_k(routing_options, gate.top_k, num_global_experts, "gate_type")
    if routing_options.selection_bias:
        gate.selection_bias = SelectionBias(num_global_experts, routing_options.bias_update_rate)
    return gate


def _capacity_factor_from_environment() -> float:
    """Tutel's CAP_FACTOR environment variable: the default capacity factor (1.0 when unset)."""
    text = os.environ.get("CAP_FACTOR")
    if text is None:
        return 1.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"gate_type: the environment variable CAP_FACTOR={text!r} must be a finite number "
                         f"(the default capacity_factor)")
    return value


def build_experts(config: Dict[str, Any], model_dim: int, num_local_experts: int,
                  sharded_count: int) -> torch.nn.Module:
    """Instantiates the expert module from the (already count-stripped) experts dict."""
    config = dict(config)
    expert_name = config.pop("type", None)
    if expert_name is None:
        raise ValueError("experts dict needs a 'type': 'ffn', 'llama_ffn', 'clamped_swiglu' or 'custom'")
    if expert_name == "custom":
        if "module" not in config:
            raise ValueError("experts {'type': 'custom'} needs 'module': the expert class")
        expert_class = config.pop("module")
    else:
        if not isinstance(expert_name, str) or not _NAME.match(expert_name):
            raise ValueError(f"Expert type must only include digits, letters and underscores, got {expert_name!r}")
        for removed in ("fused_custom_fn", "implicit_dropout_p"):
            if removed in config:
                raise ValueError(f"`{removed}` is no longer supported: use a custom activation_fn (e.g. with "
                                 f"torch.nn.Dropout) or a custom expert module instead")
        try:
            expert_class = importlib.import_module(f"tutel.experts.{expert_name}").ExpertModule
        except ModuleNotFoundError:
            raise ValueError(f"Builtin expert type is not recognized: {expert_name!r}; built-in experts: "
                             f"'ffn', 'llama_ffn', 'clamped_swiglu', or 'custom' with 'module'") from None
    common = dict(model_dim=model_dim, sharded_count=sharded_count)
    try:
        return expert_class(num_experts_per_device=num_local_experts, **common, **config)
    except TypeError as first_error:
        # Older expert classes take `local_experts` instead of `num_experts_per_device`.
        try:
            experts = expert_class(local_experts=num_local_experts, **common, **config)
        except TypeError:
            raise TypeError(f"could not build experts of type {expert_name!r}: {first_error}") from first_error
        warnings.warn(f"expert class {getattr(expert_class, '__name__', expert_class)} takes `local_experts`; "
                      f"please rename it to `num_experts_per_device`", DeprecationWarning, stacklevel=3)
        return experts


def reject_unknown_layer_arguments(kwargs: Dict[str, Any]) -> None:
    """Raises for a constructor argument moe_layer does not know, with a hint where a gate option belongs."""
    if "pad_samples" in kwargs:
        warnings.warn("`pad_samples` has been deprecated and is ignored: tokens are never padded",
                      DeprecationWarning, stacklevel=3)
    for name in kwargs:
        if name == "pad_samples":
            continue
        hint = " — it belongs in the gate dict, e.g. gate_type={'type': 'top', '%s': ...}" % name \
            if name in GATE_OPTIONS else ""
        raise ValueError(f"Unrecognized argument provided to Tutel Moe-layer: {name}{hint}")

"""Scored routing: the gate-dict options of 2024-26 MoE routers and the rules they stand for.

A gate turns a token into logits ``z`` [T, E].  These options say how the layer turns the logits
into the experts each token visits and the weights of their outputs (docs/routing.md has the
whole recipe with the models each setting reproduces):

* ``score_function``: ``s = softmax(z)`` (default), ``sigmoid(z)`` or ``sqrt(softplus(z))``;
* ``softmax_after_topk``: choose the top-k logits first, then ``w = softmax`` over those k only;
* ``selection_bias``: a per-expert bias b added to the scores for choosing only (see balancing.py);
* ``n_group`` / ``topk_group``: a token may only choose experts of its ``topk_group`` best groups
  (of ``n_group`` equal groups, a group scored by the sum of its two best biased scores);
* ``renormalize``: divide the k weights by their sum (None: the layer's ``normalize_gate`` rule);
* ``routed_scaling_factor``: multiply the weights by a constant;
* ``balance_loss`` / ``z_loss_weight``: which auxiliary loss ``l_aux`` holds (see
  tutel.impls.router_losses).
"""
import math
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrt_softplus")
BALANCE_LOSSES = ("gshard", "load_importance", "sequence", "global_batch", "none")


@dataclass(frozen=True)
class RoutingOptions:
    """The scored-routing options of one gate; the defaults are Tutel's softmax top-k routing."""

    score_function: str = "softmax"
    softmax_after_topk: bool = False
    renormalize: Optional[bool] = None
    routed_scaling_factor: float = 1.0
    n_group: Optional[int] = None
    topk_group: Optional[int] = None
    selection_bias: bool = False
    bias_update_rate: Optional[float] = None
    balance_loss: Optional[str] = None
    z_loss_weight: float = 0.0

    @property
    def is_default(self) -> bool:
        """True when the layer routes exactly as Tutel does (its original code path)."""
        return self == RoutingOptions()

    @property
    def groups_limited(self) -> bool:
        return self.n_group is not None

    def allowed_experts(self, num_experts: int) -> int:
        """How many experts a token may choose from (all of them unless groups are limited)."""
        if not self.groups_limited:
            return num_experts
        return self.topk_group * (num_experts // self.n_group)


OPTION_NAMES = tuple(field.name for field in fields(RoutingOptions))


def _option_error(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"gate option {name}={value!r} is not allowed: {allowed}")


def _positive_int(config: Dict[str, Any], name: str) -> Optional[int]:
    value = config.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _option_error(name, value, "it must be an integer >= 1")
    return value


def _finite(config: Dict[str, Any], name: str, default: float, minimum: float, strict: bool) -> float:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            value < minimum or (strict and value == minimum):
        relation = ">" if strict else ">="
        raise _option_error(name, value, f"it must be a finite number {relation} {minimum}")
    return float(value)


def pop_routing_options(config: Dict[str, Any], num_experts: int) -> RoutingOptions:
    """Removes the scored-routing options from a gate dict (modified in place) and validates them.

    Raises ValueError naming the option for an unknown value or options that contradict each
    other (a group count that does not divide the experts, topk_group > n_group, ...)."""
    given = {name: config.pop(name) for name in OPTION_NAMES if name in config}
    score_function = given.get("score_function", "softmax")
    if score_function not in SCORE_FUNCTIONS:
        raise _option_error("score_function", score_function, f"allowed: {', '.join(SCORE_FUNCTIONS)}")
    softmax_after_topk = given.get("softmax_after_topk", False)
    if not isinstance(softmax_after_topk, bool):
        raise _option_error("softmax_after_topk", softmax_after_topk, "it must be True or False")
    if softmax_after_topk and score_function != "softmax":
        raise ValueError(f"gate option softmax_after_topk=True takes a softmax over the chosen logits; it "
                         f"contradicts score_function={score_function!r} (use score_function='softmax')")
    renormalize = given.get("renormalize")
    if renormalize is not None and not isinstance(renormalize, bool):
        raise _option_error("renormalize", renormalize, "it must be None, True or False")
    n_group, topk_group = _positive_int(given, "n_group"), _positive_int(given, "topk_group")
    if (n_group is None) != (topk_group is None):
        missing = "topk_group" if topk_group is None else "n_group"
        raise ValueError(f"gate option {missing} is missing: group-limited routing needs both n_group and "
                         f"topk_group")
    if n_group is not None:
        if num_experts % n_group != 0:
            raise _option_error("n_group", n_group, f"it must divide the {num_experts} experts into equal groups")
        if topk_group > n_group:
            raise _option_error("topk_group", topk_group, f"it must be <= n_group={n_group}")
    selection_bias = given.get("selection_bias", False)
    if not isinstance(selection_bias, bool):
        raise _option_error("selection_bias", selection_bias, "it must be True or False")
    rate = given.get("bias_update_rate")
    if rate is not None:
        if not selection_bias:
            raise ValueError("gate option bias_update_rate needs selection_bias=True (it is the step by which "
                             "the selection bias moves)")
        rate = _finite(given, "bias_update_rate", 0.0, 0.0, strict=False)
    balance_loss = given.get("balance_loss")
    if balance_loss is not None and balance_loss not in BALANCE_LOSSES:
        raise _option_error("balance_loss", balance_loss, f"allowed: {', '.join(BALANCE_LOSSES)}")
    if balance_loss == "load_importance" and score_function != "softmax":
        raise ValueError(f"gate option balance_loss='load_importance' models softmax routing; it contradicts "
                         f"score_function={score_function!r}")
    return RoutingOptions(
        score_function=score_function, softmax_after_topk=softmax_after_topk, renormalize=renormalize,
        routed_scaling_factor=_finite(given, "routed_scaling_factor", 1.0, 0.0, strict=True),
        n_group=n_group, topk_group=topk_group, selection_bias=selection_bias, bias_update_rate=rate,
        balance_loss=balance_loss, z_loss_weight=_finite(given, "z_loss_weight", 0.0, 0.0, strict=False))


def check_top_k(options: RoutingOptions, top_k: int, num_experts: int, where: str) -> None:
    """Raises ValueError when k exceeds the experts a token may choose from under group limiting."""
    allowed = options.allowed_experts(num_experts)
    if top_k > allowed:
        raise ValueError(f"{where}: k={top_k} exceeds the {allowed} experts of the topk_group="
                         f"{options.topk_group} groups a token may use (n_group={options.n_group}, "
                         f"{num_experts // options.n_group} experts per group); allowed: 1 <= k <= {allowed}")


def score(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """s = softmax(z) over the experts, sigmoid(z), or sqrt(softplus(z)) (DeepSeek-V4), per token."""
    if score_function == "softmax":
        return F.softmax(logits, dim=1)
    if score_function == "sigmoid":
        return torch.sigmoid(logits)
    if score_function == "sqrt_softplus":
        return torch.sqrt(F.softplus(logits))
    raise _option_error("score_function", score_function, f"allowed: {', '.join(SCORE_FUNCTIONS)}")


def affinity(scores: torch.Tensor, score_function: str) -> torch.Tensor:
    """Scores normalised over all experts (each token's row sums to one): what balance losses use."""
    if score_function == "softmax":
        return scores
    return scores / scores.sum(dim=1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)


def limit_groups(choice_scores: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """``choice_scores`` [T, E] with every expert outside the token's ``topk_group`` best groups set
    to -inf.  The E experts form ``n_group`` consecutive equal groups; a group's score is the sum of
    its two best choice scores (its only score when a group holds one expert), as in DeepSeek-V3."""
    tokens, num_experts = choice_scores.shape
    grouped = choice_scores.view(tokens, n_group, num_experts // n_group)
    best = grouped.topk(min(2, grouped.shape[2]), dim=2).values.sum(dim=2)  # [T, n_group]
    chosen = best.topk(topk_group, dim=1).indices
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, chosen, True)
    return grouped.masked_fill(~keep.unsqueeze(2), -math.inf).view(tokens, num_experts)


def should_renormalize(options: RoutingOptions, top_k: int, normalize_gate: bool) -> bool:
    """renormalize=None follows the layer's normalize_gate (which applies to k > 1 only)."""
    if options.renormalize is None:
        return top_k > 1 and normalize_gate
    return options.renormalize

"""Shape-only implementations of torch.ops.tutel.*, used by torch.compile and FakeTensor tracing."""
import torch

from torch.library import register_fake


# The accumulation dtype of each data dtype: float64's own, float32 for the others (a dict, not a
# function: the shape functions run on every traced call).
_ACCUMULATION = {torch.float64: torch.float64}


@register_fake("tutel::route_topk")
def _route_topk(scores, k, batch_prioritized):
    tokens, experts = scores.shape
    indices = scores.new_empty((k, tokens), dtype=torch.int32)
    gates = scores.new_empty((k, tokens))
    locations = scores.new_empty((k, tokens), dtype=torch.int32)
    counts = scores.new_empty((k, experts), dtype=torch.int32)
    return indices, gates, locations, counts


@register_fake("tutel::assign_locations")
def _assign_locations(indices, num_experts, priority):
    return torch.empty_like(indices), indices.new_empty((indices.shape[0], num_experts))


@register_fake("tutel::group_by_expert")
def _group_by_expert(expert_ids, num_experts):
    tokens, k = expert_ids.shape
    choices = expert_ids.new_empty((tokens * k,), dtype=torch.int64)
    return (expert_ids.new_empty((k, tokens), dtype=torch.int32), choices, torch.empty_like(choices),
            expert_ids.new_empty((num_experts,), dtype=torch.int64), expert_ids.new_empty((num_experts,), dtype=torch.int32))


@register_fake("tutel::cumsum_sub_one")
def _cumsum_sub_one(mask):
    floating = mask.dtype in (torch.float32, torch.float64)
    return mask.new_empty(mask.shape, dtype=mask.dtype if floating else torch.int64)


def _dots(locations, other, dtype):
    """The dots output: [k, T] (the shape of `locations`; indices may be None) or empty."""
    acc = _ACCUMULATION.get(dtype, torch.float32)
    if other is None:
        return locations.new_empty((0,), dtype=acc)
    return locations.new_empty(locations.shape, dtype=acc)


@register_fake("tutel::gather_slots")
def _gather_slots(rows, indices, locations, weights, other):
    out = rows.new_empty((locations.shape[1], rows.shape[2]))
    return out, _dots(locations, other, rows.dtype)


@register_fake("tutel::scatter_slots")
def _scatter_slots(src, indices, locations, weights, other, num_experts, capacity):
    out = src.new_empty((num_experts, capacity, src.shape[1]))
    return out, _dots(locations, other, src.dtype)


def _grouped_outputs(weight, weight_transposed):
    return weight.shape[1] if weight_transposed else weight.shape[2]


@register_fake("tutel::grouped_linear")
def _grouped_linear(x, weight, bias, group_rows, weight_transposed):
    return x.new_empty((x.shape[0], _grouped_outputs(weight, weight_transposed)))


@register_fake("tutel::grouped_linear_backward")
def _grouped_linear_backward(grad, x, weight, group_rows, weight_transposed, output_mask):
    grad_x = x.new_empty((x.shape[0] if output_mask[0] else 0, x.shape[1]))
    grad_weight = weight.new_empty(weight.shape if output_mask[1] else (0,))
    grad_bias = x.new_empty((weight.shape[0] if output_mask[2] else 0, _grouped_outputs(weight, weight_transposed)))
    return grad_x, grad_weight, grad_bias


# grouped_rows_linear's `transposed` ([E, K, O]) is grouped_linear's weight_transposed == False.
@register_fake("tutel::grouped_rows_linear")
def _grouped_rows_linear(rows, weight, bias, offsets, transposed):
    return _grouped_linear(rows, weight, bias, None, not transposed)


@register_fake("tutel::grouped_rows_linear_backward")
def _grouped_rows_linear_backward(grad, rows, weight, offsets, transposed, output_mask):
    return _grouped_linear_backward(grad, rows, weight, None, not transposed, output_mask)


# The per-expert bias (bias, offsets) changes values only: the shapes follow gate_up.
@register_fake("tutel::gated_unit")
def _gated_unit(gate_up, alpha, up_offset, limit, interleaved, bias=None, offsets=None):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@register_fake("tutel::gated_unit_backward")
def _gated_unit_backward(grad, gate_up, alpha, up_offset, limit, interleaved, bias=None, offsets=None):
    return gate_up.new_empty(gate_up.shape)


@register_fake("tutel::gated_unit_pair")
def _gated_unit_pair(gate, up, alpha, up_offset, limit):
    return gate.new_empty(gate.shape)


@register_fake("tutel::gated_unit_pair_backward")
def _gated_unit_pair_backward(grad, gate, up, alpha, up_offset, limit):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


@register_fake("tutel::select_rows")
def _select_rows(x, index):
    return x.new_empty((index.shape[0], x.shape[1]))


@register_fake("tutel::to_dtype")
def _to_dtype(x, dtype):
    return x.new_empty(x.shape, dtype=dtype)


@register_fake("tutel::routed_gated_experts")
def _routed_gated_experts(x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias, transposed, alpha,
                          up_offset, limit, interleaved, gate_weight=None):
    return x.new_empty((x.shape[0], down_weight.shape[2] if transposed else down_weight.shape[1]))


# decode_experts is routed_gated_experts' result at decoding sizes: [T, O] in x's dtype.
@register_fake("tutel::decode_experts")
def _decode_experts(x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias, transposed, alpha, up_offset,
                    limit, interleaved, gate_weight=None):
    return x.new_empty((x.shape[0], down_weight.shape[2] if transposed else down_weight.shape[1]))


# decode_quantized_experts: [T, O] in x's dtype, O the down stack's rows.
@register_fake("tutel::decode_quantized_experts")
def _decode_quantized_experts(x, expert_ids, weights, format, gate_up, gate_up_scales, gate_up_global, down,
                              down_scales, down_global, block, gate_up_bias, down_bias, activation, alpha, up_offset,
                              limit, interleaved):
    return x.new_empty((x.shape[0], down.shape[1]))


# quantized_grouped_linear: [n, N] in rows' dtype, N the stack's rows.
@register_fake("tutel::quantized_grouped_linear")
def _quantized_grouped_linear(rows, ends, format, codes, scales, global_scale, block, bias, activation_group=0):
    return rows.new_empty((rows.shape[0], codes.shape[1]))


@register_fake("tutel::route_experts")
def _route_experts(logits, k, score_function, softmax_after_topk, selection_bias, n_group, topk_group, renormalize,
                   routed_scaling_factor, batch_prioritized, capacity, with_loss):
    tokens, experts = logits.shape
    acc = _ACCUMULATION.get(logits.dtype, torch.float32)
    rows = tokens * k if capacity < 0 else experts * capacity
    choices = logits.new_empty((k, tokens), dtype=torch.int32)
    return (choices, logits.new_empty((k, tokens), dtype=acc), torch.empty_like(choices),
            logits.new_empty((k, experts), dtype=torch.int32), logits.new_empty((experts,), dtype=torch.int64),
            torch.empty_like(choices), logits.new_empty((experts,), dtype=torch.int32),
            logits.new_empty((rows,), dtype=torch.int32), logits.new_empty((), dtype=acc))


@register_fake("tutel::route_experts_backward")
def _route_experts_backward(grad_weights, grad_loss, logits, expert_ids, counts, score_function, softmax_after_topk,
                            renormalize, routed_scaling_factor, with_loss):
    return torch.empty_like(logits)


# add_expert_bias_ writes its rows in place and returns nothing.
@register_fake("tutel::add_expert_bias_")
def _add_expert_bias_(rows, bias, offsets):
    return None


@register_fake("tutel::expert_row_sums")
def _expert_row_sums(rows, offsets):
    return rows.new_empty((offsets.shape[0], rows.shape[1]))


@register_fake("tutel::choice_rows")
def _choice_rows(x, slot_choices, k):
    return x.new_empty((slot_choices.shape[0], x.shape[1]))

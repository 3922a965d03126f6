// Operator schemas of the tutel library.  Each op is declared once here and
// implemented per device (ops/cpu, ops/cuda); shape-only ("fake") versions for
// torch.compile live in tutel/ops/fake.py and autograd in tutel/ops/.
#include <torch/library.h>

TORCH_LIBRARY(tutel, m) {
  // Top-k selection plus GShard slot assignment.  Returns
  //   indices [k, T] int32, gates [k, T] (scores' dtype), locations [k, T] int32,
  //   counts [k, E] int32 (tokens per expert and choice).
  m.def(
      "route_topk(Tensor scores, int k, bool batch_prioritized) -> "
      "(Tensor indices, Tensor gates, Tensor locations, Tensor counts)");
  // Slot assignment for given indices [k, T]; with `priority` [T], tokens of
  // higher priority claim slots first (batch-prioritized routing).
  m.def(
      "assign_locations(Tensor indices, int num_experts, Tensor? priority) -> "
      "(Tensor locations, Tensor counts)");
  // Dropless grouping of expert_ids [T, k] (int32 / int64): the choices sorted by expert,
  // stably in token-major order; ids outside [0, num_experts) are dropped and sort last.
  //   locations [k, T] int32 (T k for dropped), slot_choices [T k] int64 (the choice t k + j
  //   in each slot), sorted_ids [T k] int64 (num_experts for dropped), counts [E] int64,
  //   ends [E] int32 (running sum of counts).  CPU only.
  m.def(
      "group_by_expert(Tensor expert_ids, int num_experts) -> "
      "(Tensor locations, Tensor slot_choices, Tensor sorted_ids, Tensor counts, Tensor ends)");
  // out = cumsum(mask, dim=0) - 1 for a 2-D mask.
  m.def("cumsum_sub_one(Tensor mask) -> Tensor");
  // out[t] = sum_j w[j,t] * rows[idx, loc] over kept choices; rows is [E, C, M].
  // indices None: every choice's expert is 0 (the grouped layout); weights [k, T] may have
  // any floating dtype and strides (read in place).
  // dots[j,t] = <rows[idx, loc], other[t]> when `other` is given, else empty.
  m.def(
      "gather_slots(Tensor rows, Tensor? indices, Tensor locations, Tensor? weights, "
      "Tensor? other) -> (Tensor out, Tensor dots)");
  // out[idx, loc] = w[j,t] * src[t] into a zeroed [E, C, M] buffer.
  // dots[j,t] = <other[idx, loc], src[t]> when `other` ([E, C, M]) is given.
  m.def(
      "scatter_slots(Tensor src, Tensor? indices, Tensor locations, Tensor? weights, "
      "Tensor? other, SymInt num_experts, SymInt capacity) -> (Tensor out, Tensor dots)");
  // Grouped linear map over consecutive row blocks (the dropless expert GEMMs):
  // rows [o_g, o_g + group_rows[g]) of x [N, K] times weight[g] ([K, O], or
  // [O, K] when weight_transposed), plus bias[g] ([G, O]).  Returns [N, O].
  m.def(
      "grouped_linear(Tensor x, Tensor weight, Tensor? bias, int[] group_rows, bool weight_transposed) -> Tensor");
  // Gradients of grouped_linear for x, weight (in weight's layout) and bias;
  // those not selected by output_mask are empty tensors.
  m.def(
      "grouped_linear_backward(Tensor grad, Tensor x, Tensor weight, int[] group_rows, bool weight_transposed, "
      "bool[3] output_mask) -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)");
  // Gated activation of the experts' up projection gate_up [n, 2I] (gates and ups concatenated,
  // or alternating when interleaved): h = (u' + up_offset) * g' * sigmoid(alpha g') [n, I],
  // g' = min(g, limit), u' = clamp(u, -limit, limit) (limit None: no clamping).  With bias [E, 2I]
  // (gate_up's dtype, laid out like a row of gate_up) and offsets [E] int32 (both or neither; rows
  // grouped by expert, offsets[e] the end of expert e's rows, non-decreasing), row r's g and u
  // first take the bias of its expert, the first e with offsets[e] > r, added in the accumulation
  // dtype (rows past offsets[E-1] take none).  CPU and CUDA (one launch).
  m.def(
      "gated_unit(Tensor gate_up, float alpha, float up_offset, float? limit, bool interleaved, Tensor? bias=None, "
      "Tensor? offsets=None) -> Tensor");
  // d gate_up [n, 2I] (gate_up's layout) from d h [n, I], at the biased values when bias and
  // offsets are given (d bias is then the per-expert sum of d gate_up, left to the caller).
  m.def(
      "gated_unit_backward(Tensor grad, Tensor gate_up, float alpha, float up_offset, float? limit, "
      "bool interleaved, Tensor? bias=None, Tensor? offsets=None) -> Tensor");
  // out[i] = x[index[i]] for x [N, M], index [n] (torch.index_select(x, 0, index) into a buffer
  // of the CPU block cache).  CPU only.
  m.def("select_rows(Tensor x, Tensor index) -> Tensor");
  // The gate-weighted sum of each token's routed gated experts, without autograd:
  //   out[t] = sum_j weights[t, j] * down_e(unit(up_e(x[t]))),  e = expert_ids[t, j] in [0, E)
  // with up_e(v) = v @ up_weight[e]^T + up_bias[e] (up_weight [E, 2I, H]; transposed: [E, H, 2I]
  // and v @ up_weight[e]), down_e likewise (down_weight [E, O, I] or [E, I, O]) and unit the gated
  // unit of gated_unit.  weights None counts 1; ids outside [0, E) contribute nothing.  Returns
  // [T, O] in x's dtype (every weight tensor has it too).  With `gate_weight` (the shape of
  // up_weight, no up_bias, not interleaved) the gates come from their own product and up_weight
  // holds the ups only (gated_unit_pair).  CPU only.
  m.def(
      "routed_gated_experts(Tensor x, Tensor expert_ids, Tensor? weights, Tensor up_weight, Tensor down_weight, "
      "Tensor? up_bias, Tensor? down_bias, bool transposed, float alpha, float up_offset, float? limit, "
      "bool interleaved, Tensor? gate_weight=None) -> Tensor");
  // routed_gated_experts' result (the same arguments and rules) at decoding sizes, for inference
  // (no autograd): expert_ids int32 / int64, weights of any floating dtype (both any strides).
  // CUDA: two launches (kernels/decode_experts.cu), no host synchronisation: each chosen
  // expert's matrices read once for all the tokens that chose it, the gated unit applied in
  // registers, each token's weighted sum written once.  CPU: routed_gated_experts itself.
  m.def(
      "decode_experts(Tensor x, Tensor expert_ids, Tensor? weights, Tensor up_weight, Tensor down_weight, "
      "Tensor? up_bias, Tensor? down_bias, bool transposed, float alpha, float up_offset, float? limit, "
      "bool interleaved, Tensor? gate_weight=None) -> Tensor");
  // Routed experts whose weights are quantized, at decoding sizes, for inference (no autograd):
  //   out[t] = sum_j weights[t, j] * (unit(x[t] @ Wgu[e]^T + gate_up_bias[e]) @ Wd[e]^T + down_bias[e])
  // over the choices whose id e = expert_ids[t, j] lies in [0, E), with Wgu [E, 2I or I, H] and Wd
  // [E, O, I] decoded from `format`'s codes and scales as they are read:
  //   'mxfp4': gate_up / down uint8 [E, N, K/2], two E2M1 codes a byte (even element in the low
  //            nibble); *_scales uint8 [E, N, K/32] E8M0 (2^(s-127)); K a multiple of 32.
  //   'nvfp4': the same codes; *_scales float8_e4m3fn [E, N, K/16]; *_global float32 [E]
  //            (W = code * scale * global); K a multiple of 16.
  //   'fp8_block': gate_up / down float8_e4m3fn [E, N, K]; *_scales float32 / bfloat16 / float16
  //            [E, ceil(N/block[0]), ceil(K/block[1])] (W = q * scale of its block).
  // `block` is fp8_block's [rows, cols] (empty for the fp4 formats); *_global only for nvfp4.
  // activation 'gated': gate and up rows (concatenated, or alternating when interleaved), unit
  // (u' + up_offset) * g' * sigmoid(alpha g') with g', u' clamped by limit as gated_unit's;
  // 'gelu' / 'gelu_tanh' / 'relu': up rows only.  Biases float32, gate_up_bias laid out like
  // gate_up's rows.  x float32 / bfloat16 / float16 [T, H]; weights any floating dtype or None
  // (1); returns [T, O] in x's dtype.  Sums in float32; the unit's values rounded to x's dtype.
  m.def(
      "decode_quantized_experts(Tensor x, Tensor expert_ids, Tensor? weights, str format, Tensor gate_up, "
      "Tensor gate_up_scales, Tensor? gate_up_global, Tensor down, Tensor down_scales, Tensor? down_global, "
      "int[] block, Tensor? gate_up_bias, Tensor? down_bias, str activation, float alpha, float up_offset, "
      "float? limit, bool interleaved) -> Tensor");
  // Rows grouped by expert times a quantized stack: out[r] = rows[r] @ W[e]^T + bias[e] for the rows
  // r of expert e (ends [E] int32 / int64, the non-decreasing end of each expert's rows, the last
  // <= n; rows past it give zeros), W [E, N, K] in `format` as decode_quantized_experts' stacks
  // (codes, scales, global_scale for nvfp4 only, block for fp8_block only).  rows float32 /
  // bfloat16 / float16 [n, K]; bias [E, N] any floating dtype, taken as float32; returns [n, N] in
  // rows' dtype.  Sums in float32; W decoded a strip (CPU) or a tile (CUDA) at a time, never whole
  // (bfloat16 rows on AMX: rounded to bfloat16).  CUDA: one launch (kernels/quantized_grouped_linear.cu)
  // on the tensor cores, no host synchronisation: the ends are read on the device (their clamped
  // running maximum, unchecked), int64 ends converted to int32 first (one more launch).
  // activation_group g > 0 (W8A8, fp8_block only; g a multiple of 16 or at least K): each row is
  // quantized first, per group of g columns (the last may be partial), to E4M3 codes of
  // value / max(scale, 1e-12) with the float32 scale amax / 448 (round to nearest, ties to even),
  // and the product taken with codes * scale (core/activation_quant.h); the CPU quantizes into a
  // float32 buffer and multiplies in float32, CUDA quantizes inside the same launch.
  m.def(
      "quantized_grouped_linear(Tensor rows, Tensor ends, str format, Tensor codes, Tensor scales, "
      "Tensor? global_scale, int[] block, Tensor? bias, int activation_group=0) -> Tensor");
  // Rows grouped by expert: rows [N, C] whose rows offsets[e - 1] .. offsets[e] - 1 belong to expert e
  // (offsets [E] int32, the non-decreasing end of each expert's rows, offsets[E - 1] <= N; the rows
  // past it belong to no expert).  In place, rows[i] += bias[e(i)] (bias [E, C] in rows' dtype) in
  // the accumulation dtype, rounded once; the rows of no expert are left as they are.  rows:
  // elements contiguous within each row, any row stride.  CUDA: one launch, no host synchronisation
  // (the CPU checks `offsets`, the kernel reads them as they are).
  m.def("add_expert_bias_(Tensor(a!) rows, Tensor bias, Tensor offsets) -> ()");
  // out [E, C] in rows' dtype: the sum of each expert's rows (a per-expert bias's gradient), in row
  // order in the accumulation dtype (float32 for 16-bit data), 0 for an idle expert; the rows of no
  // expert are ignored.  Deterministic.  CUDA: one launch.
  m.def("expert_row_sums(Tensor rows, Tensor offsets) -> Tensor");
  // out [N, H]: out[s] = x[slot_choices[s] // k] for x [T, H] and slot_choices [N] int64 in
  // [0, T k) (group_by_expert's choice t k + j held by each slot): the token rows in the plan's
  // slot order.  CUDA: one launch (a choice outside the range gives a zero row there; the CPU raises).
  m.def("choice_rows(Tensor x, Tensor slot_choices, int k) -> Tensor");
  // Grouped linear map over rows grouped by expert (rows [N, K], offsets as above): out[i] =
  // rows[i] @ weight[e]^T + bias[e] for expert e's rows (weight [E, O, K], the F.linear layout;
  // transposed: [E, K, O] and rows[i] @ weight[e]), zeros for the rows of no expert; [N, O].  Every
  // dtype.  CUDA: one launch, no host synchronisation (the CPU checks `offsets`, the kernel reads
  // them as their running maximum clamped to [0, N]).
  m.def("grouped_rows_linear(Tensor rows, Tensor weight, Tensor? bias, Tensor offsets, bool transposed) -> Tensor");
  // Its gradients for rows (zero for the rows of no expert), weight (in weight's layout, zero for
  // an expert without rows) and bias; those not in output_mask come back empty, as
  // grouped_linear_backward's.  CUDA: at most two launches.
  m.def(
      "grouped_rows_linear_backward(Tensor grad, Tensor rows, Tensor weight, Tensor offsets, bool transposed, "
      "bool[3] output_mask) -> (Tensor grad_rows, Tensor grad_weight, Tensor grad_bias)");
  // x.to(dtype), contiguous, in a buffer of the CPU block cache.  CPU only.
  m.def("to_dtype(Tensor x, ScalarType dtype) -> Tensor");
  // The same unit over gates and ups in two [n, I] tensors (not interleaved): h [n, I], and
  // its backward's d gate and d up.  CPU only.
  m.def("gated_unit_pair(Tensor gate, Tensor up, float alpha, float up_offset, float? limit) -> Tensor");
  m.def(
      "gated_unit_pair_backward(Tensor grad, Tensor gate, Tensor up, float alpha, float up_offset, float? limit) "
      "-> (Tensor grad_gate, Tensor grad_up)");
  // Routing from the gate's logits [T, E] (csrc/core/route_experts.h has the rules): score_function
  // 'softmax' / 'sigmoid' / 'sqrt_softplus', softmax_after_topk, selection_bias [E] (float32 / float64;
  // choice only), n_group / topk_group (0 / 0: no group limit), renormalize, routed_scaling_factor,
  // batch_prioritized, capacity (slots per expert, -1 dropless), with_loss.  Returns
  //   expert_ids [k, T] int32, weights [k, T] (accumulation dtype), locations [k, T] int32 (GShard
  //   slot, >= capacity when dropped), counts [k, E] int32 and dispatch_count [E] int64 (choices
  //   before capacity), grouped_locations [k, T] int32 (row of the grouped buffer of `rows` = T k
  //   (dropless) or E capacity rows, `rows` when dropped), ends [E] int32 (running sum of the kept
  //   choices), row_choices [rows] int32 (the choice j T + t of each row, k T when unused), l_aux
  //   (0-dim, accumulation dtype; 0 without with_loss or tokens).  CUDA: two launches, no host
  //   synchronisation.
  m.def(
      "route_experts(Tensor logits, int k, str score_function, bool softmax_after_topk, Tensor? selection_bias, "
      "int n_group, int topk_group, bool renormalize, float routed_scaling_factor, bool batch_prioritized, "
      "int capacity, bool with_loss) -> (Tensor expert_ids, Tensor weights, Tensor locations, Tensor counts, "
      "Tensor dispatch_count, Tensor grouped_locations, Tensor ends, Tensor row_choices, Tensor l_aux)");
  // d logits (logits' dtype) from d weights [k, T] and d l_aux (0-dim), both in the accumulation
  // dtype and optional; expert_ids and counts are the forward's.  CUDA: one launch.
  m.def(
      "route_experts_backward(Tensor? grad_weights, Tensor? grad_loss, Tensor logits, Tensor expert_ids, "
      "Tensor counts, str score_function, bool softmax_after_topk, bool renormalize, float routed_scaling_factor, "
      "bool with_loss) -> Tensor");
}

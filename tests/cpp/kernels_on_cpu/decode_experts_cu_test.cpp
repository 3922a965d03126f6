// kernels/decode_experts.cu on the CPU, launched as csrc/ops/cuda/decode_experts_cuda.cpp launches
// it (the gate/up kernel, then the down kernel), against a long double loop over the same inputs:
// every output within a bound on the kernels' float (float64) rounding propagated through the
// gated unit and the down projection, plus one rounding to the data type.  Odd and 16-byte
// sizes (the element-wise and vector kernels), both matrix layouts, the three gate forms
// (concatenated, interleaved with gpt-oss' clamped unit and biases, separate gate matrices),
// repeated and dropped experts, experts without tokens, int32 and int64 ids, every weight dtype.
// Both layouts also run under the cross-block schedules (the down kernel's blocks hand each
// token's rows to the block that completes its count) with the kernels' buffers as weak memory.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "cuda/expert_launch_plan.h"
#include "harness.h"
// The kernel file under test: a mutant build (mutants.cmake) names a copy with one bug in it.
#ifndef TUTEL_KERNEL_SOURCE
#define TUTEL_KERNEL_SOURCE "../../../kernels/decode_experts.cu"
#endif
#include TUTEL_KERNEL_SOURCE
#include "exact_sums.h"

namespace {

using namespace kernels_on_cpu;
namespace core = tutel::core;

enum class Gate { kConcatenated, kInterleaved, kSeparate };

struct Case {
  int64_t tokens, k, experts, hidden, inter, outputs;
  int dropped = 0;           // choices given an id outside [0, E)
  bool repeat_in_token = false;  // a token choosing one expert twice
  bool few_experts = false;  // ids from the first min(E, 3) experts only (many choices per expert)
  int runs = 6;              // how many of the (layout, gate form) runs
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "T=" << c.tokens << " k=" << c.k << " E=" << c.experts << " H=" << c.hidden << " I=" << c.inter
       << " O=" << c.outputs;
}

struct DecodeRun {
  bool transposed;
  Gate gate;
  bool ids_int64;
  int weights_dtype;  // TUTEL_WEIGHTS_*, or -1 for no weights
};

// The values of a problem, logically: gate_w[e][i][h], up_w[e][i][h], down_w[e][o][i], biases
// gate_b[e][i], up_b[e][i], down_b[e][o]; ids and weights [T, k].
struct Problem {
  std::vector<storage_t> x, gate_w, up_w, down_w, gate_b, up_b, down_b;
  std::vector<int64_t> ids;
  std::vector<double> weights;  // values exactly representable in every weight dtype
};

std::vector<storage_t> random_values(int64_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<storage_t> v(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (auto& x : v) x = storage_of(dist(rng));
  return v;
}

Problem make_problem(const Case& c, std::mt19937& rng) {
  Problem p;
  const float matrix_scale = 2.0f / std::sqrt(float(std::max<int64_t>(c.hidden, 1)));
  p.x = random_values(c.tokens * c.hidden, 1.0f, rng);
  p.gate_w = random_values(c.experts * c.inter * c.hidden, matrix_scale, rng);
  p.up_w = random_values(c.experts * c.inter * c.hidden, matrix_scale, rng);
  p.down_w = random_values(c.experts * c.outputs * c.inter, 1.0f / std::sqrt(float(std::max<int64_t>(c.inter, 1))), rng);
  p.gate_b = random_values(c.experts * c.inter, 0.5f, rng);
  p.up_b = random_values(c.experts * c.inter, 0.5f, rng);
  p.down_b = random_values(c.experts * c.outputs, 0.5f, rng);
  const int64_t pairs = c.tokens * c.k;
  std::uniform_int_distribution<int64_t> expert(0, (c.few_experts ? std::min<int64_t>(c.experts, 3) : c.experts) - 1);
  p.ids.resize(pairs);
  for (auto& e : p.ids) e = expert(rng);
  if (c.repeat_in_token && c.k >= 2) p.ids[1] = p.ids[0];
  for (int d = 0; d < c.dropped && pairs > 0; ++d) {
    const int64_t bad[] = {-1, c.experts, c.experts + 5, -7};
    p.ids[rng() % pairs] = bad[d % 4];
  }
  if (c.dropped >= c.k && c.tokens > 1)  // the last token keeps no choice
    for (int64_t j = 0; j < c.k; ++j) p.ids[(c.tokens - 1) * c.k + j] = -1;
  std::uniform_int_distribution<int> weight(1, 64);
  for (int64_t q = 0; q < pairs; ++q) p.weights.push_back(weight(rng) / 64.0);
  return p;
}

// ------------------------------------------------------------ reference --
struct Unit {
  long double alpha = 1, up_offset = 0, limit = 0;
  bool clamped = false;
};

Unit unit_of(Gate gate) {
  Unit u;
  if (gate == Gate::kInterleaved) {  // gpt-oss' unit, with a limit the test's values cross
    u.alpha = 1.702L;
    u.up_offset = 1;
    u.limit = 1.25L;
    u.clamped = true;
  }
  return u;
}

// h and a bound on the error of the kernels' h, from the gate and up values and bounds on theirs.
void unit_value(const Unit& unit, long double g, long double u, long double g_error, long double u_error,
                long double* h, long double* h_error) {
  if (unit.clamped) {
    g = std::min(g, unit.limit);
    u = std::max(std::min(u, unit.limit), -unit.limit);
  }
  const long double s = 1.0L / (1.0L + std::exp(-unit.alpha * g));
  *h = (u + unit.up_offset) * g * s;
  // |d h / d g| and |d h / d u| (clamping only lowers them), then the unit's own roundings.
  const long double dg = std::fabs((u + unit.up_offset) * s * (1.0L + unit.alpha * g * (1.0L - s)));
  const long double du = std::fabs(g * s);
  *h_error = dg * g_error + du * u_error + 16.0L * kAccEps * (std::fabs(*h) + du * std::fabs(unit.up_offset));
}

struct Reference {
  std::vector<long double> out, bound;
};

Reference reference(const Problem& p, const Case& c, const DecodeRun& run) {
  const Unit unit = unit_of(run.gate);
  const bool biases = run.gate == Gate::kInterleaved;
  Reference ref;
  ref.out.assign(c.tokens * c.outputs, 0.0L);
  ref.bound.assign(c.tokens * c.outputs, 0.0L);
  std::vector<long double> h(c.inter), h_error(c.inter);
  for (int64_t t = 0; t < c.tokens; ++t)
    for (int64_t j = 0; j < c.k; ++j) {
      const int64_t e = p.ids[t * c.k + j];
      if (e < 0 || e >= c.experts) continue;
      const long double w = run.weights_dtype < 0 ? 1.0L : p.weights[t * c.k + j];
      for (int64_t i = 0; i < c.inter; ++i) {
        long double g = biases ? value_of(p.gate_b[e * c.inter + i]) : 0, u = biases ? value_of(p.up_b[e * c.inter + i]) : 0;
        long double g_mag = std::fabs(g), u_mag = std::fabs(u);
        for (int64_t d = 0; d < c.hidden; ++d) {
          const long double xv = value_of(p.x[t * c.hidden + d]);
          const long double gt = xv * value_of(p.gate_w[(e * c.inter + i) * c.hidden + d]);
          const long double ut = xv * value_of(p.up_w[(e * c.inter + i) * c.hidden + d]);
          g += gt;
          u += ut;
          g_mag += std::fabs(gt);
          u_mag += std::fabs(ut);
        }
        unit_value(unit, g, u, (c.hidden + 2) * kAccEps * g_mag, (c.hidden + 2) * kAccEps * u_mag, &h[i], &h_error[i]);
      }
      for (int64_t o = 0; o < c.outputs; ++o) {
        long double y = biases ? value_of(p.down_b[e * c.outputs + o]) : 0, y_mag = std::fabs(y), y_error = 0;
        for (int64_t i = 0; i < c.inter; ++i) {
          const long double dw = value_of(p.down_w[(e * c.outputs + o) * c.inter + i]);
          y += h[i] * dw;
          y_mag += std::fabs(h[i] * dw);
          y_error += std::fabs(dw) * h_error[i];
        }
        y_error += (c.inter + 2) * kAccEps * y_mag;
        ref.out[t * c.outputs + o] += w * y;
        ref.bound[t * c.outputs + o] += std::fabs(w) * (y_error + (c.k + 2) * kAccEps * std::fabs(y));
      }
    }
  for (size_t q = 0; q < ref.out.size(); ++q)
    ref.bound[q] = ref.bound[q] * 1.05L + kDataEps * std::fabs(ref.out[q]) * 1.01L + kDataTiny + 1e-300L;
  return ref;
}

// --------------------------------------------------------------- layout --
// The operator's tensors for one run: up_weight (and gate_weight) and down_weight in the run's
// layout and gate form, and the biases where the form has them.
struct Tensors {
  std::vector<storage_t> up, gate, down, up_bias, down_bias;
  std::vector<int32_t> ids32;
  std::vector<int64_t> ids64;
  std::vector<unsigned char> weights;  // bytes in the run's weight dtype
};

void bits_in_dtype(double v, int dtype, unsigned char* out) {
  switch (dtype) {
    case TUTEL_WEIGHTS_FLOAT64: std::memcpy(out, &v, 8); break;
    case TUTEL_WEIGHTS_FLOAT16: { const uint16_t b = core::float_to_fp16(float(v)).bits; std::memcpy(out, &b, 2); break; }
    case TUTEL_WEIGHTS_BFLOAT16: { const uint16_t b = core::float_to_bf16(float(v)).bits; std::memcpy(out, &b, 2); break; }
    default: { const float f = float(v); std::memcpy(out, &f, 4); }
  }
}

int64_t weight_size(int dtype) {
  return dtype == TUTEL_WEIGHTS_FLOAT64 ? 8 : (dtype == TUTEL_WEIGHTS_FLOAT32 ? 4 : 2);
}

Tensors lay_out(const Problem& p, const Case& c, const DecodeRun& run) {
  Tensors t;
  const int64_t E = c.experts, H = c.hidden, I = c.inter, O = c.outputs;
  const bool separate = run.gate == Gate::kSeparate, interleaved = run.gate == Gate::kInterleaved;
  const int64_t width = separate ? I : 2 * I;  // up_weight's rows (columns) per expert
  // Where unit i's gate and up values sit among those rows (columns).
  auto gate_at = [&](int64_t i) { return interleaved ? 2 * i : i; };
  auto up_at = [&](int64_t i) { return interleaved ? 2 * i + 1 : (separate ? i : I + i); };
  auto place = [&](int64_t e, int64_t r, int64_t d) {  // matrix row r (of width), feature d
    return run.transposed ? (e * H + d) * width + r : (e * width + r) * H + d;
  };
  t.up.assign(E * width * H, storage_of(0));
  if (separate) t.gate.assign(E * width * H, storage_of(0));
  std::vector<storage_t>& gates = separate ? t.gate : t.up;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < I; ++i)
      for (int64_t d = 0; d < H; ++d) {
        gates[place(e, gate_at(i), d)] = p.gate_w[(e * I + i) * H + d];
        t.up[place(e, up_at(i), d)] = p.up_w[(e * I + i) * H + d];
      }
  t.down.assign(E * O * I, storage_of(0));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t i = 0; i < I; ++i)
        t.down[run.transposed ? (e * I + i) * O + o : (e * O + o) * I + i] = p.down_w[(e * O + o) * I + i];
  if (interleaved) {
    t.up_bias.assign(E * width, storage_of(0));
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < I; ++i) {
        t.up_bias[e * width + gate_at(i)] = p.gate_b[e * I + i];
        t.up_bias[e * width + up_at(i)] = p.up_b[e * I + i];
      }
    t.down_bias = p.down_b;
  }
  for (int64_t e : p.ids) {
    t.ids32.push_back(int32_t(e));
    t.ids64.push_back(e);
  }
  if (run.weights_dtype >= 0) {
    t.weights.resize(p.weights.size() * weight_size(run.weights_dtype));
    for (size_t q = 0; q < p.weights.size(); ++q)
      bits_in_dtype(p.weights[q], run.weights_dtype, t.weights.data() + q * weight_size(run.weights_dtype));
  }
  return t;
}

// -------------------------------------------------------------- launches --
struct Launched {
  std::vector<storage_t> out;
  bool gate_up_vector, down_vector;
};

// What decode_experts_cuda launches; with `weak`, the buffers the kernels write are weak memory
// (cuda_emulation.h): a y row read before its block fenced it reads as the garbage it started as.
Launched decode_on_cpu(const Problem& p, const Case& c, const DecodeRun& run, LaunchOptions options,
                       bool weak = false) {
  const Tensors t = lay_out(p, c, run);
  DeviceBuffer<storage_t> x(p.x), up(t.up), gate(t.gate), down(t.down), up_bias(t.up_bias), down_bias(t.down_bias);
  DeviceBuffer<int32_t> ids32(t.ids32);
  DeviceBuffer<int64_t> ids64(t.ids64);
  DeviceBuffer<unsigned char> weights(t.weights);
  const tutel::cuda::DecodePlan plan =
      tutel::cuda::plan_decode_experts(c.tokens, c.k, c.hidden, c.inter, c.outputs, run.transposed, sizeof(storage_t),
                                       x.data(), c.hidden, {up.data(), gate.data()}, down.data());
  DeviceBuffer<acc_t> h(c.tokens * c.k * c.inter), y(c.tokens * c.k * c.outputs);
  DeviceBuffer<int> counters(plan.counter_ints);
  DeviceBuffer<storage_t> out(c.tokens * c.outputs);
  if (weak) options.weak_memory = {h.region(), y.region(), counters.region(), out.region()};
  TutelDecodeRouting routing{};
  routing.expert_ids = run.ids_int64 ? static_cast<const void*>(ids64.data()) : static_cast<const void*>(ids32.data());
  routing.ids_token_stride = c.k;
  routing.ids_choice_stride = 1;
  routing.weights = run.weights_dtype >= 0 ? weights.data() : nullptr;
  routing.weights_token_stride = c.k;
  routing.weights_choice_stride = 1;
  routing.tokens = c.tokens;
  routing.k = c.k;
  routing.experts = c.experts;
  routing.ids_int64 = run.ids_int64;
  routing.weights_dtype = std::max(run.weights_dtype, 0);
  const Unit u = unit_of(run.gate);
  const TutelDecodeUnit unit{double(u.alpha), double(u.up_offset), double(u.limit), int(u.clamped),
                             int(run.gate == Gate::kInterleaved)};
  const storage_t* gate_ptr = run.gate == Gate::kSeparate ? gate.data() : nullptr;
#define TUTEL_GATE_UP_CALL(kernel)                                                                              \
  TUTEL_EMULATED_LAUNCH(kernel, plan.gate_up_grid, options, x.data(), c.hidden, routing, up.data(), gate_ptr,   \
                        up_bias.data(), c.hidden, c.inter, unit, h.data(), counters.data(), plan.counter_ints,  \
                        out.data(), c.outputs)
#define TUTEL_DOWN_CALL(kernel)                                                                                 \
  TUTEL_EMULATED_LAUNCH(kernel, plan.down_grid, options, h.data(), routing, down.data(), down_bias.data(),      \
                        c.inter, c.outputs, y.data(), counters.data(), out.data())
  if (run.transposed) {
    if (plan.gate_up_vector) TUTEL_GATE_UP_CALL(decode_gate_up_columns_vector);
    else TUTEL_GATE_UP_CALL(decode_gate_up_columns_scalar);
    if (plan.down_vector) TUTEL_DOWN_CALL(decode_down_columns_vector);
    else TUTEL_DOWN_CALL(decode_down_columns_scalar);
  } else {
    if (plan.gate_up_vector) TUTEL_GATE_UP_CALL(decode_gate_up_rows_vector);
    else TUTEL_GATE_UP_CALL(decode_gate_up_rows_scalar);
    if (plan.down_vector) TUTEL_DOWN_CALL(decode_down_rows_vector);
    else TUTEL_DOWN_CALL(decode_down_rows_scalar);
  }
#undef TUTEL_GATE_UP_CALL
#undef TUTEL_DOWN_CALL
  return Launched{out.values(), plan.gate_up_vector, plan.down_vector};
}

// The (layout, gate form, ids, weights) runs of a case, in turn.
std::vector<DecodeRun> runs_of(const Case& c) {
  const DecodeRun all[] = {
      {false, Gate::kConcatenated, false, TUTEL_WEIGHTS_FLOAT32},
      {true, Gate::kInterleaved, true, TUTEL_WEIGHTS_BFLOAT16},
      {false, Gate::kSeparate, true, TUTEL_WEIGHTS_FLOAT64},
      {true, Gate::kConcatenated, false, TUTEL_WEIGHTS_FLOAT16},
      {false, Gate::kInterleaved, false, -1},
      {true, Gate::kSeparate, true, TUTEL_WEIGHTS_FLOAT32},
  };
  return std::vector<DecodeRun>(all, all + std::min<int>(c.runs, 6));
}

void expect_close(const Launched& got, const Reference& want, const Case& c, const DecodeRun& run,
                  const LaunchOptions& options, bool weak) {
  for (int64_t q = 0; q < c.tokens * c.outputs; ++q) {
    const long double v = value_of(got.out[q]);
    ASSERT_LE(std::fabs(v - want.out[q]), want.bound[q])
        << "token " << q / c.outputs << ", output " << q % c.outputs << ": got " << double(v) << ", want "
        << double(want.out[q]) << "; transposed " << run.transposed << ", gate form " << int(run.gate)
        << ", vector kernels " << got.gate_up_vector << got.down_vector << ", schedule " << int(options.schedule)
        << ", grid schedule " << int(options.grid) << (weak ? ", weak memory" : "");
  }
}

class DecodeExpertsCu : public ::testing::TestWithParam<Case> {};

TEST_P(DecodeExpertsCu, MatchesFloat64Loop) {
  const Case& c = GetParam();
  std::mt19937 rng(unsigned(c.tokens * 1009 + c.k * 101 + c.experts * 13 + c.hidden * 7 + c.inter));
  const Problem p = make_problem(c, rng);
  int run_index = 0;
  for (const DecodeRun& run : runs_of(c)) {
    // The first run under run-ahead (which exposes a missing barrier), the others in turn.
    const LaunchOptions options = schedule_for_case(run_index == 0 ? 3 : int(c.tokens + c.experts) + run_index);
    ++run_index;
    const Reference want = reference(p, c, run);
    expect_close(decode_on_cpu(p, c, run, options), want, c, run, options, false);
    // The first two runs (one per layout) again with blocks interleaved or delayed and weak memory.
    if (run_index <= 2) {
      const LaunchOptions cross = cross_block_schedules_for_case(int(c.tokens + c.experts))[run_index - 1];
      expect_close(decode_on_cpu(p, c, run, cross, true), want, c, run, cross, true);
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> all;
  auto add = [&](int64_t T, int64_t k, int64_t E, int64_t H, int64_t I, int64_t O) -> Case& {
    all.push_back(Case{T, k, E, H, I, O});
    return all.back();
  };
  add(1, 1, 1, 13, 7, 13);                       // one of everything, odd sizes
  add(3, 2, 4, 24, 16, 24);                      // 16-byte sizes: the vector kernels
  add(5, 3, 8, 33, 19, 33).dropped = 4;          // dropped choices, a token keeping none
  add(2, 8, 5, 16, 40, 16).repeat_in_token = true;  // an expert chosen twice by one token
  add(16, 4, 6, 16, 8, 16).few_experts = true;   // 21+ choices per expert: several passes
  add(7, 2, 3, 8, 33, 17);                       // outputs != hidden, several tiles of units
  add(32, 2, 2, 9, 5, 9);                        // 32 tokens on 2 experts
  add(32, 8, 256, 16, 8, 16).runs = 1;           // 256 experts, 768 blocks: one run
  add(1, 8, 256, 20, 12, 20);                    // one token over many experts
  return all;
}

INSTANTIATE_TEST_SUITE_P(Shapes, DecodeExpertsCu, ::testing::ValuesIn(cases()), [](const auto& info) {
  const Case& c = info.param;
  return "T" + std::to_string(c.tokens) + "_k" + std::to_string(c.k) + "_E" + std::to_string(c.experts) + "_H" +
         std::to_string(c.hidden) + "_I" + std::to_string(c.inter) + "_" + std::to_string(info.index);
});

}  // namespace

// kernels/quantized_decode.cu on the CPU, launched as csrc/ops/cuda/decode_quantized_experts_cuda.cpp
// launches it (the gate/up kernel, then the down kernel), against a long double loop written from
// the formats' specifications: every output within a bound on the kernels' float32 rounding
// propagated through the unit (whose values are rounded to the data type) and the down product,
// plus one rounding to the data type.
//
// Every format (mxfp4; nvfp4 with its per-matrix scale; fp8_block with 128 x 128 blocks, partial
// along both dimensions, 16 x 16 and odd 5 x 7 blocks) with every unit (SwiGLU, gpt-oss' clamped
// interleaved unit, gelu, gelu_tanh, relu), 16-byte and one-byte chunks (rows of other lengths,
// codes off 16-byte alignment), T in {1, 3, 17, 32}, k 1 to 8, dropped ids (-1, E, E + 5, a token
// keeping none), biases and routing weights present or not, experts with many choices (several
// passes).  The first run of each case goes again under the cross-block schedules with the
// kernels' buffers as weak memory (the down kernel's count-and-combine).
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
#define TUTEL_KERNEL_SOURCE "../../../kernels/quantized_decode.cu"
#endif
#include TUTEL_KERNEL_SOURCE
#include "exact_sums.h"
#include "quant_reference.h"

namespace {

using namespace kernels_on_cpu;

enum class Unit { kSwiGLU, kGptOss, kGelu, kGeluTanh, kRelu };
const char* const kUnitNames[] = {"swiglu", "gptoss", "gelu", "gelutanh", "relu"};
const char* const kFormatNames[] = {"mxfp4", "nvfp4", "fp8"};

struct Case {
  int format;  // TUTEL_QUANT_*
  Unit unit;
  int64_t tokens, k, experts, hidden, inter, outputs;
  int64_t block_rows = 1, block_cols = 1;  // fp8_block's
  bool biases = false;
  bool weights = true;
  int dropped = 0;          // choices given an id outside [0, E); >= k: the last token keeps none
  bool misaligned = false;  // codes one byte past 16-byte alignment: the one-byte chunks
  bool few_experts = false;  // ids from the first min(E, 2) experts only (several passes)
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << kFormatNames[c.format] << " " << kUnitNames[int(c.unit)] << " T=" << c.tokens << " k=" << c.k
       << " E=" << c.experts << " H=" << c.hidden << " I=" << c.inter << " O=" << c.outputs;
}

bool gated(Unit u) { return u == Unit::kSwiGLU || u == Unit::kGptOss; }
int activation_of(Unit u) {
  switch (u) {
    case Unit::kGelu: return TUTEL_UNIT_GELU;
    case Unit::kGeluTanh: return TUTEL_UNIT_GELU_TANH;
    case Unit::kRelu: return TUTEL_UNIT_RELU;
    default: return TUTEL_UNIT_GATED;
  }
}

// The case's stack of rows x cols (quant_reference.h's random codes and scales).
Stack make_stack(const Case& c, int64_t rows, int64_t cols, std::mt19937& rng) {
  return random_stack(c.format, c.experts, rows, cols, c.block_rows, c.block_cols, rng);
}

struct Problem {
  std::vector<storage_t> x;
  Stack gate_up, down;  // gate_up: 2I rows (gated: gates then ups, or alternating), or I
  std::vector<float> gate_up_bias, down_bias, weights;
  std::vector<int64_t> ids;
};

Problem make_problem(const Case& c, std::mt19937& rng) {
  Problem p;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t q = 0; q < c.tokens * c.hidden; ++q) p.x.push_back(storage_of(normal(rng)));
  const int64_t up_rows = gated(c.unit) ? 2 * c.inter : c.inter;
  p.gate_up = make_stack(c, up_rows, c.hidden, rng);
  p.down = make_stack(c, c.outputs, c.inter, rng);
  if (c.biases) {
    for (int64_t q = 0; q < c.experts * up_rows; ++q) p.gate_up_bias.push_back(0.5f * normal(rng));
    for (int64_t q = 0; q < c.experts * c.outputs; ++q) p.down_bias.push_back(0.5f * normal(rng));
  }
  const int64_t pairs = c.tokens * c.k;
  std::uniform_int_distribution<int64_t> expert(0, (c.few_experts ? std::min<int64_t>(c.experts, 2) : c.experts) - 1);
  for (int64_t q = 0; q < pairs; ++q) p.ids.push_back(expert(rng));
  for (int d = 0; d < c.dropped && pairs > 0; ++d) {
    const int64_t bad[] = {-1, c.experts, c.experts + 5};
    p.ids[rng() % pairs] = bad[d % 3];
  }
  if (c.dropped >= c.k && c.tokens > 1)  // the last token keeps no choice
    for (int64_t j = 0; j < c.k; ++j) p.ids[(c.tokens - 1) * c.k + j] = -1;
  std::uniform_int_distribution<int> weight(1, 64);
  if (c.weights)
    for (int64_t q = 0; q < pairs; ++q) p.weights.push_back(float(weight(rng)) / 64.0f);
  return p;
}

// ------------------------------------------------------------ reference --
struct UnitParams {
  long double alpha = 1, up_offset = 0, limit = 0;
  bool clamped = false, interleaved = false;
};

UnitParams params_of(Unit unit) {
  UnitParams u;
  if (unit == Unit::kGptOss) {  // gpt-oss' unit, with a limit the test's values cross
    u.alpha = 1.702L;
    u.up_offset = 1;
    u.limit = 1.25L;
    u.clamped = true;
    u.interleaved = true;
  }
  return u;
}

// h and a bound on the error of the kernels' h, from the gate and up values and bounds on theirs.
void unit_value(Unit unit, long double g, long double u, long double g_error, long double u_error, long double* h,
                long double* h_error) {
  const long double eps = kAccEps;
  switch (unit) {
    case Unit::kGelu:
      *h = 0.5L * u * (1.0L + std::erf(u / std::sqrt(2.0L)));
      *h_error = 1.2L * u_error + 16.0L * eps * (std::fabs(*h) + std::fabs(u));  // |gelu'| < 1.13
      return;
    case Unit::kGeluTanh:
      *h = 0.5L * u * (1.0L + std::tanh(std::sqrt(2.0L / 3.14159265358979323846L) * (u + 0.044715L * u * u * u)));
      *h_error = 1.2L * u_error + 16.0L * eps * (std::fabs(*h) + std::fabs(u));
      return;
    case Unit::kRelu:
      *h = u > 0 ? u : 0;
      *h_error = u_error;
      return;
    default: break;
  }
  const UnitParams p = params_of(unit);
  if (p.clamped) {
    g = std::min(g, p.limit);
    u = std::max(std::min(u, p.limit), -p.limit);
  }
  const long double s = 1.0L / (1.0L + std::exp(-p.alpha * g));
  *h = (u + p.up_offset) * g * s;
  // |d h / d g| and |d h / d u| (clamping only lowers them), then the unit's own roundings.
  const long double dg = std::fabs((u + p.up_offset) * s * (1.0L + p.alpha * g * (1.0L - s)));
  const long double du = std::fabs(g * s);
  *h_error = dg * g_error + du * u_error + 16.0L * eps * (std::fabs(*h) + du * std::fabs(p.up_offset));
}

struct Reference {
  std::vector<long double> out, bound;
};

Reference reference(const Problem& p, const Case& c) {
  const UnitParams params = params_of(c.unit);
  const bool is_gated = gated(c.unit);
  Reference ref;
  ref.out.assign(size_t(c.tokens * c.outputs), 0.0L);
  ref.bound.assign(size_t(c.tokens * c.outputs), 0.0L);
  std::vector<long double> h(size_t(c.inter)), h_error(size_t(c.inter));
  // Each product's float32 rounding, the scales' (fp8_block's code times scale, nvfp4's global
  // scale), the bias and the sum: a few units of rounding per term beyond the length.
  auto row_dot = [&](const Stack& s, int64_t e, int64_t n, const long double* v, int64_t len, long double bias,
                     long double* magnitude) {
    long double sum = bias, mag = std::fabs(bias);
    for (int64_t q = 0; q < len; ++q) {
      const long double term = s.value(e, n, q) * v[q];
      sum += term;
      mag += std::fabs(term);
    }
    *magnitude = mag;
    return sum;
  };
  std::vector<long double> x_row(size_t(c.hidden));
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t d = 0; d < c.hidden; ++d) x_row[size_t(d)] = value_of(p.x[size_t(t * c.hidden + d)]);
    for (int64_t j = 0; j < c.k; ++j) {
      const int64_t e = p.ids[size_t(t * c.k + j)];
      if (e < 0 || e >= c.experts) continue;
      const long double w = c.weights ? (long double)p.weights[size_t(t * c.k + j)] : 1.0L;
      const int64_t up_rows = p.gate_up.rows;
      for (int64_t i = 0; i < c.inter; ++i) {
        const int64_t gate_row = params.interleaved ? 2 * i : i;
        const int64_t up_row = is_gated ? (params.interleaved ? 2 * i + 1 : c.inter + i) : i;
        auto bias_of = [&](int64_t row) { return c.biases ? (long double)p.gate_up_bias[size_t(e * up_rows + row)] : 0.0L; };
        long double g = 0, g_mag = 0, u_mag = 0;
        const long double u = row_dot(p.gate_up, e, up_row, x_row.data(), c.hidden, bias_of(up_row), &u_mag);
        if (is_gated) g = row_dot(p.gate_up, e, gate_row, x_row.data(), c.hidden, bias_of(gate_row), &g_mag);
        unit_value(c.unit, g, u, (c.hidden + 6) * kAccEps * g_mag, (c.hidden + 6) * kAccEps * u_mag, &h[size_t(i)],
                   &h_error[size_t(i)]);
        // h rounded to the data type (a relative half unit, tiny values to the subnormal step)
        h_error[size_t(i)] += kDataEps * (std::fabs(h[size_t(i)]) + h_error[size_t(i)]) + kDataTiny;
      }
      for (int64_t o = 0; o < c.outputs; ++o) {
        const long double bias = c.biases ? (long double)p.down_bias[size_t(e * c.outputs + o)] : 0.0L;
        long double y_mag = 0, y_error = 0;
        const long double y = row_dot(p.down, e, o, h.data(), c.inter, bias, &y_mag);
        for (int64_t i = 0; i < c.inter; ++i) y_error += std::fabs(p.down.value(e, o, i)) * h_error[size_t(i)];
        y_error += (c.inter + 6) * kAccEps * y_mag;
        ref.out[size_t(t * c.outputs + o)] += w * y;
        ref.bound[size_t(t * c.outputs + o)] += std::fabs(w) * (y_error + (c.k + 2) * kAccEps * std::fabs(y));
      }
    }
  }
  for (size_t q = 0; q < ref.out.size(); ++q)
    ref.bound[q] = ref.bound[q] * 1.05L + kDataEps * std::fabs(ref.out[q]) * 1.01L + kDataTiny + 1e-30L;
  return ref;
}

// -------------------------------------------------------------- launches --
struct Launched {
  std::vector<storage_t> out;
  bool gate_up_vector, down_vector;
};

// The device copy of a stack, its codes `shift` bytes past 16-byte alignment.
struct DeviceStack {
  DeviceBuffer<uint8_t> codes, byte_scales;
  DeviceBuffer<float> float_scales, global;
  TutelQuantMatrix matrix;
  DeviceStack(const Stack& s, int shift)
      : codes(s.codes, shift), byte_scales(s.byte_scales), float_scales(s.float_scales), global(s.global) {
    matrix.codes = codes.data();
    matrix.scales = s.format == TUTEL_QUANT_FP8_BLOCK ? static_cast<const void*>(float_scales.data())
                                                      : static_cast<const void*>(byte_scales.data());
    matrix.global = global.data();  // nullptr when empty (the fp4 formats other than nvfp4, fp8_block)
    matrix.rows = s.rows;
    matrix.cols = s.cols;
    matrix.block_rows = s.block_rows;
    matrix.block_cols = s.block_cols;
  }
};

// What decode_quantized_experts_cuda launches; with `weak`, the buffers the kernels write are weak
// memory (cuda_emulation.h): a y row read before its block fenced it reads as the garbage it started as.
Launched decode_on_cpu(const Problem& p, const Case& c, LaunchOptions options, bool weak) {
  DeviceBuffer<storage_t> x(p.x);
  const DeviceStack gate_up(p.gate_up, c.misaligned ? 1 : 0), down(p.down, c.misaligned ? 1 : 0);
  DeviceBuffer<float> gate_up_bias(p.gate_up_bias), down_bias(p.down_bias), weights(p.weights);
  DeviceBuffer<int64_t> ids(p.ids);
  const tutel::cuda::DecodePlan plan =
      tutel::cuda::plan_quantized_decode(c.tokens, c.k, c.hidden, c.inter, c.outputs, c.format, c.block_cols,
                                         sizeof(storage_t), x.data(), c.hidden, gate_up.matrix.codes,
                                         down.matrix.codes);
  DeviceBuffer<float> h(c.tokens * c.k * c.inter), y(c.tokens * c.k * c.outputs);
  DeviceBuffer<int> counters(plan.counter_ints);
  DeviceBuffer<storage_t> out(c.tokens * c.outputs);
  if (weak) options.weak_memory = {h.region(), y.region(), counters.region(), out.region()};
  TutelDecodeRouting routing{};
  routing.expert_ids = ids.data();
  routing.ids_token_stride = c.k;
  routing.ids_choice_stride = 1;
  routing.weights = weights.data();
  routing.weights_token_stride = c.k;
  routing.weights_choice_stride = 1;
  routing.tokens = c.tokens;
  routing.k = c.k;
  routing.experts = c.experts;
  routing.ids_int64 = 1;
  routing.weights_dtype = TUTEL_WEIGHTS_FLOAT32;
  const UnitParams u = params_of(c.unit);
  const TutelDecodeUnit unit{double(u.alpha), double(u.up_offset), double(u.limit), int(u.clamped),
                             int(u.interleaved)};
  const int activation = activation_of(c.unit);
#define TUTEL_GATE_UP_CALL(kernel)                                                                             \
  TUTEL_EMULATED_LAUNCH(kernel, plan.gate_up_grid, options, x.data(), c.hidden, routing, gate_up.matrix,       \
                        gate_up_bias.data(), c.inter, unit, activation, h.data(), counters.data(),             \
                        plan.counter_ints, out.data(), c.outputs)
#define TUTEL_DOWN_CALL(kernel)                                                                                \
  TUTEL_EMULATED_LAUNCH(kernel, plan.down_grid, options, h.data(), routing, down.matrix, down_bias.data(),     \
                        c.inter, c.outputs, y.data(), counters.data(), out.data())
#define TUTEL_FORMAT_CALLS(format)                                                                             \
  if (plan.gate_up_vector) TUTEL_GATE_UP_CALL(quantized_gate_up_##format##_vector);                            \
  else TUTEL_GATE_UP_CALL(quantized_gate_up_##format##_scalar);                                                \
  if (plan.down_vector) TUTEL_DOWN_CALL(quantized_down_##format##_vector);                                     \
  else TUTEL_DOWN_CALL(quantized_down_##format##_scalar);
  switch (c.format) {
    case TUTEL_QUANT_MXFP4: TUTEL_FORMAT_CALLS(mxfp4) break;
    case TUTEL_QUANT_NVFP4: TUTEL_FORMAT_CALLS(nvfp4) break;
    default: TUTEL_FORMAT_CALLS(fp8_block) break;
  }
#undef TUTEL_FORMAT_CALLS
#undef TUTEL_GATE_UP_CALL
#undef TUTEL_DOWN_CALL
  return Launched{out.values(), plan.gate_up_vector, plan.down_vector};
}

void expect_close(const Launched& got, const Reference& want, const Case& c, const LaunchOptions& options, bool weak) {
  for (int64_t q = 0; q < c.tokens * c.outputs; ++q) {
    const long double v = value_of(got.out[size_t(q)]);
    ASSERT_LE(std::fabs(v - want.out[size_t(q)]), want.bound[size_t(q)])
        << "token " << q / c.outputs << ", output " << q % c.outputs << ": got " << double(v) << ", want "
        << double(want.out[size_t(q)]) << "; vector kernels " << got.gate_up_vector << got.down_vector
        << ", schedule " << int(options.schedule) << ", grid schedule " << int(options.grid)
        << (weak ? ", weak memory" : "");
  }
}

class QuantizedDecodeCu : public ::testing::TestWithParam<Case> {};

TEST_P(QuantizedDecodeCu, MatchesTheFormatsLongDoubleLoop) {
  const Case& c = GetParam();
  std::mt19937 rng(unsigned(c.format * 7919 + int(c.unit) * 977 + c.tokens * 1009 + c.k * 101 + c.hidden * 7 +
                            c.inter + c.block_cols));
  const Problem p = make_problem(c, rng);
  const Reference want = reference(p, c);
  const int index = int(c.tokens + c.experts + c.k + int(c.unit));
  // Under run-ahead (which exposes a missing barrier) and one of the other schedules, then the
  // blocks interleaved or delayed with weak memory.
  for (const LaunchOptions& options : schedules_for_case(index)) expect_close(decode_on_cpu(p, c, options, false), want, c, options, false);
  const LaunchOptions cross = cross_block_schedules_for_case(index)[size_t(index % 2)];
  expect_close(decode_on_cpu(p, c, cross, true), want, c, cross, true);
}

// The plan takes 16-byte chunks exactly where the kernels can read them.
TEST(QuantizedDecodePlan, SixteenByteChunksWhereRowsAndPointersAllowThem) {
  alignas(16) static unsigned char memory[64];
  const void* aligned = memory;
  const void* off = memory + 8;
  using tutel::cuda::plan_quantized_decode;
  // mxfp4 rows (K a multiple of 32) are whole chunks; float32 x with rows of 64 elements.
  auto plan = plan_quantized_decode(3, 2, 64, 32, 13, TUTEL_QUANT_MXFP4, 1, 4, aligned, 64, aligned, aligned);
  EXPECT_TRUE(plan.gate_up_vector && plan.down_vector);
  EXPECT_EQ(plan.gate_up_grid.x, 6);
  EXPECT_EQ(plan.gate_up_grid.y, 4);
  EXPECT_EQ(plan.down_grid.y, 2);
  EXPECT_EQ(plan.counter_ints, 6);
  // Misaligned codes, an x row stride off 16 bytes, misaligned x.
  EXPECT_FALSE(plan_quantized_decode(3, 2, 64, 32, 13, TUTEL_QUANT_MXFP4, 1, 4, aligned, 64, off, aligned).gate_up_vector);
  EXPECT_FALSE(plan_quantized_decode(3, 2, 64, 32, 13, TUTEL_QUANT_MXFP4, 1, 2, aligned, 68, aligned, aligned).gate_up_vector);
  EXPECT_FALSE(plan_quantized_decode(3, 2, 64, 32, 13, TUTEL_QUANT_MXFP4, 1, 4, off, 64, aligned, aligned).gate_up_vector);
  // nvfp4 rows of 48 elements are 24 bytes: one-byte chunks; of 32: 16 bytes.
  plan = plan_quantized_decode(1, 1, 48, 32, 5, TUTEL_QUANT_NVFP4, 1, 2, aligned, 48, aligned, aligned);
  EXPECT_FALSE(plan.gate_up_vector);
  EXPECT_TRUE(plan.down_vector);
  // fp8_block: rows a multiple of 16 bytes and blocks a multiple of 16 columns wide.
  EXPECT_TRUE(plan_quantized_decode(1, 1, 64, 48, 5, TUTEL_QUANT_FP8_BLOCK, 16, 2, aligned, 64, aligned, aligned).down_vector);
  EXPECT_FALSE(plan_quantized_decode(1, 1, 64, 48, 5, TUTEL_QUANT_FP8_BLOCK, 8, 2, aligned, 64, aligned, aligned).down_vector);
  EXPECT_FALSE(plan_quantized_decode(1, 1, 200, 40, 5, TUTEL_QUANT_FP8_BLOCK, 128, 2, aligned, 200, aligned, aligned).gate_up_vector);
}

// Each code's value, decoded by the kernels' bit placement, is the specification's.
TEST(QuantizedDecodeCodes, EveryCodeDecodesToItsValue) {
  for (unsigned c = 0; c < 16; ++c) EXPECT_EQ((long double)e2m1_value(c), e2m1(c)) << c;
  for (unsigned b = 0; b < 256; ++b) {
    if ((b & 0x7fu) == 0x7fu) {
      EXPECT_TRUE(std::isnan(e4m3_value(b))) << b;
    } else {
      EXPECT_EQ((long double)e4m3_value(b), e4m3(b)) << b;
    }
    if (b == 255u) {
      EXPECT_TRUE(std::isnan(e8m0_value(b)));
    } else {
      EXPECT_EQ((long double)e8m0_value(b), e8m0(b)) << b;
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> all;
  // Each format's shapes: (H, I, O, fp8 block).
  struct Shape {
    int format;
    int64_t hidden, inter, outputs, block_rows, block_cols;
  };
  const Shape shapes[] = {
      {TUTEL_QUANT_MXFP4, 64, 32, 13, 1, 1},        // 16-byte chunks, odd O
      {TUTEL_QUANT_NVFP4, 48, 16, 11, 1, 1},        // rows of 24 and 8 bytes: one-byte chunks
      {TUTEL_QUANT_NVFP4, 64, 32, 9, 1, 1},         // 16-byte chunks: two scales each
      {TUTEL_QUANT_FP8_BLOCK, 200, 72, 17, 128, 128},  // partial blocks along N (2I = 144) and K (200, 72)
      {TUTEL_QUANT_FP8_BLOCK, 64, 48, 21, 16, 16},  // 16-byte chunks, a partial row block of O
      {TUTEL_QUANT_FP8_BLOCK, 33, 19, 9, 5, 7},     // odd sizes and blocks
  };
  const int64_t tokens[] = {1, 3, 17, 32};
  int n = 0;
  for (const Shape& s : shapes)
    for (Unit unit : {Unit::kSwiGLU, Unit::kGptOss, Unit::kGelu, Unit::kGeluTanh, Unit::kRelu}) {
      Case c{s.format, unit, tokens[n % 4], 1 + n % 8, 5, s.hidden, s.inter, s.outputs, s.block_rows, s.block_cols};
      if (c.tokens == 32) c.k = std::min<int64_t>(c.k, 2);  // keeps the emulation's grid small
      c.biases = n % 2 == 0 || unit == Unit::kGptOss;
      c.weights = n % 3 != 1;
      c.dropped = n % 4 == 1 ? int(c.k) + 1 : 0;
      ++n;
      all.push_back(c);
    }
  // One-byte chunks of mxfp4 (codes off alignment); one token over eight experts; many choices
  // of two experts (several passes each); 32 tokens of 8 choices.
  Case misaligned{TUTEL_QUANT_MXFP4, Unit::kGptOss, 3, 2, 4, 96, 32, 7};
  misaligned.misaligned = true;
  misaligned.biases = true;
  all.push_back(misaligned);
  Case one{TUTEL_QUANT_NVFP4, Unit::kSwiGLU, 1, 8, 9, 64, 32, 16};
  one.dropped = 2;
  all.push_back(one);
  Case crowded{TUTEL_QUANT_FP8_BLOCK, Unit::kSwiGLU, 17, 3, 6, 64, 16, 16, 16, 16};
  crowded.few_experts = true;
  all.push_back(crowded);
  Case widest{TUTEL_QUANT_MXFP4, Unit::kGelu, 32, 8, 16, 32, 32, 8};
  widest.dropped = 9;
  all.push_back(widest);
  return all;
}

INSTANTIATE_TEST_SUITE_P(Shapes, QuantizedDecodeCu, ::testing::ValuesIn(cases()), [](const auto& info) {
  const Case& c = info.param;
  return std::string(kFormatNames[c.format]) + "_" + kUnitNames[int(c.unit)] + "_T" + std::to_string(c.tokens) +
         "_k" + std::to_string(c.k) + "_H" + std::to_string(c.hidden) + "_" + std::to_string(info.index);
});

}  // namespace

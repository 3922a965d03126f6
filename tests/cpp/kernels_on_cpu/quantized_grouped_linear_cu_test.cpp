// kernels/quantized_grouped_linear.cu on the CPU, launched as csrc/ops/cuda/quantized_grouped_linear_cuda.cpp
// launches it (one kernel, its grid from the shapes), against a long double loop with the weights
// decoded from the formats' specifications (quant_reference.h): every output within the float32
// rounding of its sum plus one rounding to the data type, zeros for the rows past the last end,
// nothing left unwritten.  The tensor-core products run on tutel_device.cuh's emulation of
// m16n8k16, itself tested here against a plain 16 x 16 x 8 product.
//
// mxfp4 and nvfp4 (its per-matrix scale), fp8_block with 128 x 128 blocks partial along both
// dimensions (K = 200), 16 x 32 blocks, and blocks not a multiple of 16 wide (5 x 7, 16 x 24: the
// steps split at block boundaries); odd N and several column tiles; experts without rows, more
// experts than rows (and than threads), rows past the last end, one row, no rows; a tile boundary
// inside an expert; biases or none; rows with a stride past K (and off 16-byte alignment), codes
// off 16-byte alignment (byte loads).  Every case runs under run-ahead and another thread
// schedule, then under a cross-block schedule with the output as weak memory.
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
#define TUTEL_KERNEL_SOURCE "../../../kernels/quantized_grouped_linear.cu"
#endif
#include TUTEL_KERNEL_SOURCE
#include "exact_sums.h"
#include "quant_reference.h"

// One m16n8k16 product by every warp of a block (the emulation needs whole blocks); warp 0 writes
// its fragments of D.  a, b: each lane's registers (lane-major), d: 4 floats per lane.
void mma_once(const unsigned* a, const unsigned* b, const float* c, bool half, float* d) {
  const unsigned lane = threadIdx.x & 31u;
  const unsigned a_regs[4] = {a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3]};
  const unsigned b_regs[2] = {b[2 * lane], b[2 * lane + 1]};
  const float c_regs[4] = {c[4 * lane], c[4 * lane + 1], c[4 * lane + 2], c[4 * lane + 3]};
  float d_regs[4];
  if (half) {
    mma_m16n8k16_f16(d_regs, a_regs, b_regs, c_regs);
  } else {
    mma_m16n8k16_bf16(d_regs, a_regs, b_regs, c_regs);
  }
  if (threadIdx.x < 32)
    for (int i = 0; i < 4; ++i) d[4 * lane + i] = d_regs[i];
}

namespace {

using namespace kernels_on_cpu;

// ------------------------------------------------------------------- mma --
// The 16-bit bits of a value that both bfloat16 and float16 hold exactly.
unsigned short bits_of(float v, bool half) {
  if (half) return emulated_cvt_rn_f16_f32(v);
  unsigned bits;
  std::memcpy(&bits, &v, 4);
  return (unsigned short)(bits >> 16);
}

// The fragments of A (16 x 16), B (16 x 8) and C (16 x 8) written from the PTX ISA's layout
// (section 9.7.14.5.8), independently of tutel_device.cuh, and D = A B + C compared with a plain
// loop.  The values are small multiples of 1/4 (exact sums), so D must match exactly.
TEST(MmaM16n8k16, MatchesAPlainProductInBothTypes) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> quarter(-12, 12);
  for (bool half : {false, true}) {
    float A[16][16], B[16][8], C[16][8];
    for (auto& row : A)
      for (float& v : row) v = quarter(rng) / 4.0f;
    for (auto& row : B)
      for (float& v : row) v = quarter(rng) / 4.0f;
    for (auto& row : C)
      for (float& v : row) v = quarter(rng) / 4.0f;
    std::vector<unsigned> a(128), b(64);
    std::vector<float> c(128), d(128, -1.0f);
    auto pair = [&](float low, float high) { return unsigned(bits_of(low, half)) | (unsigned(bits_of(high, half)) << 16); };
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane >> 2, t = lane & 3;
      a[4 * lane + 0] = pair(A[g][2 * t], A[g][2 * t + 1]);
      a[4 * lane + 1] = pair(A[g + 8][2 * t], A[g + 8][2 * t + 1]);
      a[4 * lane + 2] = pair(A[g][2 * t + 8], A[g][2 * t + 9]);
      a[4 * lane + 3] = pair(A[g + 8][2 * t + 8], A[g + 8][2 * t + 9]);
      b[2 * lane + 0] = pair(B[2 * t][g], B[2 * t + 1][g]);
      b[2 * lane + 1] = pair(B[2 * t + 8][g], B[2 * t + 9][g]);
      c[4 * lane + 0] = C[g][2 * t];
      c[4 * lane + 1] = C[g][2 * t + 1];
      c[4 * lane + 2] = C[g + 8][2 * t];
      c[4 * lane + 3] = C[g + 8][2 * t + 1];
    }
    tutel::emulation::launch("mma_once", 1, 1, TUTEL_BLOCK_THREADS,
                             [&] { mma_once(a.data(), b.data(), c.data(), half, d.data()); }, schedule_for_case(3));
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 4; ++i) {
        const int row = (lane >> 2) + 8 * (i >> 1), col = 2 * (lane & 3) + (i & 1);
        double want = C[row][col];
        for (int k = 0; k < 16; ++k) want += double(A[row][k]) * B[k][col];
        EXPECT_EQ(double(d[4 * lane + i]), want) << "D(" << row << ", " << col << "), float16 " << half;
      }
  }
}

// ------------------------------------------------------------ the cases --
const char* const kFormatNames[] = {"mxfp4", "nvfp4", "fp8"};

struct Case {
  int format;  // TUTEL_QUANT_*
  int64_t rows, experts, depth, outputs;  // n, E, K, N
  std::vector<int64_t> counts;            // rows per expert; their sum may be below `rows` (a tail)
  int64_t block_rows = 1, block_cols = 1;  // fp8_block's
  bool bias = false;
  int64_t row_padding = 0;  // extra elements per row: a row stride past K
  bool misaligned = false;  // codes one byte past 16-byte alignment
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << kFormatNames[c.format] << " n=" << c.rows << " E=" << c.experts << " K=" << c.depth << " N=" << c.outputs
       << " block " << c.block_rows << "x" << c.block_cols;
}

struct Problem {
  std::vector<storage_t> rows;  // [n, K + padding]
  Stack stack;
  std::vector<float> bias;
  std::vector<int> ends;
  std::vector<int64_t> begin, end;  // each expert's rows
  int64_t row_stride = 0;
};

Problem make_problem(const Case& c, std::mt19937& rng) {
  Problem p;
  p.row_stride = c.depth + c.row_padding;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t q = 0; q < c.rows * p.row_stride; ++q) p.rows.push_back(storage_of(normal(rng)));
  p.stack = random_stack(c.format, c.experts, c.outputs, c.depth, c.block_rows, c.block_cols, rng);
  if (c.bias)
    for (int64_t q = 0; q < c.experts * c.outputs; ++q) p.bias.push_back(0.5f * normal(rng));
  int64_t running = 0;
  for (int64_t count : c.counts) {
    p.begin.push_back(running);
    running += count;
    p.end.push_back(running);
    p.ends.push_back(int(running));
  }
  return p;
}

// What quantized_grouped_linear_cuda launches.
std::vector<storage_t> linear_on_cpu(const Problem& p, const Case& c, LaunchOptions options, bool weak) {
  DeviceBuffer<storage_t> rows(p.rows);
  DeviceBuffer<uint8_t> codes(p.stack.codes, c.misaligned ? 1 : 0), byte_scales(p.stack.byte_scales);
  DeviceBuffer<float> float_scales(p.stack.float_scales), global(p.stack.global), bias(p.bias);
  DeviceBuffer<int> ends(p.ends);
  DeviceBuffer<storage_t> out(c.rows * c.outputs);
  TutelQuantMatrix m{};
  m.codes = codes.data();
  m.scales = c.format == TUTEL_QUANT_FP8_BLOCK ? static_cast<const void*>(float_scales.data())
                                               : static_cast<const void*>(byte_scales.data());
  m.global = global.data();  // nullptr but for nvfp4
  m.rows = c.outputs;
  m.cols = c.depth;
  m.block_rows = c.block_rows;
  m.block_cols = c.block_cols;
  if (weak) options.weak_memory = {out.region()};
  const tutel::cuda::Grid grid = tutel::cuda::plan_quantized_grouped_linear(c.rows, c.experts, c.outputs);
  const float* bias_data = c.bias ? bias.data() : nullptr;
  switch (c.format) {
    case TUTEL_QUANT_MXFP4:
      TUTEL_EMULATED_LAUNCH(quantized_grouped_linear_mxfp4, grid, options, rows.data(), p.row_stride, ends.data(),
                            c.rows, c.experts, m, bias_data, out.data());
      break;
    case TUTEL_QUANT_NVFP4:
      TUTEL_EMULATED_LAUNCH(quantized_grouped_linear_nvfp4, grid, options, rows.data(), p.row_stride, ends.data(),
                            c.rows, c.experts, m, bias_data, out.data());
      break;
    default:
      TUTEL_EMULATED_LAUNCH(quantized_grouped_linear_fp8_block, grid, options, rows.data(), p.row_stride,
                            ends.data(), c.rows, c.experts, m, bias_data, out.data());
  }
  return out.values();
}

// Every output against the long double loop: within the float32 rounding of a sum of K products
// (float32 rows as three bfloat16 parts: three products per step, summed in float32, each step's
// sum times its scale added to the total) plus one rounding to the data type.
void expect_matches(const std::vector<storage_t>& got, const Problem& p, const Case& c, const LaunchOptions& options,
                    bool weak) {
  ASSERT_EQ(int64_t(got.size()), c.rows * c.outputs);
  for (int64_t e = 0; e < c.experts; ++e)
    for (int64_t r = p.begin[size_t(e)]; r < p.end[size_t(e)]; ++r)
      for (int64_t n = 0; n < c.outputs; ++n) {
        long double exact = c.bias ? (long double)p.bias[size_t(e * c.outputs + n)] : 0.0L;
        long double magnitude = std::fabs(exact);
        for (int64_t k = 0; k < c.depth; ++k) {
          const long double term = value_of(p.rows[size_t(r * p.row_stride + k)]) * p.stack.value(e, n, k);
          exact += term;
          magnitude += std::fabs(term);
        }
        const long double bound = (3 * c.depth + 64) * kAccEps * magnitude * 1.01L +
                                  kDataEps * std::fabs(exact) * 1.01L + kDataTiny + 1e-30L;
        const long double v = value_of(got[size_t(r * c.outputs + n)]);
        ASSERT_LE(std::fabs(v - exact), bound)
            << "row " << r << " (expert " << e << "), output " << n << ": got " << double(v) << ", want "
            << double(exact) << "; schedule " << int(options.schedule) << ", grid schedule " << int(options.grid)
            << (weak ? ", weak memory" : "");
      }
  const int64_t kept = p.end.empty() ? 0 : p.end.back();
  for (int64_t r = kept; r < c.rows; ++r)
    for (int64_t n = 0; n < c.outputs; ++n)
      ASSERT_EQ(value_of(got[size_t(r * c.outputs + n)]), 0.0L) << "row " << r << " past the last end, output " << n;
}

class QuantizedGroupedLinearCu : public ::testing::TestWithParam<Case> {};

TEST_P(QuantizedGroupedLinearCu, MatchesTheFormatsLongDoubleLoop) {
  const Case& c = GetParam();
  std::mt19937 rng(unsigned(c.format * 7919 + c.rows * 1009 + c.experts * 101 + c.depth * 7 + c.outputs +
                            c.block_cols));
  const Problem p = make_problem(c, rng);
  const int index = int(c.rows + c.experts + c.outputs);
  for (const LaunchOptions& options : schedules_for_case(index))
    expect_matches(linear_on_cpu(p, c, options, false), p, c, options, false);
  const LaunchOptions cross = cross_block_schedules_for_case(index)[size_t(index % 2)];
  expect_matches(linear_on_cpu(p, c, cross, true), p, c, cross, true);
}

// The grid comes from the shapes alone: rows / 64 + experts + 1 row tiles by the column tiles.
TEST(QuantizedGroupedLinearPlan, TheGridBoundsEveryGrouping) {
  const tutel::cuda::Grid grid = tutel::cuda::plan_quantized_grouped_linear(150, 4, 70);
  EXPECT_EQ(grid.x, 150 / TUTEL_QUANT_TILE_ROWS + 4 + 1);
  EXPECT_EQ(grid.y, 2);
  EXPECT_TRUE(tutel::cuda::grid_is_empty(tutel::cuda::plan_quantized_grouped_linear(0, 4, 70)));
  EXPECT_TRUE(tutel::cuda::grid_is_empty(tutel::cuda::plan_quantized_grouped_linear(5, 4, 0)));
}

// Rows per expert for `experts` experts over `kept` rows: random, some experts empty.
std::vector<int64_t> random_counts(int64_t experts, int64_t kept, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int64_t> counts(size_t(experts), 0);
  std::uniform_int_distribution<int64_t> pick(0, experts - 1);
  for (int64_t i = 0; i < kept; ++i) ++counts[size_t(pick(rng))];
  return counts;
}

Case make_case(int format, int64_t rows, int64_t experts, int64_t depth, int64_t outputs, std::vector<int64_t> counts,
               int64_t block_rows = 1, int64_t block_cols = 1) {
  Case c{format, rows, experts, depth, outputs, std::move(counts)};
  c.block_rows = block_rows;
  c.block_cols = block_cols;
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> all;
  const int mx = TUTEL_QUANT_MXFP4, nv = TUTEL_QUANT_NVFP4, fp8 = TUTEL_QUANT_FP8_BLOCK;
  Case c = make_case(mx, 37, 3, 64, 13, {9, 0, 17});  // odd N, an idle expert, 11 rows past the last end
  c.bias = true;
  c.row_padding = 3;  // a row stride past K, off 16-byte alignment: element loads
  all.push_back(c);
  all.push_back(make_case(mx, 70, 2, 96, 70, {1, 69}));  // a tile boundary inside an expert; two column tiles; K: 1.5 tiles
  c = make_case(nv, 8, 4, 48, 11, {0, 5, 0, 1});  // K = 48: three of the four steps; 2 rows past the end
  c.bias = true;
  all.push_back(c);
  c = make_case(nv, 5, 9, 128, 9, random_counts(9, 5, 1));  // more experts than rows
  c.misaligned = true;  // byte loads of the codes
  c.bias = true;
  c.row_padding = 8;  // a row stride past K, 16-byte aligned: vector loads
  all.push_back(c);
  c = make_case(fp8, 20, 2, 200, 144, {7, 11}, 128, 128);  // partial blocks along N and K
  c.bias = true;
  c.row_padding = 4;
  all.push_back(c);
  all.push_back(make_case(fp8, 30, 3, 200, 17, {10, 0, 20}, 16, 32));  // small blocks
  c = make_case(fp8, 23, 3, 200, 19, {8, 6, 4}, 5, 7);  // blocks of 7: steps split at block boundaries
  c.bias = true;
  all.push_back(c);
  all.push_back(make_case(fp8, 66, 2, 72, 33, {40, 26}, 16, 24));  // blocks 24 wide; a tile boundary
  c = make_case(mx, 1, 1, 32, 1, {1});  // one of everything
  c.bias = true;
  all.push_back(c);
  all.push_back(make_case(nv, 0, 3, 32, 5, {0, 0, 0}));  // no rows
  all.push_back(make_case(mx, 3, 2, 32, 6, {0, 0}));     // every row past the last end
  all.push_back(make_case(fp8, 40, 270, 16, 8, random_counts(270, 33, 2), 3, 16));  // more experts than threads
  return all;
}

INSTANTIATE_TEST_SUITE_P(Shapes, QuantizedGroupedLinearCu, ::testing::ValuesIn(cases()), [](const auto& info) {
  const Case& c = info.param;
  return std::string(kFormatNames[c.format]) + "_n" + std::to_string(c.rows) + "_E" + std::to_string(c.experts) +
         "_K" + std::to_string(c.depth) + "_N" + std::to_string(c.outputs) + "_" + std::to_string(info.index);
});

}  // namespace

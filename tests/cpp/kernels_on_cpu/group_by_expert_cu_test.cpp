// kernels/group_by_expert.cu on the CPU, launched as group_by_expert_cuda
// (csrc/ops/cuda/group_by_expert_cuda.cpp) launches it, against csrc/core's
// group_choices_by_expert (the CPU operator): locations, slot choices, sorted ids, counts
// and ends bit for bit, for int32 and int64 ids read in place row-major, through padded rows
// and as a transposed view; ids outside [0, E) of every kind; more experts than the shared
// memory's bucket starts hold.
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "core/routing.h"
#include "harness.h"
#include "../../../kernels/group_by_expert.cu"

namespace {

using namespace kernels_on_cpu;
namespace core = tutel::core;

struct Case {
  int64_t tokens, k, experts;
  int dropped_percent;  // choices given an id outside [0, experts)
  bool one_expert;      // every kept choice picks expert experts / 2 (one bucket holds all)
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "T=" << c.tokens << " k=" << c.k << " E=" << c.experts << " dropped=" << c.dropped_percent << "%"
       << (c.one_expert ? " one expert" : "");
}

struct Grouping {
  std::vector<int32_t> locations;
  std::vector<int64_t> slot_choices, sorted_ids, counts;
  std::vector<int32_t> ends;
};

// Outputs that start as 0xff bytes, so an element nobody writes shows.
Grouping garbage_grouping(const Case& c) {
  const int64_t choices = c.tokens * c.k;
  return Grouping{garbage<int32_t>(choices), garbage<int64_t>(choices), garbage<int64_t>(choices),
                  garbage<int64_t>(c.experts), garbage<int32_t>(c.experts)};
}

// The kernels' 64-bit integers are long long; int64_t is long on Linux.
i64* as_i64(std::vector<int64_t>& v) { return reinterpret_cast<i64*>(v.data()); }

// group_by_expert_cuda with the emulated kernels; id (t, j) at ids[t * token_stride + j * choice_stride].
template <class I>
Grouping group_on_cpu(const std::vector<I>& ids, int64_t token_stride, int64_t choice_stride, const Case& c,
                      const LaunchOptions& options) {
  const auto plan = tutel::cuda::plan_group_by_expert(c.tokens, c.k, c.experts);
  std::vector<int32_t> count_table = garbage<int32_t>(plan.table_ints);
  std::vector<int32_t> next_table = garbage<int32_t>(plan.table_ints);
  std::vector<int32_t> bucket_scratch = garbage<int32_t>(plan.bucket_scratch_ints);
  Grouping g = garbage_grouping(c);
  const void* id_data = ids.empty() ? nullptr : ids.data();
  const int ids_64bit = sizeof(I) == 8;
  TUTEL_EMULATED_LAUNCH(count_expert_choices, plan.count_grid, options, id_data, ids_64bit, token_stride,
                        choice_stride, c.tokens, c.k, c.experts, plan.chunk_choices, plan.chunks,
                        count_table.data());
  TUTEL_EMULATED_LAUNCH(place_expert_choices, plan.place_grid, options, id_data, ids_64bit, token_stride,
                        choice_stride, c.tokens, c.k, c.experts, plan.chunk_choices, plan.chunks,
                        count_table.data(), next_table.data(), bucket_scratch.data(), g.locations.data(),
                        as_i64(g.slot_choices), as_i64(g.sorted_ids), as_i64(g.counts), g.ends.data());
  return g;
}

// Row-major [T, k] ids: random experts (many repeats), some ids outside [0, E): -1, E, far
// beyond, and for int64 values whose low 32 bits are valid experts or INT32_MIN.
template <class I>
std::vector<I> random_ids(const Case& c, std::mt19937& rng) {
  std::uniform_int_distribution<int64_t> expert(0, c.experts - 1);
  std::uniform_int_distribution<int> percent(0, 99);
  const int64_t outside[] = {-1, c.experts, c.experts + 1000, -(int64_t(1) << 31), (int64_t(1) << 32) + 1,
                             int64_t(1) << 40};
  std::vector<I> ids(static_cast<size_t>(c.tokens * c.k));
  int dropped = 0;
  for (auto& id : ids) {
    if (percent(rng) < c.dropped_percent) {
      id = I(outside[dropped++ % (sizeof(I) == 8 ? 6 : 4)]);
    } else {
      id = I(c.one_expert ? c.experts / 2 : expert(rng));
    }
  }
  return ids;
}

template <class I>
Grouping group_on_core(const std::vector<I>& ids, const Case& c) {
  Grouping want = garbage_grouping(c);
  core::group_choices_by_expert(ids.data(), c.tokens, c.k, c.experts, want.locations.data(),
                                want.slot_choices.data(), want.sorted_ids.data(), want.counts.data(),
                                want.ends.data());
  return want;
}

void expect_same(const Grouping& got, const Grouping& want) {
  EXPECT_TRUE(same_bits(got.locations, want.locations)) << "locations";
  EXPECT_TRUE(same_bits(got.slot_choices, want.slot_choices)) << "slot_choices";
  EXPECT_TRUE(same_bits(got.sorted_ids, want.sorted_ids)) << "sorted_ids";
  EXPECT_TRUE(same_bits(got.counts, want.counts)) << "counts";
  EXPECT_TRUE(same_bits(got.ends, want.ends)) << "ends";
}

template <class I>
void check_ids_of_type(const Case& c, int seed) {
  std::mt19937 rng(unsigned(c.tokens * 13 + c.k * 7 + c.experts * 3 + c.dropped_percent + seed));
  const std::vector<I> ids = random_ids<I>(c, rng);
  const Grouping want = group_on_core(ids, c);
  // The same ids column-major (a transposed view's strides) and in rows padded by 3 ids.
  std::vector<I> transposed(ids.size()), padded(static_cast<size_t>(c.tokens * (c.k + 3)), I(0));
  for (int64_t t = 0; t < c.tokens; ++t)
    for (int64_t j = 0; j < c.k; ++j) {
      transposed[j * c.tokens + t] = ids[t * c.k + j];
      padded[t * (c.k + 3) + j] = ids[t * c.k + j];
    }
  for (const LaunchOptions& options : schedules_for_case(int(c.tokens + c.k + c.experts) + seed)) {
    SCOPED_TRACE(::testing::Message() << "schedule " << int(options.schedule));
    {
      SCOPED_TRACE("row-major");
      expect_same(group_on_cpu(ids, c.k, 1, c, options), want);
    }
    {
      SCOPED_TRACE("transposed");
      expect_same(group_on_cpu(transposed, 1, c.tokens, c, options), want);
    }
    {
      SCOPED_TRACE("padded rows");
      expect_same(group_on_cpu(padded, c.k + 3, 1, c, options), want);
    }
  }
}

class GroupByExpertCu : public ::testing::TestWithParam<Case> {};

TEST_P(GroupByExpertCu, Int32IdsMatchCoreBitForBit) { check_ids_of_type<int32_t>(GetParam(), 0); }

TEST_P(GroupByExpertCu, Int64IdsMatchCoreBitForBit) { check_ids_of_type<int64_t>(GetParam(), 1); }

// Every T from 0 to 40 with k = 3 and 5 experts (some ids dropped): the edges of the warps'
// rounds of 32 choices.
TEST(GroupByExpertCuSizes, EveryTokenCountUpTo40) {
  for (int64_t tokens = 0; tokens <= 40; ++tokens) {
    SCOPED_TRACE(::testing::Message() << "T=" << tokens);
    check_ids_of_type<int32_t>(Case{tokens, 3, 5, 15, false}, int(tokens));
  }
}

// The plan keeps the count tables' reads near a few per choice while cutting large inputs
// into several chunks and blocks, and still launches the placing block without choices.
TEST(GroupByExpertPlan, ChunksAndGrids) {
  const auto empty = tutel::cuda::plan_group_by_expert(0, 4, 8);
  EXPECT_EQ(empty.chunks, 0);
  EXPECT_TRUE(tutel::cuda::grid_is_empty(empty.count_grid));
  EXPECT_EQ(empty.place_grid.x, 1);  // counts and ends are still written
  const auto big = tutel::cuda::plan_group_by_expert(65536, 8, 128);
  EXPECT_GT(big.chunks, 8 * 8);
  EXPECT_EQ(big.chunk_choices % 32, 0);
  EXPECT_LE(big.place_grid.x * big.table_ints, 8 * 65536 * 8);
  EXPECT_EQ(tutel::cuda::plan_group_by_expert(4, 2, TUTEL_GROUP_SHARED_BUCKETS - 2).bucket_scratch_ints, 0);
  EXPECT_EQ(tutel::cuda::plan_group_by_expert(4, 2, TUTEL_GROUP_SHARED_BUCKETS).bucket_scratch_ints,
            TUTEL_GROUP_SHARED_BUCKETS + 2);
}

// Empty and tiny inputs; k from 0 to 32; one expert; 256 to 1024 experts; more buckets than
// shared memory holds (9000 experts); all choices dropped; every kept choice on one expert;
// and up to 3001 tokens, several chunks per block and several blocks.
INSTANTIATE_TEST_SUITE_P(
    Shapes, GroupByExpertCu,
    ::testing::Values(Case{0, 2, 4, 0, false}, Case{5, 0, 3, 0, false}, Case{1, 1, 1, 0, false},
                      Case{1, 8, 128, 0, false}, Case{2, 2, 2, 50, false}, Case{7, 3, 5, 30, false},
                      Case{33, 32, 7, 0, false}, Case{97, 4, 1, 20, false}, Case{40, 6, 9, 100, false},
                      Case{300, 5, 16, 10, true}, Case{700, 4, 3, 5, false}, Case{513, 8, 1024, 3, false},
                      Case{257, 7, 256, 4, false}, Case{20, 3, 9000, 10, false}, Case{1500, 2, 8191, 1, false},
                      Case{2000, 5, 60, 2, false}, Case{3001, 8, 257, 2, false}, Case{2999, 1, 2, 0, false},
                      Case{3000, 3, 300, 0, true}),
    [](const auto& info) {
      const Case& c = info.param;
      return "T" + std::to_string(c.tokens) + "_k" + std::to_string(c.k) + "_E" + std::to_string(c.experts) +
             "_dropped" + std::to_string(c.dropped_percent) + (c.one_expert ? "_one_expert" : "");
    });

}  // namespace

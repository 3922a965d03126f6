// variants: TUTEL_DTYPE_FLOAT32 TUTEL_DTYPE_FLOAT64 TUTEL_DTYPE_FLOAT16 TUTEL_DTYPE_BFLOAT16
//
// tutel::route_experts: the gate's logits [T, E] to the chosen experts, their weights, GShard
// slots, the grouped-rows plan and the GShard loss in two launches, and its backward in one.  The
// rules and every summation order are those of csrc/core/route_experts.h, whose CPU code gives the
// same bits (a GPU's expf / log1pf may differ from the CPU's by an ulp).
//
//   route_experts_route     one block per chunk of tokens, one warp per token: scores, choice,
//                           weights; the chunk's row of counts per (choice, expert) and of the
//                           loss's affinity sums per expert; for batch-prioritized routing the
//                           chunk's tokens sorted by priority.  It also zeroes the second
//                           kernel's phase counters.
//   route_experts_plan      one grid whose blocks take roles in the order they start (a ticket):
//                           [batch-prioritized only: claiming positions, counts per chunk of
//                           positions], the scan (one block per expert; the last to finish also
//                           writes ends and the loss), then the slots and rows.  A block waits
//                           only for blocks with earlier tickets, which have started, so the
//                           phases cannot deadlock however many blocks are resident.
//   route_experts_backward  one warp per token: d logits.
// Integer atomics only (counts), no float atomics: the results are deterministic.
#include "tutel_device.cuh"

#ifndef TUTEL_HAS_DTYPE
#error "route_experts.cu needs one -DTUTEL_DTYPE_<TYPE> option"
#endif

#define TUTEL_WARPS (TUTEL_BLOCK_THREADS / 32)
#define TUTEL_SYNC_TICKET 0   // tickets handed out to route_experts_plan's blocks
#define TUTEL_SYNC_RANKED 1   // blocks done with the claiming positions
#define TUTEL_SYNC_COUNTED 2  // blocks done with the counts per chunk of positions
#define TUTEL_SYNC_SCANNED 3  // expert blocks done with the scan
#define TUTEL_SYNC_READY 4    // 1 once ends and the loss are written
// A warp keeps its chunk's next free slots in shared memory up to this many (choice, expert) pairs.
#define TUTEL_ROUTE_CACHE_INTS 512
// Entries of an expert's column of counts each thread scans at once.
#define TUTEL_SCAN_ITEMS 4

// finfo(storage).eps (normalize_gates' clamp) and finfo(storage).tiny (the affinity's clamp).
#if defined(TUTEL_DTYPE_FLOAT64)
#define TUTEL_EPS 0x1p-52
#define TUTEL_TINY 0x1p-1022
#elif defined(TUTEL_DTYPE_FLOAT32)
#define TUTEL_EPS 0x1p-23f
#define TUTEL_TINY 0x1p-126f
#elif defined(TUTEL_DTYPE_BFLOAT16)
#define TUTEL_EPS 0x1p-7f
#define TUTEL_TINY 0x1p-126f
#else
#define TUTEL_EPS 0x1p-10f
#define TUTEL_TINY 0x1p-14f
#endif

__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }
__device__ __forceinline__ float acc_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double acc_log1p(double x) { return log1p(x); }
__device__ __forceinline__ float acc_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double acc_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ acc_t acc_infinity() { return acc_t(1) / acc_t(0); }

// The value a stored tensor of the data's dtype would hold.
__device__ __forceinline__ acc_t round_to_storage(acc_t v) { return to_acc(from_acc(v)); }

// The larger value, as both the CPU and a warp's butterfly take it (NaN never wins; ties keep a).
__device__ __forceinline__ acc_t max_combine(acc_t a, acc_t b) { return b > a ? b : a; }

// Data written by other blocks of the same launch: read past the (incoherent) L1 cache.
__device__ __forceinline__ int load_fresh(const int* p) { return *(const volatile int*)p; }
__device__ __forceinline__ i64 load_fresh(const i64* p) { return *(const volatile i64*)p; }
__device__ __forceinline__ acc_t load_fresh(const acc_t* p) { return *(const volatile acc_t*)p; }

// One token's scores.  `max` and `sum` are the softmax's largest logit and sum of exp(z - max);
// `norm` the sum of the scores (the affinity of non-softmax scores).
struct TokenScores {
  const storage_t* row;
  int score;
  acc_t max, sum, norm;

  __device__ acc_t z(i64 e) const { return to_acc(row[e]); }

  __device__ acc_t s(i64 e) const {
    const acc_t x = z(e);
    if (score == TUTEL_SCORE_SOFTMAX) return acc_exp(x - max) / sum;
    if (score == TUTEL_SCORE_SIGMOID) return acc_t(1) / (acc_t(1) + acc_exp(-x));
    return acc_sqrt(x > acc_t(20) ? x : acc_log1p(acc_exp(x)));
  }

  __device__ acc_t ds(i64 e) const {
    const acc_t x = z(e), value = s(e);
    if (score == TUTEL_SCORE_SIGMOID) return value * (acc_t(1) - value);
    const acc_t ez = acc_exp(x);
    const acc_t softplus_slope = x > acc_t(20) ? acc_t(1) : ez / (ez + acc_t(1));
    return softplus_slope / (acc_t(2) * value);
  }

  __device__ acc_t affinity(i64 e) const {
    if (score == TUTEL_SCORE_SOFTMAX) return s(e);
    return s(e) / (norm < TUTEL_TINY ? acc_t(TUTEL_TINY) : norm);
  }
};

// A token's scores, measured by a whole warp (every lane gets the same values).
__device__ TokenScores measure_token(const storage_t* row, i64 experts, int score, bool softmax_stats,
                                     bool norm_needed) {
  const unsigned lane = threadIdx.x & 31u;
  TokenScores token{row, score, acc_t(0), acc_t(1), acc_t(1)};
  if (softmax_stats) {
    acc_t largest = -acc_infinity();
    for (i64 e = lane; e < experts; e += 32) largest = max_combine(largest, token.z(e));
    for (int offset = 16; offset > 0; offset >>= 1)
      largest = max_combine(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
    token.max = largest;
    acc_t sum = acc_t(0);
    for (i64 e = lane; e < experts; e += 32) sum += acc_exp(token.z(e) - token.max);
    token.sum = group_sum(sum, 32, 0xffffffffu);
  }
  if (norm_needed) {
    acc_t sum = acc_t(0);
    for (i64 e = lane; e < experts; e += 32) sum += token.s(e);
    token.norm = group_sum(sum, 32, 0xffffffffu);
  }
  return token;
}

// How a token's choice score c is formed (route_experts.h): from the score or the logit, plus the
// selection bias, and -inf outside the token's best groups.
struct ChoiceRule {
  bool after_topk;
  const float* bias32;
  const double* bias64;
  i64 group_size;  // experts per group (0: no group limit)
  const acc_t* group_scores;
  Candidate last_group;  // the worst of the kept groups

  __device__ acc_t unlimited(const TokenScores& token, i64 e) const {
    acc_t c = after_topk ? token.z(e) : round_to_storage(token.s(e));
    if (bias32 != 0 || bias64 != 0) c = round_to_storage(c + round_to_storage(bias32 ? (acc_t)bias32[e] : (acc_t)bias64[e]));
    return c;
  }

  __device__ acc_t value(const TokenScores& token, i64 e) const {
    if (group_size > 0) {
      const int group = (int)(e / group_size);
      const Candidate candidate{group_scores[group], group};
      if (group != last_group.index && !ranks_before(candidate, last_group)) return -acc_infinity();
    }
    return unlimited(token, e);
  }
};

// The best of `count` candidates value(i) ranking after `previous` (all when previous.index < 0).
// Called by a whole warp; every lane gets the result.
template <class Value>
__device__ Candidate warp_best_after(i64 count, Candidate previous, Value value) {
  Candidate best{acc_t(0), -1};
  for (i64 i = threadIdx.x & 31u; i < count; i += 32) {
    const Candidate c{value(i), (int)i};
    if (previous.index >= 0 && !ranks_before(previous, c)) continue;
    if (best.index < 0 || ranks_before(c, best)) best = c;
  }
  return warp_best(best);
}

// Group limiting for one token (whole warp): each lane scores whole groups (the best two choice
// scores of the group, added and rounded), into the warp's `scores`; returns the worst of the
// topk_group best groups.
__device__ Candidate limit_groups(const TokenScores& token, const ChoiceRule& rule, i64 n_group, i64 topk_group,
                                  acc_t* scores) {
  for (i64 g = threadIdx.x & 31u; g < n_group; g += 32) {
    Candidate best{acc_t(0), -1}, second{acc_t(0), -1};
    for (i64 e = g * rule.group_size; e < (g + 1) * rule.group_size; ++e) {
      const Candidate c{rule.unlimited(token, e), (int)e};
      if (best.index < 0 || ranks_before(c, best)) {
        second = best;
        best = c;
      } else if (second.index < 0 || ranks_before(c, second)) {
        second = c;
      }
    }
    scores[g] = rule.group_size < 2 ? best.value : round_to_storage(best.value + second.value);
  }
  __syncwarp();
  Candidate last{acc_t(0), -1};
  for (i64 p = 0; p < topk_group; ++p)
    last = warp_best_after(n_group, last, [&](i64 g) { return scores[g]; });
  return last;
}

// u_j of chosen expert j (before renormalisation): its score, or the softmax over the chosen
// logits given their largest (`top`) and sum of exp(z - top).
__device__ __forceinline__ acc_t chosen_score(const TokenScores& token, bool after_topk, int expert, acc_t top,
                                              acc_t sum) {
  return after_topk ? acc_exp(token.z(expert) - top) / sum : token.s(expert);
}

// The chosen experts' softmax constants (softmax_after_topk): largest logit and sum, sequential in j.
__device__ void chosen_softmax(const TokenScores& token, const int* chosen, i64 stride, i64 k, acc_t& top,
                               acc_t& sum) {
  top = -acc_infinity();
  for (i64 j = 0; j < k; ++j) top = max_combine(top, token.z(chosen[j * stride]));
  sum = acc_t(0);
  for (i64 j = 0; j < k; ++j) sum += acc_exp(token.z(chosen[j * stride]) - top);
}

// normalize_gates' denominator max(sum_j u_j, eps) (NaN stays NaN) and whether it was clamped.
__device__ acc_t weight_denominator(const TokenScores& token, bool after_topk, const int* chosen, i64 stride, i64 k,
                                   acc_t top, acc_t sum, bool& clamped) {
  acc_t total = acc_t(0);
  for (i64 j = 0; j < k; ++j) total += chosen_score(token, after_topk, chosen[j * stride], top, sum);
  clamped = total < TUTEL_EPS;
  return clamped ? acc_t(TUTEL_EPS) : total;
}

// ------------------------------------------------------------ first launch --
// One block per chunk of chunk_tokens tokens (grid: at least one block).  Writes expert_ids and
// weights [k, T]; the chunk's row of table [chunks, k, E] (choices per (choice, expert)); with
// `loss`, the chunk's row of chunk_sums [chunks, E] (sum over its tokens of the affinity, in token
// order); with `prioritized`, the chunk's tokens sorted by (priority key, token) into run_keys /
// run_tokens at the chunk's positions.  Block 0 zeroes the phase counters `sync`.
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    route_experts_route(const storage_t* logits, i64 tokens, i64 experts, i64 k, int score, int after_topk,
                        const float* bias32, const double* bias64, i64 n_group, i64 topk_group, int renormalize,
                        double scaling, int loss, int prioritized, i64 chunk_tokens, int* expert_ids,
                        acc_t* weights, int* table, acc_t* chunk_sums, sort_key_t* run_keys, int* run_tokens,
                        int* sync) {
  __shared__ acc_t token_max[TUTEL_ROUTE_MAX_CHUNK_TOKENS], token_sum[TUTEL_ROUTE_MAX_CHUNK_TOKENS],
      token_norm[TUTEL_ROUTE_MAX_CHUNK_TOKENS];
  __shared__ sort_key_t token_keys[TUTEL_ROUTE_MAX_CHUNK_TOKENS];
  __shared__ acc_t group_scores[TUTEL_WARPS][TUTEL_ROUTE_MAX_GROUPS];
  const i64 first = (i64)blockIdx.x * chunk_tokens;
  const i64 last = first + chunk_tokens < tokens ? first + chunk_tokens : tokens;
  if (blockIdx.x == 0 && threadIdx.x < TUTEL_ROUTE_SYNC_INTS) sync[threadIdx.x] = 0;
  int* counts = table + (i64)blockIdx.x * k * experts;
  for (i64 i = threadIdx.x; i < k * experts; i += blockDim.x) counts[i] = 0;
  __syncthreads();

  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const bool softmax_stats = score == TUTEL_SCORE_SOFTMAX && (!after_topk || loss);
  const bool norm_needed = loss && score != TUTEL_SCORE_SOFTMAX;
  ChoiceRule rule{after_topk != 0, bias32, bias64, n_group > 0 ? experts / n_group : 0, group_scores[warp],
                  Candidate{acc_t(0), -1}};
  for (i64 t = first + warp; t < last; t += TUTEL_WARPS) {
    const TokenScores token = measure_token(logits + t * experts, experts, score, softmax_stats, norm_needed);
    if (n_group > 0) rule.last_group = limit_groups(token, rule, n_group, topk_group, group_scores[warp]);
    Candidate chosen{acc_t(0), -1};
    for (i64 j = 0; j < k; ++j) {
      chosen = warp_best_after(experts, chosen, [&](i64 e) { return rule.value(token, e); });
      if (lane == 0) {
        expert_ids[j * tokens + t] = chosen.index;
        atomicAdd(counts + j * experts + chosen.index, 1);
        if (j == 0) token_keys[t - first] = priority_sort_key(chosen.value);
      }
    }
    if (lane == 0) {
      // The weights, sequential in j, from the indices this lane has just written.
      const int* mine = expert_ids + t;
      acc_t top = acc_t(0), sum = acc_t(1);
      if (after_topk) chosen_softmax(token, mine, tokens, k, top, sum);
      bool clamped = false;
      const acc_t denominator =
          renormalize ? weight_denominator(token, after_topk != 0, mine, tokens, k, top, sum, clamped) : acc_t(1);
      for (i64 j = 0; j < k; ++j) {
        const acc_t u = chosen_score(token, after_topk != 0, mine[j * tokens], top, sum);
        weights[j * tokens + t] = (renormalize ? u / denominator : u) * (acc_t)scaling;
      }
      token_max[t - first] = token.max;
      token_sum[t - first] = token.sum;
      token_norm[t - first] = token.norm;
    }
    __syncwarp();  // the group scores are rewritten for the next token
  }
  __syncthreads();

  if (loss) {
    for (i64 e = threadIdx.x; e < experts; e += blockDim.x) {
      acc_t sum = acc_t(0);
      for (i64 t = first; t < last; ++t) {
        const TokenScores token{logits + t * experts, score, token_max[t - first], token_sum[t - first],
                                token_norm[t - first]};
        sum += token.affinity(e);
      }
      chunk_sums[(i64)blockIdx.x * experts + e] = sum;
    }
  }
  if (prioritized && first + (i64)threadIdx.x < last) {
    // Rank among the chunk's tokens by (key, token): ascending keys are descending priorities.
    const i64 mine = threadIdx.x;
    const sort_key_t key = token_keys[mine];
    i64 rank = 0;
    for (i64 other = 0; other < last - first; ++other)
      rank += token_keys[other] < key || (token_keys[other] == key && other < mine);
    run_keys[first + rank] = key;
    run_tokens[first + rank] = (int)(first + mine);
  }
}

// ----------------------------------------------------------- second launch --
__device__ int take_ticket(int* sync) {
  __shared__ int ticket;
  if (threadIdx.x == 0) ticket = atomicAdd(sync + TUTEL_SYNC_TICKET, 1);
  __syncthreads();
  const int mine = ticket;
  __syncthreads();
  return mine;
}

// Publishes the block's writes and counts the block done; true in the block that completes `total`.
__device__ bool finish_phase(int* counter, i64 total) {
  __shared__ int completes;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) completes = atomicAdd(counter, 1) == total - 1;
  __syncthreads();
  const bool last = completes != 0;
  if (last) __threadfence();
  return last;
}

// Waits until `counter` reaches `target`; the blocks it waits for took earlier tickets.
__device__ void wait_for(const int* counter, i64 target) {
  if (threadIdx.x == 0) {
    while (load_fresh(counter) < target) {
#ifdef TUTEL_HOST_EMULATION
      // On the CPU the emulation runs other blocks meanwhile, or, where it runs the blocks one
      // after another, fails the launch: an unfinished phase there is a wrong role order.
      ::tutel::emulation::wait_for_other_blocks("route_experts_plan: a block waits for blocks that have not run");
#elif __CUDA_ARCH__ >= 700
      __nanosleep(100);
#endif
    }
    __threadfence();
  }
  __syncthreads();
}

// Exclusive prefix sum of one int per thread over the block; `total` gets the block's sum.
// Every thread must call it.
__device__ int block_exclusive_scan(int value, int& total) {
  __shared__ int warp_totals[TUTEL_WARPS];
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  int inclusive = value;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int neighbour = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= (unsigned)offset) inclusive += neighbour;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  int before = 0;
  total = 0;
  for (unsigned w = 0; w < TUTEL_WARPS; ++w) {
    if (w < warp) before += warp_totals[w];
    total += warp_totals[w];
  }
  __syncthreads();
  return before + inclusive - value;
}

// The claiming position of every token (batch-prioritized): its rank in its chunk's sorted run plus,
// in every other chunk's run, the tokens ranking before it (binary search on (key, chunk)).
__device__ void claiming_positions(i64 block, i64 tokens, i64 chunk_tokens, i64 chunks, const sort_key_t* run_keys,
                                   const int* run_tokens, int* order) {
  const i64 position = block * blockDim.x + threadIdx.x;
  if (position >= tokens) return;
  const sort_key_t key = run_keys[position];
  const i64 chunk = position / chunk_tokens;
  i64 claimed = position - chunk * chunk_tokens;
  for (i64 other = 0; other < chunks; ++other) {
    if (other == chunk) continue;
    const i64 begin = other * chunk_tokens;
    const i64 end = begin + chunk_tokens < tokens ? begin + chunk_tokens : tokens;
    i64 low = begin, high = end;  // first entry not ranking before (key, chunk)
    while (low < high) {
      const i64 middle = (low + high) / 2;
      const bool before = run_keys[middle] < key || (run_keys[middle] == key && other < chunk);
      if (before) low = middle + 1; else high = middle;
    }
    claimed += low - begin;
  }
  order[claimed] = run_tokens[position];
}

// The choices of one chunk of claiming positions counted per (choice, expert) into its table row.
__device__ void count_positions(i64 chunk, i64 tokens, i64 experts, i64 k, i64 chunk_tokens, const int* expert_ids,
                                const int* order, int* table) {
  int* counts = table + chunk * k * experts;
  for (i64 i = threadIdx.x; i < k * experts; i += blockDim.x) counts[i] = 0;
  __syncthreads();
  const i64 first = chunk * chunk_tokens;
  const i64 last = first + chunk_tokens < tokens ? first + chunk_tokens : tokens;
  for (i64 j = 0; j < k; ++j)
    for (i64 p = first + threadIdx.x; p < last; p += blockDim.x)
      atomicAdd(counts + j * experts + expert_ids[j * tokens + load_fresh(order + p)], 1);
}

// One expert's column of the table: per choice j, the chunks' counts become the starting slots
// (every first choice before any second choice), counts[j, e] their sum; dispatch_count[e] the total;
// with `loss`, column_sums[e] = block-order sum of the chunks' affinity sums.
__device__ void scan_expert(i64 e, i64 experts, i64 k, i64 chunks, int loss, int* table, const acc_t* chunk_sums,
                            int* counts, i64* dispatch_count, acc_t* column_sums) {
  // The column is the sequence (j, chunk) in that order, TUTEL_SCAN_ITEMS consecutive entries per
  // thread; the entry (j, 0) leaves the start of choice j in counts[j, e], turned into the count below.
  const i64 entries = k * chunks;
  int running = 0;
  for (i64 base = 0; base < entries; base += (i64)blockDim.x * TUTEL_SCAN_ITEMS) {
    int values[TUTEL_SCAN_ITEMS];
    int mine = 0;
    const i64 at = base + (i64)threadIdx.x * TUTEL_SCAN_ITEMS;
#pragma unroll
    for (int i = 0; i < TUTEL_SCAN_ITEMS; ++i) {
      const i64 j = (at + i) / chunks, c = (at + i) - j * chunks;
      values[i] = at + i < entries ? load_fresh(table + (c * k + j) * experts + e) : 0;
      mine += values[i];
    }
    int tile_total = 0;
    int offset = running + block_exclusive_scan(mine, tile_total);
#pragma unroll
    for (int i = 0; i < TUTEL_SCAN_ITEMS; ++i) {
      const i64 j = (at + i) / chunks, c = (at + i) - j * chunks;
      if (at + i < entries) {
        table[(c * k + j) * experts + e] = offset;
        if (c == 0) counts[j * experts + e] = offset;
      }
      offset += values[i];
    }
    running += tile_total;
  }
  __syncthreads();  // the starts are in counts
  if (threadIdx.x == 0) {
    for (i64 j = 0; j < k; ++j) {
      const int next = j + 1 < k ? counts[(j + 1) * experts + e] : running;
      counts[j * experts + e] = next - counts[j * experts + e];
    }
    dispatch_count[e] = running;
  }
  if (loss) {
    acc_t sum = acc_t(0);
    for (i64 c = threadIdx.x; c < chunks; c += blockDim.x) sum += chunk_sums[c * experts + e];
    sum = block_sum(sum);
    if (threadIdx.x == 0) column_sums[e] = sum;
  }
}

// The per-expert results once every column is scanned: ends = running sum of the kept choices
// (min(count, capacity); all of them when dropless) and the loss.
__device__ void finish_experts(i64 tokens, i64 experts, i64 capacity, int loss, const int* counts,
                               const i64* dispatch_count, const acc_t* column_sums, int* ends, acc_t* loss_out) {
  int running = 0;
  for (i64 base = 0; base < experts; base += blockDim.x) {
    const i64 e = base + threadIdx.x;
    int kept = 0;
    if (e < experts) {
      const i64 count = load_fresh(dispatch_count + e);
      kept = (int)(capacity < 0 || count < capacity ? count : capacity);
    }
    int total = 0;
    const int before = block_exclusive_scan(kept, total);
    if (e < experts) ends[e] = running + before + kept;
    running += total;
  }
  acc_t sum = acc_t(0);
  if (loss)
    for (i64 e = threadIdx.x; e < experts; e += blockDim.x)
      sum += (load_fresh(column_sums + e) / (acc_t)tokens) * ((acc_t)load_fresh(counts + e) / (acc_t)tokens);
  sum = block_sum(sum);
  if (threadIdx.x == 0) *loss_out = loss ? sum * (acc_t)experts : acc_t(0);
}

// Slots of one chunk (of token or claiming positions), one warp, 32 positions at a time (claim_slots).
// Writes locations, grouped_locations (the expert's first row + slot, or `rows` when the
// slot is past the capacity) and the row's choice.
__device__ void assign_chunk(i64 chunk, i64 tokens, i64 experts, i64 k, i64 capacity, i64 chunk_tokens, i64 rows,
                             const int* expert_ids, const int* order, int* table, const int* ends, int* cache,
                             int* locations, int* grouped_locations, int* row_choices) {
  const unsigned lane = threadIdx.x & 31u;
  const i64 pairs = k * experts;
  volatile int* next_slot = table + chunk * pairs;
  if (pairs <= TUTEL_ROUTE_CACHE_INTS) {
    for (i64 i = lane; i < pairs; i += 32) cache[i] = next_slot[i];
    next_slot = cache;
    __syncwarp();
  }
  const i64 first = chunk * chunk_tokens;
  const i64 last = first + chunk_tokens < tokens ? first + chunk_tokens : tokens;
  for (i64 j = 0; j < k; ++j) {
    volatile int* next_j = next_slot + j * experts;
    for (i64 base = first; base < last; base += 32) {
      const i64 position = base + lane;
      const bool active = position < last;
      const i64 t = active ? (order ? load_fresh(order + position) : position) : 0;
      const int e = active ? expert_ids[j * tokens + t] : -1;
      const int slot = claim_slots(next_j, e, active);
      if (active) {
        locations[j * tokens + t] = slot;
        const bool kept = capacity < 0 || slot < capacity;
        const i64 row = kept ? (e > 0 ? load_fresh(ends + e - 1) : 0) + slot : rows;
        grouped_locations[j * tokens + t] = (int)row;
        if (kept) row_choices[row] = (int)(j * tokens + t);
      }
    }
  }
}

// The grid has rank_blocks + count_blocks + experts + assign_blocks blocks (see the file comment);
// chunks as in route_experts_route (for batch-prioritized routing, chunks of claiming positions).
// `table` holds the first kernel's counts and becomes the starting slots; `order` (T ints) the
// claiming order; column_sums (E) is scratch.  Writes counts [k, E], dispatch_count [E], ends [E],
// the loss, locations, grouped_locations [k, T] and row_choices [rows] (k T for unused rows).
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    route_experts_plan(i64 tokens, i64 experts, i64 k, i64 capacity, i64 chunk_tokens, i64 chunks, i64 rows,
                       int loss, int prioritized, i64 rank_blocks, i64 count_blocks, i64 assign_blocks,
                       const int* expert_ids, int* table, const acc_t* chunk_sums, const sort_key_t* run_keys,
                       const int* run_tokens, int* order, acc_t* column_sums, int* sync, int* counts,
                       i64* dispatch_count, int* ends, acc_t* loss_out, int* locations, int* grouped_locations,
                       int* row_choices) {
  __shared__ int cache[TUTEL_WARPS][TUTEL_ROUTE_CACHE_INTS];
  i64 role = take_ticket(sync);
  if (role < rank_blocks) {
    claiming_positions(role, tokens, chunk_tokens, chunks, run_keys, run_tokens, order);
    finish_phase(sync + TUTEL_SYNC_RANKED, rank_blocks);
    return;
  }
  role -= rank_blocks;
  if (role < count_blocks) {
    wait_for(sync + TUTEL_SYNC_RANKED, rank_blocks);
    count_positions(role, tokens, experts, k, chunk_tokens, expert_ids, order, table);
    finish_phase(sync + TUTEL_SYNC_COUNTED, count_blocks);
    return;
  }
  role -= count_blocks;
  if (role < experts) {
    if (count_blocks > 0) wait_for(sync + TUTEL_SYNC_COUNTED, count_blocks);
    scan_expert(role, experts, k, chunks, loss, table, chunk_sums, counts, dispatch_count, column_sums);
    if (finish_phase(sync + TUTEL_SYNC_SCANNED, experts)) {
      finish_experts(tokens, experts, capacity, loss, counts, dispatch_count, column_sums, ends, loss_out);
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) atomicExch(sync + TUTEL_SYNC_READY, 1);
    }
    return;
  }
  role -= experts;
  wait_for(sync + TUTEL_SYNC_READY, 1);
  // Rows past the last expert's stay unused.
  for (i64 r = load_fresh(ends + experts - 1) + role * blockDim.x + threadIdx.x; r < rows;
       r += assign_blocks * blockDim.x)
    row_choices[r] = (int)(k * tokens);
  const unsigned warp = threadIdx.x >> 5;
  const i64 chunk = role * TUTEL_WARPS + warp;
  if (chunk >= chunks) return;  // whole warps leave together
  assign_chunk(chunk, tokens, experts, k, capacity, chunk_tokens, rows, expert_ids, prioritized ? order : 0, table,
               ends, cache[warp], locations, grouped_locations, row_choices);
}

// ------------------------------------------------------------------ backward --
// One warp per token: d logits [T, E] (storage dtype) from d weights [k, T] and the loss's 0-dim
// gradient (either may be null), as csrc/core's route_experts_backward.  `loss`: the loss was
// computed and its gradient is given; counts: the forward's [k, E] (row 0: first choices).
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    route_experts_backward(const acc_t* grad_weights, const acc_t* grad_loss, const storage_t* logits, i64 tokens,
                           i64 experts, i64 k, const int* expert_ids, const int* counts, int score, int after_topk,
                           int renormalize, double scaling, int loss, storage_t* grad_logits) {
  const i64 t = (i64)blockIdx.x * TUTEL_WARPS + (threadIdx.x >> 5);
  if (t >= tokens) return;  // whole warps leave together
  const unsigned lane = threadIdx.x & 31u;
  const bool after = after_topk != 0;
  const acc_t scale = (acc_t)scaling;
  const acc_t loss_grad = loss ? *grad_loss : acc_t(0);
  const TokenScores token = measure_token(logits + t * experts, experts, score,
                                          score == TUTEL_SCORE_SOFTMAX && (!after || loss),
                                          loss && score != TUTEL_SCORE_SOFTMAX);
  const int* chosen = expert_ids + t;
  // Every lane computes the sums over the k choices, sequentially.
  acc_t top = acc_t(0), sum = acc_t(1);
  if (after) chosen_softmax(token, chosen, tokens, k, top, sum);
  bool clamped = false;
  const acc_t denominator =
      renormalize ? weight_denominator(token, after, chosen, tokens, k, top, sum, clamped) : acc_t(1);
  acc_t dot = acc_t(0);
  for (i64 j = 0; j < k; ++j)
    dot += (grad_weights ? grad_weights[j * tokens + t] : acc_t(0)) * scale *
           chosen_score(token, after, chosen[j * tokens], top, sum);
  // d L / d u_j through the scaling and the renormalisation.
  auto grad_u = [&](i64 j) {
    const acc_t gr = (grad_weights ? grad_weights[j * tokens + t] : acc_t(0)) * scale;
    return !renormalize ? gr : gr / denominator - (clamped ? acc_t(0) : dot / (denominator * denominator));
  };
  acc_t chosen_dot = acc_t(0);
  for (i64 j = 0; j < k; ++j)
    chosen_dot += grad_u(j) * (after ? chosen_score(token, true, chosen[j * tokens], top, sum)
                                     : token.s(chosen[j * tokens]));
  auto loss_slope = [&](i64 e) {
    return loss_grad * ((acc_t)experts * ((acc_t)counts[e] / (acc_t)tokens) / (acc_t)tokens);
  };
  acc_t loss_dot = acc_t(0);
  if (loss) {
    for (i64 e = lane; e < experts; e += 32) loss_dot += loss_slope(e) * token.s(e);
    loss_dot = group_sum(loss_dot, 32, 0xffffffffu);
  }
  for (i64 e = lane; e < experts; e += 32) {
    i64 j = -1;
    for (i64 i = 0; i < k; ++i)
      if (chosen[i * tokens] == e) j = i;
    acc_t grad = acc_t(0);
    if (after) {
      if (j >= 0) grad = chosen_score(token, true, (int)e, top, sum) * (grad_u(j) - chosen_dot);
      if (loss) grad = grad + token.s(e) * (loss_slope(e) - loss_dot);
    } else if (score == TUTEL_SCORE_SOFTMAX) {
      acc_t g = j >= 0 ? grad_u(j) : acc_t(0);
      if (loss) g = g + loss_slope(e);
      grad = token.s(e) * (g - (loss ? chosen_dot + loss_dot : chosen_dot));
    } else {
      acc_t g = j >= 0 ? grad_u(j) : acc_t(0);
      if (loss) {
        const bool norm_clamped = token.norm < TUTEL_TINY;
        const acc_t norm = norm_clamped ? acc_t(TUTEL_TINY) : token.norm;
        g = g + (loss_slope(e) / norm - (norm_clamped ? acc_t(0) : loss_dot / (norm * norm)));
      }
      grad = g * token.ds(e);
    }
    grad_logits[t * experts + e] = from_acc(grad);
  }
}

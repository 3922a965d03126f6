/* What the CUDA kernels (the .cu files here, compiled by NVRTC at run time) and the
 * host code that launches them (csrc/cuda, csrc/ops/cuda) must agree on.
 * Plain C, read by both compilers. */
#ifndef TUTEL_KERNEL_ABI_H
#define TUTEL_KERNEL_ABI_H

/* Every tutel kernel runs with blocks of this many threads. */
#define TUTEL_BLOCK_THREADS 256

/* The operator that found a data error. */
#define TUTEL_OP_GATHER_SLOTS 1
#define TUTEL_OP_SCATTER_SLOTS 2
#define TUTEL_OP_ASSIGN_LOCATIONS 3

/* What was wrong with the entry (one bit of the key below; an entry with both
 * problems reports its expert index, as the CPU kernels do). */
#define TUTEL_ERROR_EXPERT_INDEX 0
#define TUTEL_ERROR_NEGATIVE_LOCATION 1

/* The dtype of a table of routing weights, which the kernels read as they are
 * (as csrc/core/choice_weights.h's WeightType). */
#define TUTEL_WEIGHTS_FLOAT32 0
#define TUTEL_WEIGHTS_FLOAT64 1
#define TUTEL_WEIGHTS_FLOAT16 2
#define TUTEL_WEIGHTS_BFLOAT16 3

/* dispatch.cu: the weight of choice j of token t is data[j * choice_stride + t * token_stride]
 * (strides in elements, any layout, such as a [tokens, k] tensor seen through .t()), of dtype
 * TUTEL_WEIGHTS_*, converted to the accumulation type in registers; data == 0: weight 1. */
struct TutelChoiceWeights {
  const void* data;
  long long choice_stride;
  long long token_stride;
  int dtype;
};

/* tutel::route_experts (route_experts.cu): the score functions (as csrc/core's ScoreFunction),
 * the most tokens per chunk and groups of experts its shared memory holds, and the ints of its
 * phase counters (in front of its int workspace; zeroed by the first kernel for the second). */
#define TUTEL_SCORE_SOFTMAX 0
#define TUTEL_SCORE_SIGMOID 1
#define TUTEL_SCORE_SQRT_SOFTPLUS 2
#define TUTEL_ROUTE_MAX_CHUNK_TOKENS 256
#define TUTEL_ROUTE_MAX_GROUPS 256
#define TUTEL_ROUTE_SYNC_INTS 8

/* The first data error found on one device since it was last read (device
 * memory).  Only the first launch that fails (the one whose call_id it holds)
 * records, and among its bad entries the smallest key wins:
 *     key = (entry << 33) | (code << 32) | (uint32) value,  entry = choice * tokens + token,
 * so the report names the lowest (choice, token), as the CPU kernels do
 * (entry < 2^31: the host allows at most 2^31 - 1 choices per launch).
 * The empty record is {0, ~0ull, 0, 0}. */
struct TutelErrorRecord {
  unsigned long long call_id;
  unsigned long long key;
  long long tokens;
  long long op;
};

/* Where a launch reports data errors: the device record, a flag in mapped host
 * memory that the host polls without synchronising, and the launch's id.
 * record == 0 turns reporting off (inputs the host produced itself). */
struct TutelErrorSink {
  struct TutelErrorRecord* record;
  unsigned int* flag;
  unsigned long long call_id;
};

/* group_by_expert.cu keeps its bucket starts (experts + 2 ints) in shared memory up to this many
 * ints, and in a scratch table the host allocates (a row per block) beyond. */
#define TUTEL_GROUP_SHARED_BUCKETS 8192

/* gated_units.cu: where the gates and ups of row r lie (unit i at r * stride + step * i; step 2
 * for gpt-oss' interleaved layout, where both point into one row), and the unit's parameters
 * (csrc/core/gated_units.h's GatedUnit; clamped 0 ignores limit).  The per-expert bias of rows
 * grouped by expert: expert e's gate and up bias of unit i at gate_bias / up_bias
 * [e * bias_stride + step * i], row r's expert the first e with expert_ends[e] > r (none past
 * the last expert's rows); expert_ends == 0: no bias. */
struct TutelGatedOperands {
  const void* gate;
  long long gate_stride;
  const void* up;
  long long up_stride;
  long long step;
  long long rows;
  long long width; /* I */
  const void* gate_bias;
  const void* up_bias;
  long long bias_stride;
  const int* expert_ends;
  long long experts;
};
struct TutelGatedUnit {
  double alpha;
  double up_offset;
  double limit;
  int clamped;
};

#endif /* TUTEL_KERNEL_ABI_H */

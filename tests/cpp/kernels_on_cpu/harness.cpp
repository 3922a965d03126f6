#include "harness.h"

namespace kernels_on_cpu {

LaunchOptions schedule_for_case(int case_index) {
  static const Schedule kSchedules[] = {Schedule::kAscending, Schedule::kShuffled, Schedule::kDescending,
                                        Schedule::kRunAhead};
  LaunchOptions options;
  options.schedule = kSchedules[case_index % 4];
  options.seed = uint64_t(case_index) * 7919u + 1u;
  return options;
}

std::vector<LaunchOptions> schedules_for_case(int case_index) {
  LaunchOptions run_ahead = schedule_for_case(3);
  LaunchOptions other = schedule_for_case(case_index % 4 == 3 ? case_index + 1 : case_index);
  return {run_ahead, other};
}

std::vector<LaunchOptions> cross_block_schedules_for_case(int case_index) {
  static const GridSchedule kGrids[] = {GridSchedule::kInterleaved, GridSchedule::kInterleavedDelayed,
                                        GridSchedule::kSequentialDelayed};
  static const unsigned kResident[] = {2, 4, 3, 8};
  std::vector<LaunchOptions> schedules;
  for (int i = 0; i < 2; ++i) {
    LaunchOptions options = schedule_for_case(case_index + i);
    options.grid = kGrids[(case_index + i) % 3];
    options.resident_blocks = kResident[(case_index + i) % 4];
    schedules.push_back(options);
  }
  return schedules;
}

void expect_same_error(const ErrorChannel& channel, const tutel::core::Status& status, int op) {
  const auto error = channel.error();
  if (status.ok()) {
    EXPECT_FALSE(error.has_value()) << "the kernels reported an error the CPU operator did not";
    EXPECT_EQ(channel.flag, 0u);
    return;
  }
  ASSERT_TRUE(error.has_value()) << "the kernels reported no error; the CPU operator found one";
  EXPECT_EQ(channel.flag, 1u);
  EXPECT_EQ(error->op, op);
  EXPECT_EQ(error->code, status.code == tutel::core::StatusCode::kExpertIndexOutOfRange
                             ? TUTEL_ERROR_EXPERT_INDEX : TUTEL_ERROR_NEGATIVE_LOCATION);
  EXPECT_EQ(error->choice, status.choice);
  EXPECT_EQ(error->token, status.token);
  EXPECT_EQ(error->value, status.value);
}

}  // namespace kernels_on_cpu

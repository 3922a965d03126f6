# Mutants: copies of a kernel file with one deliberate bug each, built into the kernel's own
# kernels-on-cpu test in place of the real file.  The ctest `mutant.<kernel>.<name>` passes only
# when that test reports a failure, so a test that stops catching the bug fails the suite.  A
# mutant whose text is no longer in the kernel fails the configure step: update it with the kernel.
#
# tutel_kernel_mutant(KERNEL NAME VARIANT FIND REPLACE [FILE]): kernels/KERNEL.cu with the one
# occurrence of FIND replaced by REPLACE, tested in its variant VARIANT (a -D define of its
# `// variants:`).  With FILE, a header of kernels/ that KERNEL.cu includes by a quoted name is
# the file mutated instead: the mutated header and a copy of KERNEL.cu go side by side, so that
# the copy's include finds the mutated header before the one in kernels/.

function(tutel_kernel_mutant kernel name variant find replace)
  set(mutated_file ${kernel}.cu)
  if(ARGC GREATER 5)
    set(mutated_file ${ARGV5})
  endif()
  set(original ${CMAKE_CURRENT_SOURCE_DIR}/kernels/${mutated_file})
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${original})
  file(READ ${original} source)
  string(FIND "${source}" "${find}" first)
  string(FIND "${source}" "${find}" last REVERSE)
  if(first EQUAL -1 OR NOT first EQUAL last)
    message(FATAL_ERROR "mutant ${kernel}.${name}: its text must occur exactly once in kernels/${mutated_file} "
                        "(tests/cpp/kernels_on_cpu/mutants.cmake):\n${find}")
  endif()
  string(LENGTH "${find}" find_length)
  string(SUBSTRING "${source}" 0 ${first} before)
  math(EXPR after_start "${first} + ${find_length}")
  string(SUBSTRING "${source}" ${after_start} -1 after)
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/mutants/${name}/${mutated_file} "${before}${replace}${after}")
  set(mutated ${CMAKE_CURRENT_BINARY_DIR}/mutants/${name}/${kernel}.cu)
  if(NOT mutated_file STREQUAL "${kernel}.cu")
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/kernels/${kernel}.cu)
    configure_file(${CMAKE_CURRENT_SOURCE_DIR}/kernels/${kernel}.cu ${mutated} COPYONLY)
  endif()

  set(target kernel_mutant_${kernel}_${name})
  add_executable(${target} ${TUTEL_EMULATION_DIR}/${kernel}_cu_test.cpp)
  # The copy includes its neighbours in kernels/ by quoted names.
  target_include_directories(${target} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/kernels)
  target_compile_definitions(${target} PRIVATE TUTEL_HOST_EMULATION ${variant} TUTEL_KERNEL_SOURCE="${mutated}")
  target_compile_options(${target} PRIVATE -Wno-unknown-pragmas -Wno-maybe-uninitialized)
  target_link_libraries(${target} PRIVATE tutel_kernels_on_cpu)
  add_test(NAME mutant.${kernel}.${name} COMMAND ${target} --gtest_brief=1)
  # Caught: GoogleTest reports a failed case (a crash or a clean pass is not a catch).
  set_tests_properties(mutant.${kernel}.${name} PROPERTIES PASS_REGULAR_EXPRESSION "\\[  FAILED  \\]"
                       LABELS kernels-on-cpu-mutants TIMEOUT 300)
endfunction()

# decode_experts.cu (issue: decode at the memory-bandwidth limit): an off-by-one in the down
# projection's loop along a matrix row (the row's last vector or element left out), a missing
# barrier (the transposed gate/up kernel's warps' partial sums read before all are written), and
# the routing weight left out of a token's sum.
tutel_kernel_mutant(decode_experts down_row_loop_ends_early TUTEL_DTYPE_FLOAT32
  "if (v >= vectors) break;\n            const H hv = h_row[v];"
  "if (v + 1 >= vectors) break;\n            const H hv = h_row[v];")
tutel_kernel_mutant(decode_experts gate_up_partials_without_barrier TUTEL_DTYPE_FLOAT32
  "    __syncthreads();\n    if ((int)threadIdx.x < TUTEL_DECODE_COLUMNS * count) {\n      const int m = threadIdx.x / TUTEL_DECODE_COLUMNS, c = threadIdx.x % TUTEL_DECODE_COLUMNS;\n      const i64 i = first_unit + c;"
  "    if ((int)threadIdx.x < TUTEL_DECODE_COLUMNS * count) {\n      const int m = threadIdx.x / TUTEL_DECODE_COLUMNS, c = threadIdx.x % TUTEL_DECODE_COLUMNS;\n      const i64 i = first_unit + c;")
tutel_kernel_mutant(decode_experts combine_without_routing_weight TUTEL_DTYPE_BFLOAT16
  "const acc_t w = routing_weight(r, t, j);"
  "const acc_t w = acc_t(1);" decode_routing.cuh)

# Cross-block ordering (issue 46, guards for GPU-only faults): a block that publishes its data and
# then signals with an atomic, without the fence between.  Only the weak-memory model of the
# cross-block schedules (cuda_emulation.h) can catch these: with sequentially consistent memory
# both mutants give the right results.  decode_experts.cu: the down kernel's y rows counted done
# before they are fenced, so the block completing a token's count sums stale rows.
tutel_kernel_mutant(decode_experts combine_without_fence TUTEL_DTYPE_FLOAT32
  "  __threadfence();  // this thread's y stores are visible to the block that combines them\n"
  "" decode_routing.cuh)
# route_experts.cu: route_experts_plan's phases counted done before the block's stores are fenced
# (claiming positions, scanned columns, ...), so the blocks of the next phase read stale ones.
tutel_kernel_mutant(route_experts phase_done_without_fence TUTEL_DTYPE_FLOAT32
  "  __shared__ int completes;\n  __threadfence();\n  __syncthreads();"
  "  __shared__ int completes;\n  __syncthreads();")

# quantized_decode.cu (issue 45): the E2M1 codes of a byte read in the wrong order (the even
# element is the low nibble), E8M0 scales read with bias 128 instead of 127, fp8_block's scale
# block along K found one element off (caught where a block boundary falls inside the lanes'
# chunks: the one-byte kernels of rows such as K = 200 with 128-wide blocks), and nvfp4's
# per-matrix scale left out of the down products.
tutel_kernel_mutant(quantized_decode nibbles_swapped TUTEL_DTYPE_FLOAT32
  "w[2 * q] = e2m1_value(byte & 15u) * s;  // the even element: the low nibble\n        w[2 * q + 1] = e2m1_value(byte >> 4) * s;"
  "w[2 * q] = e2m1_value(byte >> 4) * s;\n        w[2 * q + 1] = e2m1_value(byte & 15u) * s;")
tutel_kernel_mutant(quantized_decode e8m0_bias_128 TUTEL_DTYPE_BFLOAT16
  "return s == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(s << 23);"
  "return 0.5f * (s == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(s << 23));" quant_codes.cuh)
tutel_kernel_mutant(quantized_decode fp8_block_index_off_by_one TUTEL_DTYPE_FLOAT16
  "const float scale = floats[k0 / block_cols];"
  "const float scale = floats[(k0 + 1) / block_cols];")
tutel_kernel_mutant(quantized_decode nvfp4_without_global_scale TUTEL_DTYPE_FLOAT32
  "const float global = down_matrix.global ? down_matrix.global[e] : 1.0f;"
  "const float global = 1.0f;")

# quantized_grouped_linear.cu: the E2M1 codes of a byte staged in the wrong order, E8M0 scales read
# with bias 128 (quant_codes.cuh, which the quantized kernels share), fp8_block's scale blocks
# along K found one element off where a step is split at block boundaries (blocks 7 and 24 wide)
# and one step off where it is not (the staged scales: 128-wide blocks, K = 200), nvfp4's
# per-matrix scale left out, and the tensor-core fragment of A with its registers a1 and a2
# swapped (rows g + 8 and columns 2t + 8 exchanged: the emulated m16n8k16 follows the PTX ISA's
# layout, so the products come out wrong).
tutel_kernel_mutant(quantized_grouped_linear nibbles_swapped TUTEL_DTYPE_BFLOAT16
  "pair_word(code_bits(e2m1_value(byte & 15u)), code_bits(e2m1_value(byte >> 4)));"
  "pair_word(code_bits(e2m1_value(byte >> 4)), code_bits(e2m1_value(byte & 15u)));")
tutel_kernel_mutant(quantized_grouped_linear e8m0_bias_128 TUTEL_DTYPE_FLOAT16
  "return s == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(s << 23);"
  "return 0.5f * (s == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(s << 23));" quant_codes.cuh)
tutel_kernel_mutant(quantized_grouped_linear fp8_block_index_off_by_one TUTEL_DTYPE_FLOAT32
  "if (kk / w.block_cols != block) b[h] &= 0xffff0000u;"
  "if ((kk + 1) / w.block_cols != block) b[h] &= 0xffff0000u;")
tutel_kernel_mutant(quantized_grouped_linear fp8_block_scale_of_next_step TUTEL_DTYPE_BFLOAT16
  "* per_row + k / w.block_cols];"
  "* per_row + (k + 16) / w.block_cols];")
tutel_kernel_mutant(quantized_grouped_linear nvfp4_without_global_scale TUTEL_DTYPE_FLOAT32
  "if (FORMAT == TUTEL_QUANT_NVFP4) v = v * global;"
  "")
# W8A8 (activation_group > 0): the activation scale amax / 240 instead of amax / 448 (E4M3's largest
# magnitude), each step's group found one step ahead (the group index off by one step), the
# activation scales of fragment rows g and g + 8 exchanged, and E4M3 rounding ties away from zero
# (quant_codes.cuh: the E4M3 table test and the products catch it).
tutel_kernel_mutant(quantized_grouped_linear w8a8_scale_over_240 TUTEL_DTYPE_FLOAT16
  "row_group_amax(rows, row_stride, tile, begin, end, rows_vector) / 448.0f;"
  "row_group_amax(rows, row_stride, tile, begin, end, rows_vector) / 240.0f;")
tutel_kernel_mutant(quantized_grouped_linear w8a8_group_of_next_step TUTEL_DTYPE_BFLOAT16
  "const i64 group = k / activation_group;"
  "const i64 group = (k + 16) / activation_group;")
tutel_kernel_mutant(quantized_grouped_linear w8a8_row_scales_swapped TUTEL_DTYPE_FLOAT32
  "row_scale[0] = row_scales[s][row0 + g];\n          row_scale[1] = row_scales[s][row0 + g + 8];"
  "row_scale[1] = row_scales[s][row0 + g];\n          row_scale[0] = row_scales[s][row0 + g + 8];")
tutel_kernel_mutant(quantized_grouped_linear e4m3_ties_away TUTEL_DTYPE_BFLOAT16
  "(magnitude + 0x7ffffu + ((magnitude >> 20) & 1u)) & 0xfff00000u"
  "(magnitude + 0x80000u) & 0xfff00000u" quant_codes.cuh)
tutel_kernel_mutant(quantized_grouped_linear mma_fragment_a1_a2_swapped TUTEL_DTYPE_FLOAT16
  "a[p][1] = a_tile[p][row0 + g + 8][8 * s + t];\n          a[p][2] = a_tile[p][row0 + g][8 * s + t + 4];"
  "a[p][2] = a_tile[p][row0 + g + 8][8 * s + t];\n          a[p][1] = a_tile[p][row0 + g][8 * s + t + 4];")

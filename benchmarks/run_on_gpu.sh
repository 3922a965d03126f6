#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and a CUDA build of PyTorch: builds tutel with its CUDA operators,
# runs the tests that need a GPU, the helloworld example on the GPU and the GPU benchmarks
# (cuda_kernels.py; quantized_experts.py --device cuda, decode_line.py and transformers_moe.py at the
# published models' layer shapes in bfloat16).
# Each step has a time limit and its own log; logs and JSON go to DIR (default build/gpu_run).
#
#   bash benchmarks/run_on_gpu.sh [DIR]
#
# TUTEL_GPU_STEPS picks the steps (default: all, in this order): build gpu_tests helloworld
# cuda_kernels quantized_experts decode_line transformers_moe.  Their limits add up to more than one
# command may run on a lent machine (600 s), so there run it twice on the same machine, the build kept
# in the tree between the two (each half's limits stay within 600 s; tests/python/test_run_on_gpu_script.py holds
# them to it):
#   TUTEL_GPU_STEPS="build helloworld decode_line" bash benchmarks/run_on_gpu.sh DIR
#   TUTEL_GPU_STEPS="gpu_tests cuda_kernels quantized_experts transformers_moe" bash benchmarks/run_on_gpu.sh DIR
# Each limit is a ceiling; the transformers benchmark may run into its own (TUTEL_GPU_BENCH_SECONDS)
# and then keeps the families it finished.  A lent machine keeps the build only while it stays warm
# between commands (30 s on the H200s): start the second half at once, and on a fresh machine put
# build back into its steps.
# Without the build step the steps use the extension already built in place, which must hold the CUDA
# operators.
# The quantized_experts step times tutel's quantized experts (MXFP4, NVFP4, block FP8) on the layers of
# gpt-oss-20b and Qwen3-30B-A3B at T = 1, 16, 2048, eager and replayed from CUDA graphs, against tutel's
# bfloat16 call, the packed weights' read limit and transformers' FP8 experts (those of its
# implementations that run offline: HF_HUB_OFFLINE=1), into DIR/quantized_experts_cuda.json.
# The decode_line step measures where the decode kernel should hand over to the grouped path; on any
# machine, `python benchmarks/decode_line.py --apply DIR/decode_line_cuda.json` then sets that line
# in tutel/ops/decode_lines.json, which tutel chooses by.
#
# Environment: PYTHON (default python3), TUTEL_KEEP_CXX=1 (build with $CXX, not /usr/bin/g++),
# TUTEL_GPU_TEST_SECONDS (default 200), TUTEL_GPU_BENCH_SECONDS (default 210: besides the synchronised
# times, every case counts kernels and captures and replays CUDA graphs; transformers_moe_cuda.json keeps
# the families finished when the limit strikes), TUTEL_GPU_FAMILIES (transformers_moe --families).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/gpu_run}"
mkdir -p "$out"
py="${PYTHON:-python3}"
failed=()
all_steps=(build gpu_tests helloworld cuda_kernels quantized_experts decode_line transformers_moe)
read -r -a steps <<<"${TUTEL_GPU_STEPS:-${all_steps[*]}}"
for name in "${steps[@]}"; do
    [[ " ${all_steps[*]} " == *" ${name} "* ]] || { echo "TUTEL_GPU_STEPS: unknown step '${name}'; the steps are: ${all_steps[*]}"; exit 2; }
done
# wanted NAME: whether TUTEL_GPU_STEPS names NAME.
wanted() { [[ " ${steps[*]} " == *" $1 "* ]]; }

# step NAME LIMIT COMMAND...: runs COMMAND under `timeout LIMIT`, output to DIR/NAME.log, prints its tail.
step() {
    local name=$1 limit=$2 started=$SECONDS status
    shift 2
    echo "== ${name} (limit ${limit} s): $*"
    timeout "$limit" "$@" >"${out}/${name}.log" 2>&1
    status=$?
    echo "   exit ${status} after $((SECONDS - started)) s"
    tail -n "${TAIL_LINES:-12}" "${out}/${name}.log" | cut -c1-400
    [ "$status" -eq 0 ] || failed+=("${name} (exit ${status})")
    return "$status"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$py" -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))"
    "$py" -c "import transformers; print('transformers', transformers.__version__)"
    nproc
} >"${out}/machine.log" 2>&1
cat "${out}/machine.log"

# A compiler wrapper (seen: CXX=/opt/gcc/bin/g++ in front of Ubuntu's g++ 13.3) built an extension that
# crashed in std::ostream while PyTorch's checks formatted a message; the system g++ of the same version
# did not.  Build with the system compiler where there is one.
if [ -x /usr/bin/g++ ] && [ -z "${TUTEL_KEEP_CXX:-}" ]; then
    export CC=/usr/bin/gcc CXX=/usr/bin/g++
fi
if wanted build; then
    TAIL_LINES=20 step build 420 env TUTEL_WITH_CUDA=1 MAX_JOBS="$(nproc)" "$py" setup.py -q build_ext --inplace \
        || { echo "the build failed: nothing else runs"; exit 1; }
elif ! "$py" -c "import sys, tutel.cuda; sys.exit(0 if tutel.cuda.is_built() else 1)" \
        >"${out}/extension.log" 2>&1; then
    echo "no build step, and the extension built in place has no CUDA operators (${out}/extension.log): add build to TUTEL_GPU_STEPS"
    exit 1
fi

gpu_tests=(tests/python/test_cuda_ops.py tests/python/test_cuda_routing_api.py tests/python/test_cuda_kernel_cache.py
           tests/python/test_backend_self_check.py tests/python/test_composite_ops.py tests/python/test_expert_linear.py
           tests/python/test_jit.py tests/python/test_check_cli.py tests/python/integrations/test_transformers_layouts.py
           tests/python/distributed/test_dist_single_process.py tests/python/test_decode_experts.py
           tests/python/test_grouped_rows_linear.py tests/python/test_expert_rows.py tests/python/test_route_experts.py
           tests/python/test_expert_ops_composite.py tests/python/test_quant_formats.py
           tests/python/test_quantized_experts.py tests/python/integrations/test_transformers_fp8_experts.py
           tests/python/test_moe_quantized_experts.py tests/python/integrations/test_gpt_oss_mxfp4.py
           tests/python/test_quantized_cuda_launches.py tests/python/test_quantized_grouped_linear_launches.py
           tests/python/integrations/test_quantized_cuda_launches_transformers.py)
wanted gpu_tests && TAIL_LINES=40 step gpu_tests "${TUTEL_GPU_TEST_SECONDS:-200}" "$py" -m pytest -p no:cacheprovider -n 12 \
    --timeout 120 -v --tb=short -rfE "${gpu_tests[@]}"

wanted helloworld && step helloworld 60 bash -c "'$py' -m tutel.examples.helloworld --device cuda --num_steps 20 \
    && '$py' -m tutel.examples.helloworld --device cuda --num_steps 20 --dtype bfloat16"
wanted cuda_kernels && step cuda_kernels 90 "$py" benchmarks/cuda_kernels.py --reps 20 --out "${out}/cuda_kernels.json"
wanted quantized_experts && TAIL_LINES=30 step quantized_experts 90 env HF_HUB_OFFLINE=1 "$py" \
    benchmarks/quantized_experts.py --device cuda --out "$out"
wanted decode_line && TAIL_LINES=30 step decode_line 120 "$py" benchmarks/decode_line.py --out "$out"
wanted transformers_moe && TAIL_LINES=30 step transformers_moe "${TUTEL_GPU_BENCH_SECONDS:-210}" "$py" benchmarks/transformers_moe.py \
    --device cuda --full-size --dtypes bfloat16 --families "${TUTEL_GPU_FAMILIES:-qwen3_moe,mixtral,deepseek_v3,gpt_oss}" \
    --seconds-per-case 1.5 --min-reps 5 --out "$out"

if [ "${#failed[@]}" -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "every step passed"

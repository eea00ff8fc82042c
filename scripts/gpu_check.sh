#!/usr/bin/env bash
# The one script for a GPU machine: build, GPU tests, benchmarks, sanitizers, demo. Logs go to
# $OUT (one log per step; at most a few files, so they are easy to bring back). Usage:
#   OUT=/tmp/out bash scripts/gpu_check.sh STEP...
# (at least one step: each costs device time, so none runs by default, and run without one the
# script lists them; sanitize runs compute-sanitizer's memcheck, racecheck, initcheck
# and synccheck over every variant of our kernels; step-profile traces the block train step
# with the JAX profiler; profile runs Nsight Compute over our kernels). Optional environment:
# TESTS_K (pytest -k expression, default "not cpu"), TEST_WORKERS (tests: that many pytest-xdist
# workers, default 8; BENCH_TEST_WORKERS for test_benchmarks.py, default 3), TESTS_PASSES (default
# "rest benchmarks": the two passes, or one of them), TESTS_FILES (the rest pass's test files,
# default all), TESTS_TIMEOUT (seconds per pass, default 1800), XDIST_WHEELS (pytest-xdist's and
# execnet's wheels, installed where the machine has no pytest-xdist and no internet),
# CUTLASS_WHEEL (the nvidia-cutlass wheel, installed before the build where the machine has
# none and no internet to fetch it), BENCH_ONLY (benchmark case groups, see
# python -m benchmarks.run --help), PROFILE_RECIPES (step-profile's recipes, default "delayed
# fast_all bf16"), NCU_KERNELS / NCU_SKIP / NCU_COUNT (profile's kernel-name regex, matching
# launches skipped and profiled), SANITIZE_TOOLS (default all four), SANITIZE_KERNELS
# (run_kernels.py's mode under the tools: coverage, the default, or one family, e.g. mxfp8),
# SKIP_BUILD=1 (use the build a warm machine already has, e.g. for a second invocation that
# runs beside a first one: give it its own OUT, and steps that keep out of the first one's).
set -u
OUT=${OUT:-/tmp/jax_fp8_out}
mkdir -p "$OUT"
steps=("$@")
known=" tests bench sanitize graphs demo demo-block demo-step demo-moe convergence dp model-step moe moe-layer step-profile profile "
[ ${#steps[@]} -gt 0 ] \
  || { echo "usage: bash scripts/gpu_check.sh STEP... (steps:$known)" >&2; exit 2; }
for s in "${steps[@]}"; do
  [[ $known == *" $s "* ]] || { echo "unknown step '$s' (steps:$known)" >&2; exit 2; }
done
for p in ${TESTS_PASSES:-}; do
  [[ $p == rest || $p == benchmarks ]] \
    || { echo "unknown TESTS_PASSES entry '$p' (rest, benchmarks)" >&2; exit 2; }
done
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  nvcc --version | tail -1
  python3 -c "import sys, jax; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
} > "$OUT/env.log" 2>&1
export JAX_FP8_CUDA_ARCHS=${JAX_FP8_CUDA_ARCHS:-90a-real}
# SM clock, power and temperature every half second while the steps run (sustained GEMM
# loads may run below the boost clock).
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 500 \
  > "$OUT/clocks.csv" 2>&1 &
sampler=$!
trap 'kill $sampler 2>/dev/null' EXIT
t0=$(date +%s)
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  python3 -c "import importlib.util as u; exit(u.find_spec('cutlass_library') is None)" \
    || python3 -m pip install -q --no-deps ${CUTLASS_WHEEL:-nvidia-cutlass} > "$OUT/cutlass.log" 2>&1 \
    || { tail -5 "$OUT/cutlass.log"; exit 1; }
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  echo "build $(( $(date +%s) - t0 )) s"
fi
python3 -c "import xdist" 2>/dev/null \
  || python3 -m pip install -q --no-deps ${XDIST_WHEELS:-pytest-xdist execnet} > "$OUT/xdist.log" 2>&1 \
  || { tail -5 "$OUT/xdist.log"; exit 1; }
python3 -c "import jax_fp8; print('cuda targets:', jax_fp8.cuda_available())" || exit 1
# A GPU machine whose CUDA extension did not build or load would skip every CUDA case: stop.
python3 -m pytest tests/test_cuda_build.py -q -p no:cacheprovider > "$OUT/cuda_build.log" 2>&1 \
  || { tail -20 "$OUT/cuda_build.log"; echo "the CUDA targets did not load: stopping" >&2; exit 1; }
for s in "${steps[@]}"; do
  t0=$(date +%s)
  case $s in
    # The CPU-parametrized cases run in CI; here the CUDA ones and those on the default device,
    # in TEST_WORKERS pytest-xdist workers that share the GPU (no preallocation) and steal
    # each other's queued tests, so no one slow file sets the wall time. test_benchmarks.py
    # runs after the rest, in BENCH_TEST_WORKERS workers: its scripts time kernels on the
    # device, and beside 8 busy processes a 2 us kernel did not stand out of the timing noise.
    tests) for pass in ${TESTS_PASSES:-rest benchmarks}; do
             if [ $pass = rest ]; then
               files="${TESTS_FILES:-tests} --ignore tests/test_benchmarks.py"
               workers=${TEST_WORKERS:-8}
             else files=tests/test_benchmarks.py; workers=${BENCH_TEST_WORKERS:-3}; fi
             XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT ${TESTS_TIMEOUT:-1800} \
               python3 -m pytest $files -q -p no:cacheprovider -rfE --tb=short -n $workers \
               --dist worksteal --durations 15 -k "${TESTS_K:-not cpu}" >> "$OUT/tests.log" 2>&1
             echo "tests ($pass) exit $?: $(grep -E "(passed|failed)" "$OUT/tests.log" | tail -1)"
           done
           grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | head -20 ;;
    bench) python3 -m benchmarks.run --out "$OUT/bench.json" ${BENCH_ONLY:+--only $BENCH_ONLY} \
             > "$OUT/bench.log" 2>&1
           tail -25 "$OUT/bench.log" ;;
    # CUDA graphs: our handlers in XLA's command buffers, step time and bits per setting.
    graphs) python3 -m benchmarks.command_buffer --out "$OUT/command_buffer.json" \
             > "$OUT/graphs.log" 2>&1
           echo "graphs exit $?"; tail -8 "$OUT/graphs.log" ;;
    demo)  python3 -m jax_fp8.demo --preset gpu --out "$OUT/demo" > "$OUT/demo.log" 2>&1
           echo "demo exit $?"; tail -15 "$OUT/demo.log" ;;
    # Several GPUs: data-parallel training, 1..N devices, FP8 vs BF16 (NCCL_NVLS_ENABLE=0).
    dp)    NCCL_NVLS_ENABLE=0 python3 -m benchmarks.data_parallel --out "$OUT/dp.json" \
             > "$OUT/dp.log" 2>&1
           echo "dp exit $?"; tail -8 "$OUT/dp.log" ;;
    # The headline: the Llama-style decoder's train step, every variant in one process
    # (MODEL_STEP_ARGS: more flags, e.g. --profile delayed bf16).
    model-step) python3 -m benchmarks.model_step --out "$OUT/model_step.json" ${MODEL_STEP_ARGS:-} \
             > "$OUT/model_step.log" 2>&1
           echo "model-step exit $?"; tail -40 "$OUT/model_step.log" ;;
    # The grouped FP8 GEMMs of a mixture of experts (Mixtral- and DeepSeek-V3-like, balanced
    # and skewed routing) beside BF16 ragged_dot and the dense FP8 GEMM (MOE_ARGS: more flags,
    # e.g. --cases mixtral --tokens 8192).
    moe)   python3 -m benchmarks.moe --out "$OUT/moe.json" ${MOE_ARGS:-} > "$OUT/moe.log" 2>&1
           echo "moe exit $?"; tail -52 "$OUT/moe.log" ;;
    # The MoE layer's forward and backward (Mixtral- and DeepSeek-V3-like): MoeMlp beside BF16
    # ragged_dot and the capacity-factor einsum peers, BF16 and Flax FP8 (MOE_LAYER_ARGS: more
    # flags, e.g. --cases mixtral --variants delayed bf16 bf16_capacity).
    moe-layer) python3 -m benchmarks.moe_layer --out "$OUT/moe_layer.json" ${MOE_LAYER_ARGS:-} \
             > "$OUT/moe_layer.log" 2>&1
           echo "moe-layer exit $?"; tail -16 "$OUT/moe_layer.log" ;;
    # The demo's train step per variant, BF16 beside FP8, in one process (DEMO_STEP_ARGS: more
    # flags, e.g. --variants bf16 delayed --profile).
    demo-step) python3 -m benchmarks.demo_step --out "$OUT/demo_step.json" ${DEMO_STEP_ARGS:-} \
             > "$OUT/demo_step.log" 2>&1
           echo "demo-step exit $?"; tail -30 "$OUT/demo_step.log" ;;
    demo-block) python3 -m jax_fp8.demo --preset gpu --recipe block --out "$OUT/demo-block" \
             > "$OUT/demo-block.log" 2>&1
           echo "demo-block exit $?"; tail -15 "$OUT/demo-block.log" ;;
    # The MoE preset's convergence run, FP8 (delayed) beside BF16 over DEMO_MOE_STEPS (default
    # 1500, the recipes' run length) under the 1% loss rule, stopped after DEMO_MOE_MINUTES
    # (default 8) and checkpointed in build/demo-moe, which a warm machine keeps: the same step
    # in the next call resumes (as convergence's). Its files come back in $OUT/demo-moe.
    demo-moe) mkdir -p build/demo-moe "$OUT/demo-moe"
           JAX_COMPILATION_CACHE_DIR=build/demo-moe/jax_cache python3 -m jax_fp8.demo --preset moe \
             --steps ${DEMO_MOE_STEPS:-1500} --tolerance 0.01 --out build/demo-moe \
             --stop-after ${DEMO_MOE_MINUTES:-8} > "$OUT/demo-moe.log" 2>&1
           echo "demo-moe exit $?"; tr '\r' '\n' < "$OUT/demo-moe.log" | grep -v "step/s" | tail -15
           cp build/demo-moe/*.json build/demo-moe/*.png "$OUT/demo-moe/" 2>/dev/null ;;
    # The recipes' 1500-step convergence runs against BF16 (CONVERGENCE_RECIPES, default
    # "current mxfp8 nvfp4"), stopped after CONVERGENCE_MINUTES (default 8) and checkpointed in
    # build/convergence, which a warm machine keeps: the same step in the next call resumes.
    # Runs already in $CONVERGENCE_RUNS (a folder of run-*.json) are copied in and kept. JAX's
    # persistent compilation cache, kept there too, spares a resumed segment the compilation.
    convergence) mkdir -p build/convergence
           [ -n "${CONVERGENCE_RUNS:-}" ] && cp -n "$CONVERGENCE_RUNS"/run-*.json build/convergence/
           JAX_COMPILATION_CACHE_DIR=build/convergence/jax_cache python3 -m jax_fp8.demo --preset gpu --steps 1500 \
             --recipe ${CONVERGENCE_RECIPES:-current mxfp8 nvfp4} --out build/convergence \
             --stop-after ${CONVERGENCE_MINUTES:-8} > "$OUT/convergence.log" 2>&1
           echo "convergence exit $?"; tr '\r' '\n' < "$OUT/convergence.log" | grep -v "step/s" | tail -15
           cp build/convergence/*.json build/convergence/*.png "$OUT/" 2>/dev/null ;;
    # Every kernel variant of ours under compute-sanitizer (only kernels in namespace jax_fp8
    # are instrumented); JAX allocates each buffer with its own cudaMalloc, so memcheck sees
    # each buffer's exact bounds, and XLA's command buffers are off, so every kernel that
    # writes our inputs is a plain launch the tools follow (with them on, initcheck reported
    # inputs written by XLA's fusions as uninitialized). initcheck leaves the host API's copies
    # alone: XLA's own device-to-device copies read buffers that XLA's kernels (not instrumented
    # under the kernel filter) wrote, and it reported those as uninitialized. For the same
    # reason it reports the norm kernels' reads of gamma / beta, which XLA's stack writes:
    # run with every kernel instrumented (no --kernel-name), it reported none of ours over
    # run_kernels.py block, only XLA's autotuner's xla_fp_comparison.
    sanitize) for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
             echo "## compute-sanitizer --tool $tool" >> "$OUT/sanitize.log"
             api=; [ $tool = initcheck ] && api="--check-api-memory-access no"
             XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
               XLA_FLAGS="--xla_gpu_enable_command_buffer= ${XLA_FLAGS:-}" \
               timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool $api --kernel-name kns=jax_fp8 --error-exitcode 99 \
               python3 scripts/run_kernels.py ${SANITIZE_KERNELS:-coverage} >> "$OUT/sanitize.log" 2>&1
             echo "sanitize $tool exit $?"
             # Our cuBLASLt calls under memcheck only: racecheck's instrumentation failed with
             # an internal error ("failed to handle a hardware exception") inside cuBLASLt's
             # block-scaled GEMM kernel, which is not ours.
             if [ $tool = memcheck ]; then
               XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
                 timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool memcheck \
                 --error-exitcode 99 python3 scripts/run_kernels.py gemm >> "$OUT/sanitize.log" 2>&1
               echo "sanitize memcheck (gemm) exit $?"
             fi
           done
           grep -E "ERROR SUMMARY|RACECHECK SUMMARY|exit" "$OUT/sanitize.log" | tail -12 ;;
    # Where the transformer block train step's time goes, per stream and kind of work.
    step-profile) for r in ${PROFILE_RECIPES:-delayed fast_all bf16}; do
             python3 -m benchmarks.step_profile --recipe $r --out "$OUT/step-profile-$r.json" \
               > "$OUT/step-profile-$r.txt" 2>&1
             echo "step-profile $r exit $?"; grep -A6 "per step" "$OUT/step-profile-$r.txt" | head -24
             cat "$OUT/step-profile-$r.txt" >> "$OUT/step-profile.log"; rm "$OUT/step-profile-$r.txt"
           done ;;
    # No preallocation: ncu's kernel replay saves and restores all device memory JAX holds.
    profile) XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none \
               --kernel-name regex:"${NCU_KERNELS:-quantize_kernel|cast_transpose_kernel|group_quantize_kernel|block_quantize_kernel}" \
               --launch-skip ${NCU_SKIP:-7} --launch-count ${NCU_COUNT:-7} --section SpeedOfLight \
               --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
               --section WarpStateStats --section SchedulerStats \
               --section ComputeWorkloadAnalysis --section InstructionStats \
               python3 scripts/run_kernels.py profile > "$OUT/profile.log" 2>&1
           grep -E "==PROF==|Kernel|Throughput|Duration|Occupancy" "$OUT/profile.log" | head -60 ;;
  esac
  echo "$s $(( $(date +%s) - t0 )) s"
done

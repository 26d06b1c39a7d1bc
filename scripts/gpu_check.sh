#!/usr/bin/env bash
# Everything a GPU machine should tell us, in one command from a clean checkout, within a time
# budget: build, the CUDA kernel tests and micro-benchmarks, Loom vs PyTorch eager and
# torch.compile with the per-kernel ablation, a 3-step Kineto trace, Float8 row-wise on and off,
# then (with the time left) the whole suite. Every log lands in the output folder; summary.txt
# gathers the lines that matter (ctest summaries, the tables). Eight files at most (summary.txt,
# build.log, kernels.log, bench.log, bench.json, runs.log, trace.json.gz, suite.log), so a device
# tool that brings back eight files brings back all of them.
#
#   scripts/gpu_check.sh [out-folder, default $OUT or gpu-check]
#   GPU_CHECK_SECONDS=540   the budget for everything (default 1500: a whole 30-minute lease less
#                           the machine's start); steps that no longer fit are skipped, and said so
#   GPU_CHECK_SUITE=0       skip the whole suite even if time is left
#   GPU_CHECK_MICRO=0       skip the kernel micro-benchmarks; GPU_CHECK_MICRO_FILTER=REGEX runs only
#                           those whose name matches (Google Benchmark's --benchmark_filter)
#   GPU_CHECK_ABLATION=0    the Loom vs PyTorch benchmark without its per-kernel ablation
#   GPU_CHECK_GEMM=0        skip the GEMM efficiency sweep (bench/gemm_efficiency.py, run on the
#                           GPU while the build uses the CPU; its lines end in bench.log, its rows
#                           in bench.json under "gemm_efficiency")
#   GPU_CHECK_TORCHTITAN=0  skip Loom vs TorchTitan 0.3.0 (bench/torchtitan_vs_loom.py; its wheels
#                           from .device/torchtitan, which scripts/pack_torchtitan.sh fills);
#                           GPU_CHECK_TORCHTITAN_CASES=dense,moe,float8 picks its cases
#   GPU_CHECK_SUITE_CORES=4 the suite runs beside the benchmarks (default): its build and its CPU
#                           tests on all cores but the first N (taskset), the benchmarks on those
#                           N, the CUDA-labelled tests after the benchmarks (they use the GPU); 0
#                           runs the suite after everything else instead
#
# On the lent machine (../shared/gpu/README.md): carry .device and the script sources
# .device/setup.sh itself (the Debian packages and data that machine cannot download).
set -uo pipefail
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$(date +%s)
deadline=$((start + ${GPU_CHECK_SECONDS:-1500}))
left() { echo $((deadline - $(date +%s))); }
say() { echo "[$(date +%T) +$(($(date +%s) - start))s] $*" | tee -a "$out/summary.txt"; }
# run_step NAME SECONDS_NEEDED LOG COMMAND...: runs COMMAND under the time left (less 10 s), or
# skips it when less than SECONDS_NEEDED is left.
run_step() {
  local name=$1 need=$2 log=$3; shift 3
  local budget=$(($(left) - 10))
  if [ "$budget" -lt "$need" ]; then
    say "$name: skipped ($budget s left, needs about $need s)"
    return 0
  fi
  say "$name: start (limit $budget s)"
  timeout --kill-after=5 "$budget" "$@" >>"$log" 2>&1
  local rc=$?
  say "$name: exit $rc"
  return 0
}

if [ -f .device/setup.sh ]; then
  # shellcheck disable=SC1091
  source .device/setup.sh >"$out/build.log" 2>&1
fi
PY=${LOOM_PYTHON:-$(command -v python3)}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$out/summary.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tee -a "$out/summary.txt"
git log --oneline -1 2>/dev/null | tee -a "$out/summary.txt"

# 0. The GEMM efficiency curve (issue 29's time model) on the GPU while the CPU builds: Python and
# torch only, so it needs nothing from the build.
gemm_pid=""
gemm_tmp=$(mktemp -d)
if [ "${GPU_CHECK_GEMM:-1}" != 0 ]; then
  say "GEMM efficiency sweep (background, during the build)"
  timeout --kill-after=5 240 "$PY" bench/gemm_efficiency.py --device cuda --dtype bf16 --peak-tflops 989 \
    --min-ms 10 --json "$gemm_tmp/gemm.json" >"$gemm_tmp/gemm.log" 2>&1 &
  gemm_pid=$!
fi

# 1. Build what the checks need first (the CLI, the kernel tests, the micro-benchmarks).
B=build-cuda
say "configure"
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_PYTHON="$PY" >>"$out/build.log" 2>&1 \
  || { say "configure FAILED (build.log)"; tail -20 "$out/build.log" | tee -a "$out/summary.txt"; exit 1; }
say "build: loom, kernel tests, micro-benchmarks"
if ! cmake --build "$B" -j "$(nproc)" --target loom loom_cuda_kernel_tests loom_nn_tests \
    loom_bench_cuda_kernels >>"$out/build.log" 2>&1; then
  say "build FAILED (build.log)"
  grep -E "error|Error" "$out/build.log" | head -20 | tee -a "$out/summary.txt"
  exit 1
fi
say "build: done"

# The whole suite beside the benchmarks: building and running the CPU tests takes longer than
# everything else, so it starts now on the cores the benchmarks leave (the benchmarks compare Loom
# with PyTorch in the same conditions, so their ratios stand; their host side is light).
cores=$(nproc)
bench_cores=${GPU_CHECK_SUITE_CORES:-4}
suite_pid=""
pin_bench=()
if [ "${GPU_CHECK_SUITE:-1}" != 0 ] && [ "$bench_cores" -gt 0 ] && [ "$cores" -gt $((bench_cores + 1)) ]; then
  pin_bench=(taskset -c "0-$((bench_cores - 1))")
  suite_jobs=$((cores - bench_cores))
  (
    say "suite (beside the benchmarks, cores $bench_cores-$((cores - 1))): build everything"
    budget=$(($(left) - 60))
    timeout --kill-after=5 "$budget" taskset -c "$bench_cores-$((cores - 1))" \
      cmake --build "$B" -j "$suite_jobs" >>"$out/suite.log" 2>&1
    say "suite: build exit $?; CPU tests (ctest -LE cuda)"
    budget=$(($(left) - 45))
    timeout --kill-after=5 "$budget" taskset -c "$bench_cores-$((cores - 1))" \
      ctest --test-dir "$B" -j "$suite_jobs" --timeout 600 -LE cuda --output-on-failure >>"$out/suite.log" 2>&1
    say "suite: CPU tests exit $?"
  ) &
  suite_pid=$!
fi

if [ -n "$gemm_pid" ]; then
  wait "$gemm_pid"
  say "GEMM efficiency sweep: exit $?"
  sed -n '/^block linears/,$p' "$gemm_tmp/gemm.log" | tee -a "$out/summary.txt" >/dev/null
  grep -E "^square" "$gemm_tmp/gemm.log" | tee -a "$out/summary.txt" >/dev/null
  cat "$gemm_tmp/gemm.log" >>"$out/bench.log"
fi

# 1b. The launcher's fork server with a CUDA rank: one rank trains 5 steps on the GPU through
# `loom launch` (the server forks before any CUDA call; a warning "no fork server" would say it
# could not).
launch_dir=$(mktemp -d)
run_step "launch 1 CUDA rank" 20 "$out/runs.log" "$B/bin/loom" launch --nproc 1 -- train \
  --config configs/llama3_debug.toml --training.device=cuda --training.steps=5 --checkpoint.enable=false \
  --validation.enable=false --metrics.log_freq=1 --job.dump_folder="$launch_dir"
grep -E "fork server|step +5|error" "$out/runs.log" | head -5 | tee -a "$out/summary.txt" >/dev/null

# 2. The kernels against the ATen compositions, then their micro-benchmarks.
run_step "kernel tests" 30 "$out/kernels.log" "$B/bin/loom_cuda_kernel_tests" --gtest_brief=0
grep -E "^\[  (PASSED|FAILED) |tests ran|FAILED" "$out/kernels.log" | tee -a "$out/summary.txt"
run_step "nn tests on this build" 30 "$out/kernels.log" "$B/bin/loom_nn_tests" --gtest_brief=1
if [ "${GPU_CHECK_MICRO:-1}" != 0 ]; then
  run_step "kernel micro-benchmarks" 40 "$out/kernels.log" "${pin_bench[@]}" "$B/bin/loom_bench_cuda_kernels" \
    --benchmark_min_time=0.2 --benchmark_filter="${GPU_CHECK_MICRO_FILTER:-.}"
fi
grep -E "^BM_" "$out/kernels.log" | tee -a "$out/summary.txt" >/dev/null

# 3. Loom vs PyTorch eager and torch.compile on the 1B shape, and the per-kernel ablation.
export PYTHONUNBUFFERED=1
run_step "benchmark + ablation" 200 "$out/bench.log" "${pin_bench[@]}" "$PY" bench/gpu_vs_pytorch.py \
  --loom "$B/bin/loom" $([ "${GPU_CHECK_ABLATION:-1}" != 0 ] && echo --ablation) --json "$out/bench.json"
grep -E "tokens/s|^\||FAILED|loom / " "$out/bench.log" | tee -a "$out/summary.txt" >/dev/null

# 3b. Loom vs TorchTitan 0.3.0 itself (issue 49): the dense 1B shape (bf16, + compile), its Float8
# rowwise pair and an MoE shape with Qwen3-30B-A3B's block widths. TorchTitan's wheels come from
# .device/torchtitan (scripts/pack_torchtitan.sh), unpacked onto PYTHONPATH; without them the rows
# say so and the hand-written reference of step 3 stays the peer. Its table goes to bench.log and
# summary.txt, its rows into bench.json under "torchtitan_vs_loom".
if [ "${GPU_CHECK_TORCHTITAN:-1}" != 0 ]; then
  tt_lib=$(mktemp -d)
  for w in .device/torchtitan/*.whl; do
    [ -f "$w" ] && "$PY" -m zipfile -e "$w" "$tt_lib"
  done
  run_step "loom vs torchtitan" 240 "$out/bench.log" env PYTHONPATH="$tt_lib" "${pin_bench[@]}" "$PY" \
    bench/torchtitan_vs_loom.py --loom "$B/bin/loom" --cases "${GPU_CHECK_TORCHTITAN_CASES:-dense,moe,float8}" \
    --json "$gemm_tmp/torchtitan.json"
  grep -E "^== |tokens/s|FAILED|apart|device: " "$out/bench.log" | tail -40 | tee -a "$out/summary.txt" >/dev/null
fi

# 4. A Kineto trace of 3 steps of the 1B shape with every kernel on.
trace_dir=$(mktemp -d)
run_step "trace" 60 "$out/runs.log" "${pin_bench[@]}" "$B/bin/loom" train --config configs/llama3_debug.toml \
  --validation.enable=false --model.flavor=1B --model.vocab_size=128256 \
  --training.device=cuda --training.mixed_precision_param=bfloat16 \
  --parallelism.data_parallel_shard_degree=1 --training.seq_len=2048 --training.local_batch_size=4 \
  --training.steps=6 --checkpoint.enable=false --metrics.log_freq=6 \
  --profiling.enable_profiling=true --profiling.profile_freq=6 --profiling.profiler_warmup=2 \
  --profiling.profiler_active=3 --job.dump_folder="$trace_dir"
trace=$(find "$trace_dir" -name "*trace.json" | head -1)
if [ -n "$trace" ]; then
  gzip -c "$trace" >"$out/trace.json.gz"
  say "trace: $(du -h "$out/trace.json.gz" | cut -f1) compressed"
  # The kernels that take the most device time, from the trace itself.
  "$PY" - "$trace" <<'EOF' 2>&1 | tee -a "$out/summary.txt"
import json, sys, collections
events = json.load(open(sys.argv[1])).get("traceEvents", [])
total = collections.Counter()
count = collections.Counter()
for e in events:
    if e.get("cat") == "kernel" and "dur" in e:
        total[e["name"][:90]] += e["dur"]
        count[e["name"][:90]] += 1
all_us = sum(total.values())
# How busy the GPU was: the union of kernel intervals over the span from the first kernel to the
# last (what CUDA graphs or fewer host syncs could win back is at most the idle part).
spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e)
busy, end = 0.0, None
gaps = []
for a, b in spans:
    if end is None or a > end:
        if end is not None:
            gaps.append(a - end)
        busy += b - a
        end = b
    elif b > end:
        busy += b - end
        end = b
if spans:
    wall = end - spans[0][0]
    gaps.sort(reverse=True)
    print(f"trace: GPU busy {100 * busy / wall:.1f} % of {wall / 1e3:.1f} ms (idle {(wall - busy) / 1e3:.1f} ms in "
          f"{len(gaps)} gaps; the largest: {', '.join(f'{g / 1e3:.2f}' for g in gaps[:5])} ms)")
print(f"trace: {all_us / 1e3:.1f} ms of kernels over the recorded steps; the top 25:")
for name, us in total.most_common(25):
    print(f"  {us / 1e3:8.2f} ms {100 * us / max(all_us, 1):5.1f} %  x{count[name]:<5} {name}")
EOF
fi

# 5. Float8 row-wise on and off: tokens/s and the loss after 50 steps.
for f8 in false true; do
  run_step "float8=$f8 50 steps" 60 "$out/runs.log" "${pin_bench[@]}" "$PY" bench/gpu_vs_pytorch.py --loom "$B/bin/loom" \
    --no-compile --no-pytorch --steps 45 --warmup 5 --extra-loom-args=--float8.enable=$f8 \
    --extra-loom-args=--float8.recipe=rowwise
done
grep -E "tokens/s|FAILED" "$out/runs.log" | tee -a "$out/summary.txt" >/dev/null

# 6. The whole suite: the CPU tests already running beside the benchmarks finish, then the CUDA
# tests (ctest -L cuda) run alone on the GPU; or, with GPU_CHECK_SUITE_CORES=0, everything now.
if [ -n "$suite_pid" ]; then
  say "waiting for the CPU tests"
  wait "$suite_pid"
  run_step "CUDA tests (ctest -L cuda)" 20 "$out/suite.log" ctest --test-dir "$B" -j 4 --timeout 300 -L cuda \
    --output-on-failure
  grep -E "tests passed|tests failed|^\s+[0-9]+ - .*\((Failed|Timeout)\)" "$out/suite.log" | tee -a "$out/summary.txt"
elif [ "${GPU_CHECK_SUITE:-1}" != 0 ]; then
  run_step "build everything" 120 "$out/suite.log" cmake --build "$B" -j "$(nproc)"
  run_step "whole suite" 240 "$out/suite.log" ctest --test-dir "$B" -j "$(nproc)" --timeout 600 \
    --output-on-failure
  grep -E "tests passed|tests failed|^\s+[0-9]+ - .*\((Failed|Timeout)\)" "$out/suite.log" | tee -a "$out/summary.txt"
fi
if [ -f "$gemm_tmp/gemm.json" ]; then
  "$PY" - "$out/bench.json" "$gemm_tmp/gemm.json" <<'EOF' || say "could not merge the GEMM rows into bench.json"
import json, os, sys
bench = json.load(open(sys.argv[1])) if os.path.exists(sys.argv[1]) else {}
if not isinstance(bench, dict):
    bench = {"gpu_vs_pytorch": bench}
bench["gemm_efficiency"] = json.load(open(sys.argv[2]))
json.dump(bench, open(sys.argv[1], "w"), indent=1)
EOF
fi
if [ -f "$gemm_tmp/torchtitan.json" ]; then
  "$PY" - "$out/bench.json" "$gemm_tmp/torchtitan.json" <<'EOF' || say "could not merge the TorchTitan rows into bench.json"
import json, os, sys
bench = json.load(open(sys.argv[1])) if os.path.exists(sys.argv[1]) else {}
if not isinstance(bench, dict):
    bench = {"gpu_vs_pytorch": bench}
bench["torchtitan_vs_loom"] = json.load(open(sys.argv[2]))
json.dump(bench, open(sys.argv[1], "w"), indent=1)
EOF
fi
say "done"

#!/usr/bin/env bash
# Everything a CUDA machine should check and time, in stages that each fit a 10-minute device call.
# Results (logs, markdown tables, PNG plots) go under OUT (default: bench/). Run from the repository root:
#
#   bash scripts/device_suite.sh tests      # GPU correctness tests of every kernel and of train.py (make test-gpu)
#   bash scripts/device_suite.sh attention  # attention fwd / fwd+bwd: SDPA, our flash, LLSA L=1..3, VSA, SLA
#   bash scripts/device_suite.sh train      # DiT-S training throughput, eager, full / LLSA L=1..3 / VSA / SLA, 64..512 px
#   bash scripts/device_suite.sh train-compiled  # the same with torch.compile (train.py's default on GPUs), 128/256 px
#   bash scripts/device_suite.sh profile    # what limits a training step: top CUDA ops, eager and compiled
#   bash scripts/device_suite.sh sampling   # sample-generation images/s, full vs LLSA, 128 and 256 px
#   bash scripts/device_suite.sh scaling    # 1 GPU x 2b vs 2 GPUs x b (needs 2 GPUs)
#
# The tables go into docs/benchmarks.md together with the command that made them.
set -uo pipefail
stage=${1:?usage: device_suite.sh tests|attention|train|train-compiled|profile|sampling|scaling}
OUT=${OUT:-bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

case "$stage" in
  tests)
    # One fixed launch configuration: autotuning would spend minutes compiling variants for every test shape.
    PIXDIT_KERNELS_AUTOTUNE=0 $PY -m pytest tests -m gpu -q -p no:cacheprovider --timeout 500 2>&1 | tee "$OUT/gpu_tests.log" ;;
  attention)
    $PY scripts/bench_attention.py --backends sdpa,flash,llsa,vsa,sla --out "$OUT/attention" 2>&1 | tee "$OUT/bench_attention.log" ;;
  train)
    # One process for every variant and size (Triton kernels compile once; speed-ups against full of the same run).
    # Full attention takes ~10 s per step at 512^2, hence fewer steps there (--steps-at). ~6 min on an H200.
    $PY scripts/bench_train.py --attention full llsa:num_levels=1 llsa:num_levels=2 llsa:num_levels=3 vsa sla \
      --sizes 64 128 256 512 --warmup 3 --steps 10 --steps-at 512:1:3 --out "$OUT/train" 2>&1 | tee "$OUT/bench_train.log" ;;
  train-compiled)
    # ~45 s of compilation per (size, variant), hence fewer rows than the eager stage. ~7 min on an H200.
    $PY scripts/bench_train.py --attention full llsa:num_levels=2 vsa sla --sizes 128 256 --warmup 3 --steps 8 \
      --compile --out "$OUT/train_compiled" 2>&1 | tee "$OUT/bench_train_compiled.log" ;;
  profile)
    # Where a training step goes (top CUDA ops per phase), eager and compiled, LLSA L=2.
    $PY scripts/bench_train.py --attention llsa:num_levels=2 --sizes 128 256 --warmup 3 --steps 8 --profile \
      --out "$OUT/train_profile" 2>&1 | tee "$OUT/bench_train_profile.log"
    $PY scripts/bench_train.py --attention llsa:num_levels=2 --sizes 128 256 --warmup 3 --steps 8 --compile --profile \
      --out "$OUT/train_profile_compiled" 2>&1 | tee "$OUT/bench_train_profile_compiled.log" ;;
  sampling)
    # Batches sized so that the slowest row (full attention at 256^2, ~17 s per batch of 4) fits the slot: ~4 min.
    $PY scripts/bench_sampling.py --attention full llsa --sizes 128 --batch 16 --warmup 1 --repeats 3 2>&1 \
      | tee "$OUT/bench_sampling.log"
    $PY scripts/bench_sampling.py --attention full llsa --sizes 256 --batch 4 --warmup 1 --repeats 2 2>&1 \
      | tee -a "$OUT/bench_sampling.log" ;;
  scaling)
    $PY scripts/bench_scaling.py --out "$OUT/scaling" 2>&1 | tee "$OUT/bench_scaling.log" ;;
  *)
    echo "unknown stage '$stage': use tests, attention, train, train-compiled, profile, sampling or scaling" >&2; exit 2 ;;
esac

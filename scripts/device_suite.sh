#!/usr/bin/env bash
# Everything a CUDA machine should check and time, in stages that each fit a 10-minute device call.
# Results (logs, markdown tables, PNG plots) go under OUT (default: bench/). Run from the repository root:
#
#   bash scripts/device_suite.sh tests [kernels|rest]  # GPU correctness tests of every kernel and of train.py
#   bash scripts/device_suite.sh attention  # attention fwd / fwd+bwd: SDPA, our flash, LLSA L=1..3, VSA, SLA
#   bash scripts/device_suite.sh ab DIR [CASES]  # LLSA, VSA, SLA A/B: the kernels/ in DIR vs these, interleaved in one process
#   bash scripts/device_suite.sh knob '[MODULE:]NAME = VALUE' ...  # LLSA A/B: copies of kernels/ with that line vs these
#   bash scripts/device_suite.sh vs DIR [VARIANTS]  # the whole package vs another commit's tree in DIR, compiled 256^2 step
#   bash scripts/device_suite.sh loss DIR   # validation loss of a short DiT-S LLSA run (64^2 crops), this tree vs DIR's
#   bash scripts/device_suite.sh ncu        # hardware counters of one LLSA fwd+bwd (256^2, L=2), Nsight Compute
#   bash scripts/device_suite.sh host       # where an eager LLSA call's host time goes (GPU vs wall time, cProfile)
#   bash scripts/device_suite.sh train      # DiT-S training throughput, eager, full / LLSA L=1..3 / VSA / SLA, 64..512 px
#   bash scripts/device_suite.sh train-compiled  # the same with torch.compile (train.py's default on GPUs), 128/256 px
#   bash scripts/device_suite.sh profile    # what limits a training step: top CUDA ops, eager and compiled
#   bash scripts/device_suite.sh sampling   # sample-generation images/s: LLSA compiled + batch auto vs eager, 128/256 px
#   bash scripts/device_suite.sh scaling    # 1 GPU x 2b vs 2 GPUs x b (needs 2 GPUs)
#   bash scripts/device_suite.sh grow       # model-size table DiT-S/B/L/XL x 128/256 x full/LLSA, compiled; memory knobs
#   bash scripts/device_suite.sh trainpy    # train.py as users run it vs bench_train.py's step, 256^2 LLSA, one call
#   bash scripts/device_suite.sh fsdp2 [xl|s|b|all]   # 2 GPUs: DDP vs FSDP (DiT-XL); DDP 1 vs 2 GPUs (DiT-S, DiT-B)
#
# The tables go into docs/benchmarks.md together with the command that made them.
set -uo pipefail
stage=${1:?usage: device_suite.sh tests|attention|ab|knob|vs|loss|ncu|host|train|train-compiled|profile|sampling|scaling|grow|trainpy|fsdp2 [part]}
OUT=${OUT:-bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

# pytest-xdist processes for GPU tests on this card: one per 20 GiB of its memory, 1 to 8
gpu_test_workers() {
  local mib
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  mib=${mib:-20480}
  local n=$((mib / 20480))
  echo $((n < 1 ? 1 : n > 8 ? 8 : n))
}

case "$stage" in
  tests)
    # One fixed launch configuration: autotuning would spend minutes compiling variants for every test shape.
    # `tests kernels` / `tests rest` split the suite over two calls. `timeout -k`: a plain SIGTERM does not stop
    # pytest while an in-process training test runs (Lightning turns it into a "preempted" stop of that test).
    # The kernel tests are bound by Triton's compilation on the CPU: with pytest-xdist (a dev extra) they run in
    # several processes on the one GPU, 93 tests in 110 s with 8 instead of > 550 s serially. One process per 20 GiB
    # of the card (8 on an H200, 3 on an H100): the largest tests hold ~18 GB, and 8 processes on an 80 GB H100 ran
    # out of memory (docs/kernel_notes.md v48). The rest (training, DDP) stays serial.
    case "${2:-all}" in
      kernels) where=(tests/kernels) ;;
      rest) where=(tests --ignore=tests/kernels) ;;
      *) where=(tests) ;;
    esac
    workers=()
    [ "${2:-all}" = kernels ] && $PY -c "import xdist" 2>/dev/null \
      && workers=(-n "${GPU_TEST_WORKERS:-$(gpu_test_workers)}")
    PIXDIT_KERNELS_AUTOTUNE=0 timeout -k 15 "${TESTS_BUDGET_S:-540}" $PY -m pytest "${where[@]}" -m gpu -q \
      "${workers[@]}" -p no:cacheprovider --timeout 300 --durations=15 -rfE 2>&1 | tee "$OUT/gpu_tests.log" ;;
  attention)
    # TRITON_PRINT_AUTOTUNING: the launch configuration the autotuner picks for each kernel goes into the log
    TRITON_PRINT_AUTOTUNING=1 $PY scripts/bench_attention.py --backends sdpa,flash,llsa,vsa,sla --out "$OUT/attention" \
      2>&1 | tee "$OUT/bench_attention.log" ;;
  ab)
    # Separate autotuned processes differ by up to 20% for the same kernels, so both versions run in one process,
    # alternating, with one fixed launch configuration. DIR: another commit's kernels/ (git archive REV kernels).
    base=${2:?usage: device_suite.sh ab DIR (e.g. git archive HEAD~1 kernels | tar -x -C /tmp/base; DIR=/tmp/base/kernels)}
    cases=(); [ $# -gt 2 ] && cases=(--cases "${@:3}")  # e.g. vsa:256 sla:256 (default: four LLSA cases)
    # GPU kernel time (an eager sparse call is host-bound at 256^2) and each case's 4 largest kernels per version.
    PIXDIT_KERNELS_AUTOTUNE=0 timeout -k 10 300 $PY scripts/ab_attention.py --kernels-from "$base" --kernel-time \
      --rounds 2 --per-kernel 4 "${cases[@]}" 2>&1 | tee "$OUT/ab_attention.log" ;;
  knob)
    # Module-level values of the kernel library (block_sparse._REGISTER_CAPS, llsa.PARTIAL_DTYPE, ...): for each
    # "[MODULE:]NAME = VALUE" (MODULE a file of kernels/, default block_sparse; several joined by ";" go into one
    # copy) a copy of kernels/ whose one-line "NAME = ..." says VALUE, each timed against these kernels in one
    # process as `ab` does ("before" = the copy, so a speed-up below 1 is the copy's gain), with each case's 8
    # largest kernels. Cases: KNOB_CASES (default LLSA 256², 128² at L = 2, 512² at L = 3).
    # The table prints at the end: three copies fit a 10-minute call (each copy compiles its kernels once).
    #   bash scripts/device_suite.sh knob '_REGISTER_CAPS = {("forward", 64): 128, ("dq", 64): 128, ("dkdv", 64): 184}' \
    #     'llsa:PARTIAL_DTYPE = "float32"'
    [ $# -gt 1 ] || { echo "usage: device_suite.sh knob '[MODULE:]NAME = VALUE' ... (module-level names of kernels/)"; exit 2; }
    root=$(mktemp -d); dirs=()
    for assign in "${@:2}"; do
      dir="$root/$(printf '%s' "$assign" | tr -c 'A-Za-z0-9' '_' | tr -s '_')"
      mkdir -p "$dir" && cp -r kernels "$dir/" || exit 1
      $PY - "$dir/kernels" "$assign" <<'PYEOF' || exit 2
import os, re, sys
folder, assigns = sys.argv[1:]
for assign in assigns.split(";"):  # several lines of one copy: "A = 1; llsa:B = 2"
    target, value = (part.strip() for part in assign.split("=", 1))
    module, _, name = target.rpartition(":")
    path = os.path.join(folder, f"{module or 'block_sparse'}.py")
    text = open(path).read() if os.path.isfile(path) else ""
    new, n = re.subn(rf"^{re.escape(name)} = .*$", lambda m: f"{name} = {value}", text, count=1, flags=re.M)
    if n != 1:
        where = f"kernels/{os.path.basename(path)}"
        sys.exit(f"knob: {where} has no one-line module-level '{name} = ...'; give one of its names ([MODULE:]NAME)")
    open(path, "w").write(new)
PYEOF
      dirs+=("$dir/kernels")
    done
    read -ra cases <<< "${KNOB_CASES:-llsa:256:2 llsa:128:2 llsa:512:3}"
    PIXDIT_KERNELS_AUTOTUNE=0 timeout -k 10 "${KNOB_BUDGET_S:-540}" $PY scripts/ab_attention.py --kernels-from "${dirs[@]}" \
      --kernel-time --rounds 2 --per-kernel 8 --cases "${cases[@]}" 2>&1 | tee "$OUT/ab_knob.log" ;;
  vs)
    # The whole package against another commit (model, glue and kernels; `ab` swaps only kernels/): the compiled
    # 256^2 training step of each variant, one pair of processes per variant (~2.5-3 min a pair on an H200, so one or
    # two variants per 10-minute call). DIR: the other commit's source tree (mkdir -p DIR && git archive REV | tar -x -C DIR).
    base=${2:?usage: device_suite.sh vs DIR [VARIANT ...] (default variant: llsa:num_levels=2)}
    variants=("${@:3}"); [ ${#variants[@]} -eq 0 ] && variants=(llsa:num_levels=2)
    timeout -k 10 570 $PY scripts/bench_vs_commit.py "$base" --out "$OUT/vs_commit" -- --compile --sizes 256 \
      --warmup 2 --steps 5 --attention "${variants[@]}" 2>&1 | tee "$OUT/vs_commit.log" ;;
  loss)
    # "Numerics unchanged": the validation loss of a short run with this tree and with DIR's (another commit's source
    # tree), two seeds each: DiT-S, patch 1, LLSA (B = 16, K = 8, default levels: 2 at 4,096 tokens), 64^2 photo
    # crops (built into data/crops64 on first use), 700 steps, compile=auto. Four training processes of ~200 s each
    # (most of it starting and compiling): one after the other they did not fit a 10-minute call (3 of 4 done at
    # 580 s), so they run side by side on the one GPU (--jobs 4; output in each run's train.log), each printing its
    # losses as it ends ("# head seed 0: ...").
    base=${2:?usage: device_suite.sh loss DIR}
    [ -f data/crops64/manifest.json ] || $PY scripts/make_quickstart_data.py --out data/crops64 --resolution 64
    timeout -k 10 570 $PY scripts/loss_vs_commit.py "$base" --seeds 0 1 --jobs 4 --out "$OUT/loss_vs_commit" -- \
      experiment=quickstart model=dit_s model.patch_size=1 attention=llsa optimizer.lr=1e-4 data.root=data/crops64 \
      data.resolution=64 trainer.max_steps=700 trainer.val_check_interval=700 callbacks.samples=null 2>&1 \
      | tee "$OUT/loss_vs_commit.log" ;;
  ncu)
    # One LLSA fwd+bwd after warm-up under Nsight Compute (works on the Firecracker machines; clocks left alone).
    # The per-kernel table of docs/kernel_notes.md v8 comes from this log. ~1.5 min.
    PIXDIT_KERNELS_AUTOTUNE=0 timeout -k 10 200 ncu --clock-control none --profile-from-start off \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis $PY scripts/profile_llsa.py --size 256 --levels 2 > "$OUT/ncu_llsa256.txt" 2>&1
    grep -E "^  [_a-z].*Context|Duration|Registers Per|Achieved Occupancy" "$OUT/ncu_llsa256.txt" | head -120 ;;
  host)
    # An eager LLSA forward + backward is host-bound at 128^2-256^2 (docs/kernel_notes.md v53): its GPU kernel time,
    # its wall time per call back to back and the host's Python functions by own time (cProfile). ~1 min.
    for size in 128 256; do
      timeout -k 10 150 $PY scripts/profile_llsa.py --host --size $size --levels 2 2>&1 | tee "$OUT/host_llsa$size.txt"
    done ;;
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
    # The path evaluations take (pixdit-evaluate, the FID callback): compiled forward, batch from free memory. Then
    # the eager LLSA baseline at a small batch. Batches of 64+ images at 256^2 need the int64 offsets of
    # qk_norm_rope (tests/kernels/test_qk_norm_rope.py::test_gpu_more_than_2_31_elements). ~5 min on an H200.
    # (At 256^2 a batch of 64 already fills the GPU; auto would pick up to 256, ~1 min per batch of 20 steps.)
    timeout -k 10 120 $PY scripts/bench_sampling.py --attention llsa --sizes 128 --batch auto --compile \
      --warmup 1 --repeats 1 --out "$OUT/sampling_128" 2>&1 | tee -a "$OUT/bench_sampling.log"
    timeout -k 10 150 $PY scripts/bench_sampling.py --attention llsa --sizes 256 --batch 64 --compile \
      --warmup 1 --repeats 1 --out "$OUT/sampling_256" 2>&1 | tee -a "$OUT/bench_sampling.log"
    timeout -k 10 120 $PY scripts/bench_sampling.py --attention llsa --sizes 128 256 --batch 4 --warmup 1 --repeats 2 \
      2>&1 | tee -a "$OUT/bench_sampling.log" ;;
  scaling)
    $PY scripts/bench_scaling.py --out "$OUT/scaling" 2>&1 | tee "$OUT/bench_scaling.log" ;;
  grow)
    # One H200. (1) Memory as a knob: DiT-XL at 256^2 with LLSA and 8 images per step (524,288 tokens) under
    # model.grad_checkpointing=true and =mlp. (2) The model-size table: DiT-S/B/L/XL x 128^2/256^2 x LLSA L=2 / full,
    # compiled, 262,144 tokens per step where they fit, else the largest batch that does (said in the row's note).
    # DiT-XL runs with 18 heads of 64 (the Triton kernels take head dims 16/32/64/128; 16 x 72 has the same
    # parameters). Compilation (~30-60 s per row, not measured for L/XL) dominates: rows are written as they finish
    # and all tables are printed at the end, also when the budget (GROW_BUDGET_S, default 540 s) cuts the table short.
    # To split it over two calls: SIZES=256 ... grow, then SIZES=128 GROW_KNOBS=0 ... grow (MODELS=... picks models).
    budget=${GROW_BUDGET_S:-540}; start=$SECONDS
    MODELS=${MODELS:-DiT-S DiT-B DiT-L DiT-XL:num_heads=18}
    SIZES=${SIZES:-128 256}
    common=(--compile --warmup 2 --steps 3)
    if [[ ${GROW_KNOBS:-1} != 0 ]]; then  # GROW_KNOBS=0: the model-size table only (e.g. the second call)
      timeout 170 $PY scripts/bench_train.py --models DiT-XL:num_heads=18 --attention llsa:num_levels=2 --sizes 256 \
        --tokens-per-step 524288 --grad-checkpointing true mlp "${common[@]}" --out "$OUT/grow_knobs" 2>&1 \
        | tee "$OUT/grow.log"
    fi
    left=$(( budget - (SECONDS - start) ))
    if (( left > 30 )); then
      timeout $left $PY scripts/bench_train.py --models $MODELS --attention llsa:num_levels=2 full --sizes $SIZES \
        "${common[@]}" --out "$OUT/grow" 2>&1 | tee -a "$OUT/grow.log"
    fi
    for table in "$OUT/grow/bench_train.md" "$OUT/grow_knobs/bench_train.md"; do
      [[ -f $table ]] && { echo; echo "== $table"; cat "$table"; }
    done ;;
  trainpy)
    # Is train.py within 5% of the bench? train.py (compile=auto, real webdataset loader, Lightning, EMA, logging) on
    # quickstart crops at 256^2, DiT-S, LLSA L=2, 4 images (262,144 tokens) per step, 200 steps, then the same step
    # in scripts/bench_train.py. tokens/s of train.py = its images/s (throughput monitor, median of windows) x 65,536.
    $PY scripts/bench_scaling.py --out "$OUT/trainpy" --runs 1gpu --resolution 256 --model dit_s --per-gpu-batch 2 \
      --steps 200 --val-points 1 --throughput-window 25 --timeout 420 -- attention=llsa attention.num_levels=2 2>&1 \
      | tee "$OUT/trainpy.log"
    timeout -k 10 120 $PY scripts/bench_train.py --compile --attention llsa:num_levels=2 --sizes 256 --warmup 2 \
      --steps 5 --out "$OUT/trainpy_bench" 2>&1 | tee -a "$OUT/trainpy.log"
    for table in "$OUT/trainpy/scaling.md" "$OUT/trainpy_bench/bench_train.md"; do
      [[ -f $table ]] && { echo; echo "== $table"; cat "$table"; }
    done ;;
  fsdp2)
    # Two GPUs of one host (nvidia-h200-x2), train.py as users run it, compiled (compile=auto), on quickstart crops
    # at 256^2 (built into data/quickstart_256 on first use), LLSA L=2. Parts (second argument; each should fit one
    # 10-minute call, none measured yet; `all` runs the three in a row, ~20 min):
    #   xl: DDP vs FSDP on 2 GPUs, DiT-XL (18 heads of 64), grad checkpointing, 8 images per GPU: images/s, peak GB
    #   s:  DDP 1 vs 2 GPUs, DiT-S, global batch 8 (1 x 8 vs 2 x 4), 150 steps, + a seed-1 1-GPU run (the noise)
    #   b:  the same for DiT-B, global batch 4 (1 x 4 vs 2 x 2; 8 images of DiT-B do not fit one H200), 80 steps
    part=${2:-all}
    llsa=(attention=llsa attention.num_levels=2)
    if [[ $part == xl || $part == all ]]; then
      $PY scripts/bench_scaling.py --out "$OUT/fsdp2_xl" --runs 2gpu 2gpu_fsdp --resolution 256 --model dit_xl \
        --per-gpu-batch 8 --steps 16 --val-points 1 --throughput-window 4 --timeout 540 \
        -- "${llsa[@]}" +model.num_heads=18 model.grad_checkpointing=true 2>&1 | tee "$OUT/fsdp2_xl.log"
    fi
    if [[ $part == s || $part == all ]]; then
      $PY scripts/bench_scaling.py --out "$OUT/fsdp2_s" --runs 1gpu 2gpu --noise-run --resolution 256 --model dit_s \
        --per-gpu-batch 4 --steps 150 --val-points 3 --throughput-window 25 --timeout 540 \
        -- "${llsa[@]}" 2>&1 | tee "$OUT/fsdp2_s.log"
    fi
    if [[ $part == b || $part == all ]]; then
      $PY scripts/bench_scaling.py --out "$OUT/fsdp2_b" --runs 1gpu 2gpu --noise-run --resolution 256 --model dit_b \
        --per-gpu-batch 2 --steps 80 --val-points 2 --throughput-window 20 --timeout 540 \
        -- "${llsa[@]}" 2>&1 | tee "$OUT/fsdp2_b.log"
    fi
    for table in "$OUT"/fsdp2_xl/scaling.md "$OUT"/fsdp2_s/scaling.md "$OUT"/fsdp2_b/scaling.md; do
      [[ -f $table ]] && { echo; echo "== $table"; cat "$table"; }
    done ;;
  *)
    echo "unknown stage '$stage': use tests, attention, ab, knob, vs, loss, ncu, host, train, train-compiled, profile, sampling, scaling, grow, trainpy or fsdp2" >&2
    exit 2 ;;
esac

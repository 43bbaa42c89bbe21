#!/usr/bin/env bash
# Issue 17's checks on a GPU, as one command for a lent GPU machine (the `device` tool's `run`).
#
# This runs (first on an H200, 2026-11-28: benchmarks/RESULTS.md "GPU"), each phase under its own
# time limit and all under one deadline, what only a GPU can check, and leaves in $OUT the GPU
# profile, the updated benchmark tables and the logs, packed into logs.tar.gz at the end (at most
# 8 files come back):
#
#   tests      pytest -m gpu: kernels and ops against the CPU, fused attention, every zoo model's
#              step, every strategy on ranks sharing the GPU, GPU calibration end to end
#   main       the README's main job with --device cuda (4 ranks sharing the GPU), and gnncompile
#              train on cora on the GPU
#   calibrate  gnncompile calibrate --device cuda --quick (the profile: $OUT/gpu_profile.json)
#   spmm       benchmarks/spmm.py --device cuda on R-MAT 100k/2M, d = 64 and 256 (torch.sparse.mm,
#              every config of the own kernels and the cupy backend's choices,
#              PyG and every CUDA backend in the same run)
#   epoch      benchmarks/epoch_time.py --device cuda: one training step of GCN, SAGE and GAT on
#              cora and R-MAT 100k/2M, gc.train's against PyG's (edge_index) in the same run (each cell
#              a process of about 10 s: the module-loop and cupy-backend systems took the first lease's
#              whole phase for two rows; pass them by hand)
#   multihead  benchmarks/multihead.py --device cuda: GAT's multi-head SpMM (per-head loop vs the
#              head-interleaved product), SDDMM (gather vs sampled_addmm vs cupy) and attention
#              coefficients (torch formulation vs the own fused kernels) on cora and R-MAT 100k/2M,
#              and the torch backend's measured choices
#   profile    benchmarks/step_profile.py --device cuda: torch.profiler over gc.train's steps and PyG's
#              on cora and R-MAT 100k/2M, GCN and GAT (wall vs device time per step, launches,
#              the top operators)
#   loops      benchmarks/self_loops.py --device cuda: GCN's A + I product with the loop term apart
#              and in the product (torch: A + I folded; cupy) on R-MAT 100k/2M (not in the default
#              set: about 40 s more than the 590 s a call may run; pass it alone)
#
# Usage: bash scripts/gpu_check.sh [PHASE...]     (default: tests main multihead calibrate epoch profile spmm,
#        in that order: what the last lease measured goes last)
#
# GPU_CHECK_DEADLINE=SECONDS (default 570) bounds the whole script: a phase gets its own limit or
# what is left of the deadline, whichever is less, so the call returns with every log written.
#
# Before the call, on the development machine (costs no device time): the device has torch, CuPy,
# PyG, pytest and hypothesis but no pymetis and no ../shared, so carry them:
#
#   printf '/.whl/\n/.gpu_data/\n' >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl pymetis==2025.2.2
#   mkdir -p .gpu_data && cp -r ../shared/datasets/cora ../shared/datasets/coauthor_physics .gpu_data/
#
# then run(command="bash scripts/gpu_check.sh", carry=[".whl", ".gpu_data"], timeout_s=590).
# Budget: about 9 minutes with every phase (the native CPU kernels, which the tests' CPU
# references use, compile while CuPy compiles the CUDA kernels: about a minute); pass fewer phases
# to rerun one. The end of the output is a summary: each phase's exit status and last lines.
set -u
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(tests main multihead calibrate epoch profile spmm)
deadline=$((SECONDS + ${GPU_CHECK_DEADLINE:-570}))

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__, torch.cuda.get_device_name(0))"
  # the native CPU kernels (torch's extension build) and the CUDA kernels' module (CuPy's disk
  # cache) compile side by side, once, not in each test worker at once
  python3 -c "import gnncompile.kernels as k, torch; k._load_native(); print('native kernels built')" &
  native=$!
  python3 -c "import gnncompile.kernels as k; from gnncompile.kernels import cuda; r = k._raw_runner(); r.function(0, cuda.kernel_instances()[0]); print('CUDA kernels compiled')"
  wait $native
  echo "setup took $SECONDS s"
} > "$OUT/setup.log" 2>&1
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
[ -d .gpu_data ] && export GNNCOMPILE_DATA=$PWD/.gpu_data
export GNNCOMPILE_PROFILE=/tmp/gpu_check_cpu_profile.json   # never the machine's own cache
cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
parallel=""
python3 -c "import xdist" 2>/dev/null && parallel="-n 6"   # pytest-xdist, where the machine has it
per_test=""
python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout=120"   # a hung test fails alone

run_phase() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "phase $name: not run, $left s left of the deadline" | tee -a "$OUT/setup.log"
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "phase $name: exit $rc after $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/setup.log"
}

for phase in "${phases[@]}"; do
  case $phase in
    tests) run_phase tests 180 python3 -m pytest -v -m gpu -p no:cacheprovider $parallel $per_test --tb=short -rfE \
             --durations=15 tests ;;
    main) run_phase main 90 bash -c "python3 -m gnncompile run --dataset sbm --model gcn --gpus 4 --strategy data \
             --epochs 100 --device cuda && python3 -m gnncompile train --dataset cora --epochs 100 --device cuda" ;;
    calibrate) run_phase calibrate 150 python3 -m gnncompile calibrate --device cuda --quick --out "$OUT/gpu_profile.json" ;;
    multihead) run_phase multihead 60 python3 benchmarks/multihead.py --device cuda --graphs cora rmat \
                 --out "$OUT/RESULTS.md" ;;
    spmm) run_phase spmm 90 python3 benchmarks/spmm.py --device cuda --graphs rmat --dims 64,256 --out "$OUT/RESULTS.md" ;;
    epoch) run_phase epoch 150 python3 benchmarks/epoch_time.py --device cuda --graphs cora rmat --epochs 10 --warmup 3 \
             --models gcn sage gat --systems gnncompile-train pyg-edge_index --out "$OUT/RESULTS.md" ;;
    profile) run_phase profile 100 python3 benchmarks/step_profile.py --device cuda --graphs cora rmat --models gcn gat \
               --top 12 ;;
    loops) run_phase loops 60 python3 benchmarks/self_loops.py --device cuda --graphs rmat --dims 64,256 \
             --backends torch cupy --repeat 10 --out "$OUT/RESULTS.md" ;;
    *) echo "unknown phase $phase (tests, main, multihead, calibrate, spmm, epoch, profile, loops)" | tee -a "$OUT/setup.log" ;;
  esac
done

echo "== summary"
cat "$OUT/setup.log"
for log in "$OUT"/tests.log "$OUT"/main.log "$OUT"/multihead.log "$OUT"/calibrate.log "$OUT"/spmm.log "$OUT"/epoch.log "$OUT"/profile.log "$OUT"/loops.log; do
  [ -f "$log" ] || continue
  echo "== $(basename "$log") (last lines)"
  tail -n 25 "$log" | cut -c1-220
done
# at most 8 files come back from a lease: the logs travel as one archive (the summary above has their ends)
(cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)

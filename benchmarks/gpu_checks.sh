#!/bin/bash
# The GPU checks, time-boxed; the log goes to ${OUT:-.}/gpu_checks.log. From the repository root, on a machine with a
# CUDA GPU and the project's dependencies:
#     bash benchmarks/gpu_checks.sh [tests] [step] [bert] [light] [profile] [scatter]  (all by default, ~15 min at most)
# tests: every test that runs on a CUDA device, in one pytest run (~5 min at most): the CUDA-against-CPU, safe_divide,
# entropy, page-locked drift memory and compiled-step tests, FSDPStrategy on one GPU, and the end-to-end tests with the
# GPU as Lightning's accelerator (ATTN_CALLBACKS_TEST_ACCELERATOR=gpu; 8 workers where pytest-xdist is installed);
# step: one accumulation step alone (scaling.py, ~1 min); bert: overhead.py at BERT-base shapes, the eager step with
# pictures drawn in the background (the default there) and in process, and the compiled step (~4 min); light: the
# light model, where the host may be the bottleneck (~2.5 min); profile: where a BERT-base epoch's device time goes
# (~2 min); scatter: the scatter-add alone, with and without hot cells (~20 s).
# OLD=<folder>: a checkout of an older commit (`git worktree add --detach ../old <commit>`); bert and light then run
# its overhead.py (per head) first, on the same machine, so that old and new code compare in one log (bert ~2 min more).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MPLBACKEND=Agg
parts=${*:-tests step bert light profile scatter}
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
# old SECONDS ARGS...: the OLD tree's overhead.py with ARGS, time-boxed, when OLD is set
old() {
  [ -n "$OLD" ] || return 0
  echo "-- old code: $(git -C "$OLD" log -1 --format='%h %s' 2>/dev/null || echo "$OLD")"
  local box=$1; shift
  (cd "$OLD" && PYTHONPATH=$PWD timeout "$box" python3 benchmarks/overhead.py "$@")
  echo "-- new code: $(git log -1 --format='%h %s' 2>/dev/null || echo "$PWD")"
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
  for part in $parts; do
    echo "== $part $(date +%T)"
    case $part in
      tests)
        ATTN_CALLBACKS_TEST_ACCELERATOR=gpu timeout 300 python3 -m pytest -q -p no:cacheprovider $workers -rfs \
          --tb=short -W ignore tests/test_tensor_ops.py tests/test_step.py tests/test_step_compiled.py \
          tests/test_accumulator.py \
          tests/test_drift.py tests/test_drift_memory.py tests/test_numba_loader.py tests/test_hooks.py tests/test_callback*.py \
          tests/test_sdpa.py tests/test_hf.py tests/test_dashboard.py \
          tests/test_ddp.py::test_fsdp_strategy_on_one_gpu_logs_the_plain_models_values ;;
      step) timeout 60 python3 benchmarks/scaling.py ;;
      bert) old 150 --preset bert-base --models heavy --batches 64 --rounds 3 --configs per-head
        timeout 240 python3 benchmarks/overhead.py --preset bert-base --models heavy --batches 64 --rounds 3 \
          --configs per-head,in-process,compiled ;;
      light) old 150 --models stress --rounds 3 --configs per-head
        timeout 150 python3 benchmarks/overhead.py --models stress --rounds 3 ;;
      profile) timeout 120 python3 benchmarks/profile_epoch.py --preset bert-base --batches 16 ;;
      scatter) timeout 60 python3 benchmarks/scatter.py ;;
      *) echo "unknown part: $part (tests, step, bert, light, profile, scatter)" ;;
    esac
  done
} 2>&1 | tee "${OUT:-.}/gpu_checks.log"

#!/bin/bash
# The GPU checks, time-boxed; the log goes to ${OUT:-.}/gpu_checks.log. From the repository root, on a machine with a
# CUDA GPU and the project's dependencies:
#     bash benchmarks/gpu_checks.sh [tests] [step] [bert] [light] [profile] [scatter]   (all by default, ~18 min at most)
# tests: CUDA graph, CUDA-against-CPU, safe_divide and entropy, page-locked drift memory and end-to-end tests on the GPU
# (~4 min); step: one accumulation step alone, graph against op by op (~1 min); bert: overhead.py at BERT-base shapes,
# graphs on and off (~5 min); light: the light model, graphs on and off, where the host may be the bottleneck (~4 min);
# profile: where a BERT-base epoch's device time goes, graphs off so that the step's own kernels show (~2 min); scatter:
# the scatter-add alone, with and without hot cells (~20 s).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MPLBACKEND=Agg
parts=${*:-tests step bert light profile scatter}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
  for part in $parts; do
    echo "== $part $(date +%T)"
    case $part in
      tests)
        timeout 120 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_cuda_graphs.py tests/test_blocks.py \
          tests/test_kernels.py tests/test_accumulate.py tests/test_drift.py -k "cuda or graph or page_locked or pageable"
        ATTN_CALLBACKS_TEST_ACCELERATOR=gpu timeout 180 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=line \
          -W ignore tests/test_callback.py tests/test_sdpa.py tests/test_hf.py tests/test_dashboard.py \
          tests/test_accumulate.py tests/test_capture.py tests/test_kernels.py tests/test_cuda_graphs.py ;;
      step) timeout 60 python3 benchmarks/scaling.py ;;
      bert | light)
        preset=$([ "$part" = bert ] && echo "--preset bert-base --models heavy --batches 64" || echo "--models stress")
        for graphs in 1 0; do
          echo "-- ATTN_CALLBACKS_CUDA_GRAPHS=$graphs"
          ATTN_CALLBACKS_CUDA_GRAPHS=$graphs timeout 150 python3 benchmarks/overhead.py $preset --rounds 3
        done ;;
      profile)
        ATTN_CALLBACKS_CUDA_GRAPHS=0 timeout 120 python3 benchmarks/profile_epoch.py --preset bert-base --batches 16 ;;
      scatter) timeout 60 python3 benchmarks/scatter.py ;;
      *) echo "unknown part: $part (tests, step, bert, light, profile, scatter)" ;;
    esac
  done
} 2>&1 | tee "${OUT:-.}/gpu_checks.log"

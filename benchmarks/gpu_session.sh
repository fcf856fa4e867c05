#!/usr/bin/env bash
# GPU-machine runs, from the repo root with .devsite/ and .data/ carried (.dssite/ too for the offload baselines:
# bash benchmarks/build_deepspeed_wheel.sh). The tree copied to the device carries a stale .git: start it as
#   LAZYTRAIN_GIT_COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_session.sh tests|ddptests|<suite> [extra run args]
# tests: every GPU test (pytest -m gpu); ddptests: the same with 2 GPUs over NCCL (nvidia-h200-x2);
# soak: python -m benchmarks.soak (one long run watched for drift) into HARNESS_OUT (default
# benchmarks/results/soak-<date>.json), extra args to it;
# <suite>: python -m benchmarks.run --suite <suite> (7b, hybrid, paper, lora, sft, full, smoke), resuming from
# HARNESS_OUT (default benchmarks/results/<suite>-<date>.json); copy the file back before the next call.
# CPUSET=0-15 pins the processes (and the optimizer's threads) to the single-GPU kind's 16 cores on a larger host.
set -uo pipefail
stage=${1:?stage: tests | ddptests | <suite>}; shift
export PYTHONPATH=$PWD/.dssite:$PWD/.devsite:$PWD${PYTHONPATH:+:$PYTHONPATH}
export LAZYTRAIN_GSM8K_DIR=${LAZYTRAIN_GSM8K_DIR:-$PWD/.data/gsm8k} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PIN=""; if [ -n "${CPUSET:-}" ]; then PIN="taskset -c $CPUSET"; export LAZYTRAIN_CPU_THREADS=$(taskset -c "$CPUSET" nproc); fi
case $stage in
  tests) $PIN python3 -m pytest -q -m gpu tests -rfE -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest-gpu.log" | tail -15 ;;
  ddptests) # NVLink multicast off: the lent machines do not support it
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python3 -m pytest -q -m gpu tests/streaming tests/hf/test_ddp.py -rfE -p no:cacheprovider "$@" 2>&1 \
      | tee "$OUT/pytest-gpu-ddp.log" | tail -15 ;;
  soak) res=${HARNESS_OUT:-benchmarks/results/soak-$(date +%Y%m%d).json}
     $PIN python3 -m benchmarks.soak --out "$res" "$@"; cp "$res" "$OUT/" ;;
  *) res=${HARNESS_OUT:-benchmarks/results/$stage-$(date +%Y%m%d).json}
     $PIN python3 -m benchmarks.run --suite "$stage" --out "$res" "$@"; cp "$res" "$OUT/" ;;
esac

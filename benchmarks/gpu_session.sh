#!/usr/bin/env bash
# One GPU-machine session: GPU tests, then the executor benchmark. Run from the repo root on the device machine
# with .devsite/ (bash ../shared/tools/device-site.sh) and GSM8K under .data/gsm8k/ carried along.
#   bash benchmarks/gpu_session.sh <stage>     stage: tests | fixed | stock | milp
set -uo pipefail
export PYTHONPATH=$PWD/.devsite:$PWD${PYTHONPATH:+:$PYTHONPATH}
export LAZYTRAIN_GSM8K_DIR=${LAZYTRAIN_GSM8K_DIR:-$PWD/.data/gsm8k} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RES="$OUT/executor-$(date +%Y%m%d).json"
COMMON="--model qwen2.5-7b --seq-len 1024 --steps 5 --loss-chunk-tokens 2048 --out $RES"
for stage in "$@"; do
  case $stage in
    tests) timeout 150 python3 -m pytest -q -m gpu tests/streaming tests/optim -p no:cacheprovider 2>&1 | tail -15 ;;
    fixed) timeout 300 python3 -m benchmarks.bench_executor --system lazytrain_fixed --gpu-cap-gib 24 \
             --batch-sizes 8,16,32,64 --rows-per-pass 8 --checkpoint-every 4 --tier gpu $COMMON 2>&1 | grep -v Warning ;;
    overlap) timeout 250 python3 -m benchmarks.bench_executor --system lazytrain_fixed --gpu-cap-gib 24 \
             --batch-sizes 32,64 --rows-per-pass 8 --checkpoint-every 4 --tier gpu $COMMON 2>&1 | grep -v Warning ;;
    milp)  timeout 330 python3 -m benchmarks.bench_executor --system lazytrain_milp --gpu-cap-gib 24 \
             --batch-sizes 16,32,64 --rows-per-pass 8 $COMMON 2>&1 | grep -v Warning ;;
    stock) timeout 110 python3 -m benchmarks.bench_executor --system stock_trainer --batch-sizes 8,16 $COMMON \
             2>&1 | grep -v Warning ;;
  esac
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null | tail -1

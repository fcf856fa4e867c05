#!/usr/bin/env bash
# One GPU-machine session: GPU tests, then the executor benchmark. Run from the repo root on the device machine
# with .devsite/ (bash ../shared/tools/device-site.sh) and GSM8K under .data/gsm8k/ carried along.
# Start it as `LAZYTRAIN_GIT_COMMIT=<local git rev-parse HEAD> bash benchmarks/gpu_session.sh <stage>`: the tree copied
# to the GPU machine carries a stale .git, so results would name the wrong commit.
#   bash benchmarks/gpu_session.sh <stage>     stage: tests | gputests | s12a | s12b | s12c | s12d | s12e | s11a | s11b | s11c | s11d | s10a | s10b | s10c | s10d | s10e | s9a | s9b | s9c | s9d | s9e | s8t | s8b | s8c | s8d | s8 | s7 | s7b | optim4 | s6b | milp24gpu | optim | s5 | s6 | s6harness | fixed | overlap | milp | stock | ddp | ddpshard | ddptests | memcal | milp24 | cap80 | cap80big | harness7b | harness7b-maxbatch
#
# harness7b: the side-by-side harness (python -m benchmarks.run --suite 7b, issue 6), Qwen2.5-7B shape, seq 1024,
# caps 24 then 80 GiB, 6 warm-up (3 of them calibrate the MILP plan) + 5 timed steps per batch. Needs .dssite/ (bash benchmarks/build_deepspeed_wheel.sh)
# carried with .devsite/ and .data/: carry [".devsite", ".data", ".dssite"]. Each call works for at most
# HARNESS_BUDGET_S (540 s) and resumes from $HARNESS_OUT (default benchmarks/results/7b-<date>.json): copy the JSON
# that comes back in $OUT to that path here before the next call; the last line says "suite complete" ("all requested rows done" for a subset) or REMAINING n.
# Expected (estimates from the executor benchmark, not yet measured): per 24 GiB cap lazytrain_milp 8,16,32,64 ~4.5 min,
# lazytrain_fixed ~4 min, stock_trainer and stock_trainer_bnb8 1,8 ~0.5 min each (out of memory at batch 1),
# fsdp2_cpu_offload 8 ~3-4 min (host AdamW + 3 weight sweeps over PCIe per step), zero_offload 8 ~4-6 min (CPUAdam
# JIT build ~1.5 min, ZeRO-3 init, ~15 s steps); at 80 GiB lazytrain 64,128 ~4 min each, stock 8,16 ~1 min, bnb8
# 8,16,32 ~1.5 min, offload systems as at 24. Whole suite ~35-45 min of device time: 4-5 calls of this stage.
# HARNESS_SYSTEMS / HARNESS_CAPS pick a subset (e.g. HARNESS_SYSTEMS=lazytrain_milp,lazytrain_fixed HARNESS_CAPS=24).
# harness7b-maxbatch: largest feasible batch of LazyTrain-MILP and stock 8-bit Adam under 24 GiB (doubling from the
# largest measured batch, then bisection, one process per probe, up to batch 256): ~5-9 min. HARNESS_SYSTEMS /
# HARNESS_CAPS pick others (an out-of-memory row with no feasible one below bisects down to batch 1).
# Both write BENCHMARKS.md and the PNG into $OUT (python -m benchmarks.report).
set -uo pipefail
export PYTHONPATH=$PWD/.devsite:$PWD${PYTHONPATH:+:$PYTHONPATH}
export LAZYTRAIN_GSM8K_DIR=${LAZYTRAIN_GSM8K_DIR:-$PWD/.data/gsm8k} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RES="$OUT/executor-$(date +%Y%m%d).json"
# CPUSET=0-15 pins the single-GPU benchmark processes (milp24, cap80, cap80big) to 16 cores (the single-GPU kind's
# count) on a larger host.
PIN=""; if [ -n "${CPUSET:-}" ]; then PIN="taskset -c $CPUSET"; export LAZYTRAIN_CPU_THREADS=$(( $(taskset -c "$CPUSET" nproc) )); fi
COMMON="--model qwen2.5-7b --seq-len 1024 --steps 5 --loss-chunk-tokens 2048 --out $RES"
# hrow <timeout s> <benchmarks.run args...>: one harness call of the 7b suite, pinned, warnings filtered
hrow() { local t=$1; shift; timeout "$t" $PIN python3 -m benchmarks.run --suite 7b --min-start-s 40 "$@" 2>&1 \
  | grep -v -i warning | grep -v train_runtime; }
for stage in "$@"; do
  case $stage in
    tests) timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -m gpu tests/streaming tests/optim tests/profiling -rfE \
             -p no:cacheprovider 2>&1 | tee "$OUT/pytest-gpu.log" | tail -15 ;;
    s5)    # nvidia-h200-x2 (~9.5 min): the session-5 plan of benchmarks/NOTES.md in one call: the single-GPU GPU tests
           # (stream-ordering tests included), then MILP + GPU-side updates at 24 GiB B=8 and 64 on 16 cores
           # (every row must show skipped_steps 0), then the NCCL sharded test. Follow with `ddpshard` (2nd call).
           TESTS_TIMEOUT=${TESTS_TIMEOUT:-150} bash "$0" tests
           S="--gpu-cap-gib 24 --rows-per-pass 8 --model qwen2.5-7b --seq-len 1024 --loss-chunk-tokens 2048 --out $RES"
           timeout 200 $PIN python3 -m benchmarks.bench_executor --system lazytrain_milp --gpu-optimizer \
             --batch-sizes 8,64 --steps 5 $S 2>&1 | grep -v Warning
           export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
           timeout 150 python3 -m pytest -q -m gpu tests/hf/test_ddp.py -rfE -p no:cacheprovider 2>&1 | tail -6 ;;
    s6)    # 1 GPU (~8 min; CPUSET=0-15 on x2): the session-6 plan of benchmarks/NOTES.md: GPU tests (the measured-layer
           # plan test included), MILP + GPU updates at 24 GiB B=8 and 64 planned with measured layer times (rows
           # record layer_costs), then B=64 with two cores left to the launching thread (is the +11% compute the CPU
           # update starving the kernel launches?), then the optimizer rates (Kahan kernel)
           TESTS_TIMEOUT=${TESTS_TIMEOUT:-150} bash "$0" tests
           S="--gpu-cap-gib 24 --rows-per-pass 8 --model qwen2.5-7b --seq-len 1024 --loss-chunk-tokens 2048 --out $RES"
           timeout 200 $PIN python3 -m benchmarks.bench_executor --system lazytrain_milp --gpu-optimizer \
             --batch-sizes 8,64 --steps 4 $S 2>&1 | grep -v Warning
           T=${LAZYTRAIN_CPU_THREADS:-$(nproc)}
           LAZYTRAIN_CPU_THREADS=$(( T - 2 )) timeout 130 $PIN python3 -m benchmarks.bench_executor --system lazytrain_milp \
             --gpu-optimizer --batch-sizes 64 --steps 4 $S 2>&1 | grep -v Warning
           bash "$0" optim ;;
    s7)    # 1 GPU (~8.5 min; 4 warm-up steps per row now): GPU tests, then issue 3 / 5 / 6 with the CPU-rate calibration (hf/calibrate.py): stock
           # Trainer uncapped B=32 and MILP at 24 GiB B=32 in one run, MILP at 80 GiB B=64, then MILP 24 GiB B=32 with
           # one core left to the launching thread (LAZYTRAIN_CPU_THREADS = cores - 1). Rows record the worker's
           # measured rate, the GPU-updated layer count and the wait on CPU updates.
           TESTS_TIMEOUT=${TESTS_TIMEOUT:-150} bash "$0" tests
           HRES=${HARNESS_OUT:-benchmarks/results/7b-s7-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --out $HRES --min-start-s 40"
           timeout 90 $PIN $H --systems stock_trainer --caps none --batch-sizes 32 --budget-s 85 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 130 $PIN $H --systems lazytrain_milp --caps 24 --batch-sizes 32 --budget-s 125 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 170 $PIN $H --systems lazytrain_milp --caps 80 --batch-sizes 64 --budget-s 165 2>&1 | grep -v -i warning | grep -v train_runtime
           T=${LAZYTRAIN_CPU_THREADS:-$(nproc)}
           LAZYTRAIN_CPU_THREADS=$(( T - 1 )) timeout 130 $PIN python3 -m benchmarks.run --suite 7b \
             --out "${HRES%.json}-threads.json" --min-start-s 40 --systems lazytrain_milp --caps 24 --batch-sizes 32 \
             --budget-s 125 2>&1 | grep -v -i warning | grep -v train_runtime
           cp "$HRES" "${HRES%.json}-threads.json" "$OUT/" ;;
    s8t)   # 1 GPU (~8.5 min): the fused Triton update kernel (session 8): its GPU tests (bit-equal to the C++ kernel, and
           # GPU-side layer updates bit-equal to CPU ones), its rate against bitsandbytes' path, the CPU's vector
           # extensions, then issue 3's B=32 pair (stock uncapped, MILP 24 GiB) and MILP 24 GiB B=16 with it
           timeout 150 python3 -m pytest -q -m gpu tests/optim/test_triton_kernel.py tests/streaming/test_executor_gpu.py \
             -k "triton or gpu_side" -rfE -p no:cacheprovider 2>&1 | tee "$OUT/pytest-gpu-s8t.log" | tail -6
           timeout 90 python3 -m benchmarks.bench_optim --params 67108864 --master-weights kahan --grad-dtype bf16 \
             --systems hybrid8_gpu,hybrid8_gpu_triton --out "$OUT/hybrid8-s8t.json" 2>&1 | grep -v Warning
           grep -o -w 'avx512[a-z_]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
           HRES=${HARNESS_OUT:-$OUT/7b-s8t-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --out $HRES --min-start-s 40"
           timeout 90 $PIN $H --systems stock_trainer --caps none --batch-sizes 32 --budget-s 85 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 130 $PIN $H --systems lazytrain_milp --caps 24 --batch-sizes 32 --budget-s 125 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 120 $PIN $H --systems lazytrain_milp --caps 24 --batch-sizes 16 --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s8b)   # 1 GPU (~8 min): the Triton kernel's launch shapes, the C++ kernel's thread scaling (8 and 16 threads,
           # unbound and OMP_PROC_BIND=close: session 7's 8 threads ran 3.5x one), then issue 3's B=8 / 16 stock
           # references (uncapped) with MILP 24 GiB B=8 in the same run, and MILP 80 GiB B=64 with the Triton kernel
           timeout 70 python3 -m benchmarks.bench_optim --params 67108864 --master-weights kahan --grad-dtype bf16 \
             --systems hybrid8_gpu_triton --triton-launch 1:4,2:4,4:4,8:4,4:8,8:8,16:8 \
             --out "$OUT/hybrid8-s8b-launch.json" 2>&1 | grep -v Warning
           for bind in "" close; do
             env ${bind:+OMP_PROC_BIND=$bind} LAZYTRAIN_CPU_LOOKUP=gather timeout 50 $PIN python3 -m benchmarks.bench_optim \
               --threads 8,16 --params 67108864 --master-weights kahan --grad-dtype bf16 --systems hybrid8_cpp \
               --out "$OUT/hybrid8-s8b-bind${bind:-none}.json" 2>&1 | grep -v Warning
           done
           HRES=${HARNESS_OUT:-$OUT/7b-s8b-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --out $HRES --min-start-s 40"
           timeout 90 $PIN $H --systems stock_trainer --caps none --batch-sizes 8,16 --budget-s 85 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 120 $PIN $H --systems lazytrain_milp --caps 24 --batch-sizes 8 --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 170 $PIN $H --systems lazytrain_milp --caps 80 --batch-sizes 64 --budget-s 165 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s8c)   # 1 GPU (~8 min): the C++ kernel's 8-bit loop in dynamic chunks (a static split waited for the thread that
           # shares its core with the launching thread): its standalone rate, then the worker's in-step rate and the step
           # at 24 GiB B=16 (with the stock reference), 8 and 32
           LAZYTRAIN_CPU_LOOKUP=gather timeout 40 $PIN python3 -m benchmarks.bench_optim --threads 16 --params 67108864 \
             --master-weights kahan --grad-dtype bf16 --systems hybrid8_cpp --out "$OUT/hybrid8-s8c.json" 2>&1 | grep -v Warning
           HRES=${HARNESS_OUT:-$OUT/7b-s8c-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --out $HRES --min-start-s 40"
           timeout 70 $PIN $H --systems stock_trainer --caps none --batch-sizes 16 --budget-s 65 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 120 $PIN $H --systems lazytrain_milp --caps 24 --batch-sizes 16 --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 120 $PIN $H --systems lazytrain_milp --caps 24 --batch-sizes 8 --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 130 $PIN $H --systems lazytrain_milp --caps 24 --batch-sizes 32 --budget-s 125 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s9a)   # 1 GPU (~8.5 min): kept gradients (a GPU-updated layer's gradient stays on the GPU from backward to its
           # update): the GPU tests (stream ordering with a late D2H stream, Triton bits, kept and not), then at 24 GiB
           # the stock reference B=16 and MILP B=16 with and without kept gradients, then MILP B=8 with them
           timeout 150 python3 -m pytest -q -m gpu tests/streaming/test_executor_gpu.py tests/optim/test_triton_kernel.py \
             -k "gpu_side_layer_updates or triton or cuda_kernel_choice" -rfE -p no:cacheprovider 2>&1 \
             | tee "$OUT/pytest-gpu-s9a.log" | tail -6
           # the C++ kernel's AVX-512 path against AVX2 and generic, bit for bit (skipped where the CPU lacks it)
           timeout 90 python3 -m pytest -q tests/optim/test_cpu_isa.py -rs -p no:cacheprovider 2>&1 \
             | tee "$OUT/pytest-isa-s9a.log" | tail -4
           python3 -c "from lazytrain_hf.optim._cpu_kernel import cpu_kernel_status; print(cpu_kernel_status())"
           HRES=${HARNESS_OUT:-$OUT/7b-s9a-$(date +%Y%m%d).json}
           NRES=${HARNESS_OUT_NOKEPT:-$OUT/7b-s9a-nokept-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --min-start-s 40"
           timeout 70 $PIN $H --out $HRES --systems stock_trainer --caps none --batch-sizes 16 --budget-s 65 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 120 $PIN $H --out $HRES --systems lazytrain_milp --caps 24 --batch-sizes 16 --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 120 $PIN $H --out $NRES --no-kept-grads --systems lazytrain_milp --caps 24 --batch-sizes 16 --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 120 $PIN $H --out $HRES --systems lazytrain_milp --caps 24 --batch-sizes 8 --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s9b)   # 1 GPU (~8 min): the C++ kernel's AVX-512 path against AVX2 alone (64 Mi params, Kahan, bf16 grads, 16
           # threads), then in steps (MILP 24 GiB B=16, kept gradients, forced AVX2: against s9a's AVX-512 row), MILP
           # B=8 without kept gradients, the stock reference B=8, MILP B=32 with them
           timeout 60 $PIN python3 -m benchmarks.bench_optim --threads 16 --params 67108864 --master-weights kahan \
             --grad-dtype bf16 --systems hybrid8_cpp --cpu-isa avx512,avx2 --out "$OUT/hybrid8-s9b-isa.json" 2>&1 | grep -v Warning
           HRES=${HARNESS_OUT:-$OUT/7b-s9b-$(date +%Y%m%d).json}
           ARES=${HARNESS_OUT_AVX2:-$OUT/7b-s9b-avx2-$(date +%Y%m%d).json}
           NRES=${HARNESS_OUT_NOKEPT:-$OUT/7b-s9b-nokept-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --min-start-s 40"
           LAZYTRAIN_CPU_ISA=avx2 timeout 120 $PIN $H --out $ARES --systems lazytrain_milp --caps 24 --batch-sizes 16 --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 120 $PIN $H --out $NRES --no-kept-grads --systems lazytrain_milp --caps 24 --batch-sizes 8 --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 70 $PIN $H --out $HRES --systems stock_trainer --caps none --batch-sizes 8 --budget-s 65 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 130 $PIN $H --out $HRES --systems lazytrain_milp --caps 24 --batch-sizes 32 --budget-s 125 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s9c)   # 1 GPU (~7.5 min): the default CPU path back to AVX2 (AVX-512 measured slower in s9b), kept gradients: the
           # ISA tests, then issue 3's rows side by side: stock B=16, MILP 24 GiB B=16, 8 and 32
           timeout 90 python3 -m pytest -q tests/optim/test_cpu_isa.py -rs -p no:cacheprovider 2>&1 \
             | tee "$OUT/pytest-isa-s9c.log" | tail -4
           HRES=${HARNESS_OUT:-$OUT/7b-s9c-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --min-start-s 40 --out $HRES"
           timeout 70 $PIN $H --systems stock_trainer --caps none --batch-sizes 16 --budget-s 65 2>&1 | grep -v -i warning | grep -v train_runtime
           for b in 16 8; do
             timeout 120 $PIN $H --systems lazytrain_milp --caps 24 --batch-sizes $b --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime
           done
           timeout 130 $PIN $H --systems lazytrain_milp --caps 24 --batch-sizes 32 --budget-s 125 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s9d)   # 1 GPU (~5.5 min): the stock B=16 reference that s9c's 70 s limit cut off, MILP 24 GiB B=16 again beside it,
           # then B=32 with 16 rows per layer pass (half the layer passes)
           HRES=${HARNESS_OUT:-$OUT/7b-s9d-$(date +%Y%m%d).json}
           RRES=${HARNESS_OUT_ROWS:-$OUT/7b-s9d-rows16-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --min-start-s 40"
           timeout 100 $PIN $H --out $HRES --systems stock_trainer --caps none --batch-sizes 16 --budget-s 95 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 120 $PIN $H --out $HRES --systems lazytrain_milp --caps 24 --batch-sizes 16 --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 130 $PIN $H --out $RRES --rows-per-pass 16 --systems lazytrain_milp --caps 24 --batch-sizes 32 --budget-s 125 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s12a)  # 1 GPU (~9.5 min): issue 3's batch 32 with the allocator A/B on ONE plan (HARNESS_CALIBRATE_STEPS=0; the
           # first row builds the kernels): MILP 24 GiB default allocator, then expandable segments; stock B=32
           # uncapped (120 s: s11d's 90 s was too short cold); then expandable segments with gpu_memory_margin 0.06,
           # calibrated as usual
           HRES=${HARNESS_OUT:-$OUT/7b-s12a-$(date +%Y%m%d).json}
           ERES=${HARNESS_OUT_EXP:-$OUT/7b-s12a-expandable-$(date +%Y%m%d).json}
           M="--batch-sizes 32 --systems lazytrain_milp --caps 24"
           X=expandable_segments:True
           HARNESS_CALIBRATE_STEPS=0 hrow 165 $M --out $HRES --budget-s 160
           HARNESS_CALIBRATE_STEPS=0 PYTORCH_CUDA_ALLOC_CONF=$X hrow 125 $M --out $ERES --budget-s 120
           hrow 125 --out $HRES --systems stock_trainer --caps none --batch-sizes 32 --budget-s 120
           HARNESS_GPU_MEMORY_MARGIN=0.06 PYTORCH_CUDA_ALLOC_CONF=$X hrow 150 $M \
             --out $OUT/7b-s12a-margin06-$(date +%Y%m%d).json --budget-s 145 ;;
    s12b)  # 1 GPU (~9 min): issue 3's batch 64 (MILP last measured in session 6) and 16 side by side at this session's
           # code: stock B=64 uncapped (may not fit the whole H200), MILP 24 GiB B=64 (builds the kernels), stock B=16,
           # MILP 24 GiB B=16; default allocator throughout (s12a: expandable segments changed nothing on one plan)
           HRES=${HARNESS_OUT:-$OUT/7b-s12b-$(date +%Y%m%d).json}
           hrow 160 --out $HRES --systems stock_trainer --caps none --batch-sizes 64 --budget-s 155
           hrow 170 --out $HRES --systems lazytrain_milp --caps 24 --batch-sizes 64 --budget-s 165
           hrow 80 --out $HRES --systems stock_trainer --caps none --batch-sizes 16 --budget-s 75
           hrow 120 --out $HRES --systems lazytrain_milp --caps 24 --batch-sizes 16 --budget-s 115 ;;
    s12c)  # 1 GPU (~5 min): MILP 24 GiB B=64 alone (s12b's 165 s were too short for it: kernel build, two slow
           # first steps and 11 steps of ~7 s)
           HRES=${HARNESS_OUT:-$OUT/7b-s12c-$(date +%Y%m%d).json}
           hrow 300 --out $HRES --systems lazytrain_milp --caps 24 --batch-sizes 64 --budget-s 290 ;;
    s12d)  # 1 GPU (~7 min): the GPU tests in full (the state arena now reserves the optimizer's exact states, and the
           # optimizer's state allocation was refactored), then B=16 side by side: stock uncapped, MILP 24 GiB (rows
           # record pinned planned vs locked: predicted 1.000x, was 1.049-1.051x)
           TESTS_TIMEOUT=200 bash "$0" tests
           HRES=${HARNESS_OUT:-$OUT/7b-s12d-$(date +%Y%m%d).json}
           hrow 80 --out $HRES --systems stock_trainer --caps none --batch-sizes 16 --budget-s 75
           hrow 125 --out $HRES --systems lazytrain_milp --caps 24 --batch-sizes 16 --budget-s 120 ;;
    s12e)  # 1 GPU (~6 min, the session's last device time): rows at batch 8 and 32 with the exact-size state
           # reservation (the report's pinned target reads each batch's latest row): stock B=8, MILP 24 GiB B=8, MILP B=32
           HRES=${HARNESS_OUT:-$OUT/7b-s12e-$(date +%Y%m%d).json}
           hrow 70 --out $HRES --systems stock_trainer --caps none --batch-sizes 8 --budget-s 65
           hrow 110 --out $HRES --systems lazytrain_milp --caps 24 --batch-sizes 8 --budget-s 105
           hrow 150 --out $HRES --systems lazytrain_milp --caps 24 --batch-sizes 32 --budget-s 145 ;;
    s11a)  # 1 GPU (~8 min): the GPU tests in full (slot reuse, the optimizer-load hook and the 2% switch rule were
           # built after the last GPU call), then Note [slot reuse] off / on at MILP 24 GiB B=16 in one run (rows
           # record h2d_weight_gib_per_step; the first row builds the kernels)
           bash "$0" tests
           HRES=${HARNESS_OUT:-$OUT/7b-s11a-$(date +%Y%m%d).json}
           ORES=${HARNESS_OUT_NOREUSE:-$OUT/7b-s11a-noreuse-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --min-start-s 40 --systems lazytrain_milp --caps 24 --batch-sizes 16"
           HARNESS_SLOT_REUSE=0 timeout 165 $PIN $H --out $ORES --budget-s 160 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 120 $PIN $H --out $HRES --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s11b)  # 1 GPU (~8 min): the GPU-update tests s11a failed (their late-H2D wrapper predates reuse=), then issue 3's
           # batch 16 side by side in one run: stock uncapped, MILP 24 GiB, MILP 24 GiB with the CUDA allocator's
           # expandable segments (rows record allocator retries / cudaMalloc / cudaFree per timed step), then a profiled step
           timeout 100 python3 -m pytest -q -m gpu tests/streaming/test_executor_gpu.py -rfE -p no:cacheprovider 2>&1 \
             | tee "$OUT/pytest-gpu-s11b.log" | tail -3
           HRES=${HARNESS_OUT:-$OUT/7b-s11b-$(date +%Y%m%d).json}
           ERES=${HARNESS_OUT_EXP:-$OUT/7b-s11b-expandable-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --min-start-s 40 --batch-sizes 16"
           timeout 80 $PIN $H --out $HRES --systems stock_trainer --caps none --budget-s 75 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 165 $PIN $H --out $HRES --systems lazytrain_milp --caps 24 --budget-s 160 2>&1 | grep -v -i warning | grep -v train_runtime
           PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 120 $PIN $H --out $ERES --systems lazytrain_milp \
             --caps 24 --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime
           # then one profiled step (the 4th timed) of MILP B=16: its kernel table lands in $OUT
           HARNESS_PROFILE_STEP=9 HARNESS_PROFILE_DIR=$OUT timeout 120 $PIN $H --out $OUT/7b-s11b-profile-$(date +%Y%m%d).json \
             --systems lazytrain_milp --caps 24 --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s11c)  # 1 GPU (~7 min): the allocator A/B on ONE plan (HARNESS_CALIBRATE_STEPS=0: no re-plan, so both rows run the
           # first plan whatever the host's CPU rate): MILP 24 GiB B=16 default allocator, then expandable segments;
           # then the profiled step s11b ran out of time for (CUDA kernels only now), calibrated as usual
           HRES=${HARNESS_OUT:-$OUT/7b-s11c-$(date +%Y%m%d).json}
           ERES=${HARNESS_OUT_EXP:-$OUT/7b-s11c-expandable-$(date +%Y%m%d).json}
           M="--batch-sizes 16 --systems lazytrain_milp --caps 24"
           HARNESS_CALIBRATE_STEPS=0 hrow 165 $M --out $HRES --budget-s 160
           HARNESS_CALIBRATE_STEPS=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True hrow 120 $M --out $ERES --budget-s 115
           HARNESS_PROFILE_STEP=9 HARNESS_PROFILE_DIR=$OUT hrow 185 $M --out $OUT/7b-s11c-profile-$(date +%Y%m%d).json \
             --budget-s 180 ;;
    s11d)  # 1 GPU (~7.5 min): issue 3's batch 32 and 8 side by side at this session's code (slot reuse on): stock B=32
           # uncapped, MILP 24 GiB B=32 (the first LazyTrain row builds the kernels), stock B=8, MILP B=8
           HRES=${HARNESS_OUT:-$OUT/7b-s11d-$(date +%Y%m%d).json}
           hrow 95 --out $HRES --systems stock_trainer --caps none --batch-sizes 32 --budget-s 90
           hrow 165 --out $HRES --systems lazytrain_milp --caps 24 --batch-sizes 32 --budget-s 160
           hrow 70 --out $HRES --systems stock_trainer --caps none --batch-sizes 8 --budget-s 65
           hrow 110 --out $HRES --systems lazytrain_milp --caps 24 --batch-sizes 8 --budget-s 105 ;;
    s10a)  # 1 GPU (~7.5 min): the GPU tests in full (the review pass and prepared moments came after the last GPU
           # call), the ISA tests (AVX-512 prepared bits on real AVX-512), the two halves of the C++ update apart
           # (64 Mi, Kahan, bf16 grads, 16 and 8 threads), then MILP 24 GiB B=16 with prepared moments (default)
           bash "$0" tests
           timeout 90 python3 -m pytest -q tests/optim/test_cpu_isa.py -rs -p no:cacheprovider 2>&1 \
             | tee "$OUT/pytest-isa-s10a.log" | tail -4
           timeout 90 $PIN python3 -m benchmarks.bench_optim --threads 16,8 --params 67108864 --master-weights kahan \
             --grad-dtype bf16 --systems hybrid8_cpp,hybrid8_cpp_prepared,hybrid8_cpp_prepare \
             --out "$OUT/hybrid8-s10a-prepared.json" 2>&1 | grep -v Warning
           HRES=${HARNESS_OUT:-$OUT/7b-s10a-$(date +%Y%m%d).json}
           timeout 160 $PIN python3 -m benchmarks.run --suite 7b --min-start-s 40 --out $HRES --systems lazytrain_milp \
             --caps 24 --batch-sizes 16 --budget-s 155 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s10b)  # 1 GPU (~8.5 min): the one GPU test s10a failed (stale: it predates the Triton default), then issue 3 side
           # by side in one run at this commit (prepared moments off, the default): stock B=32 uncapped, MILP 24 GiB
           # B=32 (160 s: the first LazyTrain row builds the kernels), stock B=16, MILP B=16
           timeout 60 python3 -m pytest -q -m gpu tests/optim/test_hybrid8_gpu.py -rfE -p no:cacheprovider 2>&1 \
             | tee "$OUT/pytest-gpu-s10b.log" | tail -3
           HRES=${HARNESS_OUT:-$OUT/7b-s10b-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --min-start-s 40 --out $HRES"
           timeout 95 $PIN $H --systems stock_trainer --caps none --batch-sizes 32 --budget-s 90 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 165 $PIN $H --systems lazytrain_milp --caps 24 --batch-sizes 32 --budget-s 160 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 80 $PIN $H --systems stock_trainer --caps none --batch-sizes 16 --budget-s 75 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 120 $PIN $H --systems lazytrain_milp --caps 24 --batch-sizes 16 --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s10c)  # 1 GPU (~8.5 min): prepared moments on and off in one run (s10a / s10b were separate calls whose in-step
           # CPU rates, 3.02-3.28 G params/s, sit inside one spread): MILP 24 GiB B=16 on, off, then B=8 off, on
           PRES=${HARNESS_OUT_PREP:-$OUT/7b-s10c-prepared-$(date +%Y%m%d).json}
           ORES=${HARNESS_OUT:-$OUT/7b-s10c-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --min-start-s 40 --systems lazytrain_milp --caps 24"
           P="env LAZYTRAIN_PREPARED_STATES_BUDGET=40GiB"
           $P timeout 165 $PIN $H --out $PRES --batch-sizes 16 --budget-s 160 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 115 $PIN $H --out $ORES --batch-sizes 16 --budget-s 110 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 115 $PIN $H --out $ORES --batch-sizes 8 --budget-s 110 2>&1 | grep -v -i warning | grep -v train_runtime
           $P timeout 115 $PIN $H --out $PRES --batch-sizes 8 --budget-s 110 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s10d)  # 1 GPU (~5 min): the calibration's re-plan now switches only for a predicted gain > 2% (SWITCH_GAIN): MILP
           # 24 GiB B=16 and B=8 (rows record kept_running_ms / replanned_ms when the running plan stayed)
           HRES=${HARNESS_OUT:-$OUT/7b-s10d-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --min-start-s 40 --out $HRES --systems lazytrain_milp --caps 24"
           timeout 165 $PIN $H --batch-sizes 16 --budget-s 160 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 115 $PIN $H --batch-sizes 8 --budget-s 110 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s10e)  # 1 GPU (~5 min): the CPU update is memory bound in steps (s10a-c): does it keep its rate on 12 of the 16
           # cores, leaving 4 to the launching thread and the copy threads? MILP 24 GiB B=16 at 12 threads, then 16
           T=${LAZYTRAIN_CPU_THREADS:-$(nproc)}
           HRES=${HARNESS_OUT:-$OUT/7b-s10e-$(date +%Y%m%d).json}
           TRES=${HARNESS_OUT_T12:-$OUT/7b-s10e-t12-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --min-start-s 40 --systems lazytrain_milp --caps 24 --batch-sizes 16"
           LAZYTRAIN_CPU_THREADS=$(( T - 4 )) timeout 165 $PIN $H --out $TRES --budget-s 160 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 115 $PIN $H --out $HRES --budget-s 110 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s9e)   # 1 GPU (~4 min): issue 3's batch 32 side by side in one run: stock B=32 uncapped, MILP 24 GiB B=32
           HRES=${HARNESS_OUT:-$OUT/7b-s9e-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --min-start-s 40 --out $HRES"
           timeout 95 $PIN $H --systems stock_trainer --caps none --batch-sizes 32 --budget-s 90 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 130 $PIN $H --systems lazytrain_milp --caps 24 --batch-sizes 32 --budget-s 125 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s8d)   # 1 GPU (~6 min): 14 optimizer threads on the 16 cores (two left to the launching and copy threads, now that
           # the kernel's chunks are dynamic), MILP 24 GiB B=8, 16, 32: does the compute factor k fall?
           T=${LAZYTRAIN_CPU_THREADS:-$(nproc)}
           HRES=${HARNESS_OUT:-$OUT/7b-s8d-$(date +%Y%m%d).json}
           for b in 8 16 32; do
             LAZYTRAIN_CPU_THREADS=$(( T - 2 )) timeout 125 $PIN python3 -m benchmarks.run --suite 7b --out "$HRES" \
               --min-start-s 40 --systems lazytrain_milp --caps 24 --batch-sizes $b --budget-s 120 2>&1 | grep -v -i warning | grep -v train_runtime
           done ;;
    s8)    # 1 GPU (~8 min): where issue 3's batch 8 / 16 gap goes (NOTES "Next GPU session (written end of session 7)"):
           # the CPU's vector extensions, MILP at 24 GiB B=8 and 16 with the update counters, then the C++ kernel at
           # 4 / 8 / 12 / 16 threads, unbound and with OMP_PROC_BIND=close (session 7: 8 threads only 3.5x one)
           grep -o -w 'avx512[a-z_]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
           HRES=${HARNESS_OUT:-$OUT/7b-s8-$(date +%Y%m%d).json}
           timeout 230 $PIN python3 -m benchmarks.run --suite 7b --out "$HRES" --min-start-s 40 --systems lazytrain_milp \
             --caps 24 --batch-sizes 8,16 --budget-s 225 2>&1 | grep -v -i warning | grep -v train_runtime
           for bind in "" close; do
             env ${bind:+OMP_PROC_BIND=$bind} LAZYTRAIN_CPU_LOOKUP=gather timeout 100 $PIN python3 -m benchmarks.bench_optim \
               --threads 4,8,12,16 --params 67108864 --master-weights kahan --grad-dtype bf16 --systems hybrid8_cpp \
               --out "$OUT/hybrid8-s8-bind${bind:-none}.json" 2>&1 | grep -v Warning
           done ;;
    s7b)   # 1 GPU (~8 min): issue 4's CPU thread sweep again (session 7's `optim4` ran every C++ row on 16 threads:
           # the exported LAZYTRAIN_CPU_THREADS overrode the sweep; fixed), then issue 6's missing 24 GiB rows: FSDP2 CPU
           # offload at B=4 and 1 (out of memory at 8), lazytrain_fixed at B=64 at this commit (MILP / fixed best vs best)
           LAZYTRAIN_CPU_LOOKUP=gather timeout 100 $PIN python3 -m benchmarks.bench_optim --threads 1,8,16 \
             --params 67108864 --master-weights kahan --grad-dtype bf16 --systems hybrid8_cpp,torch_adamw_fused_fp32 \
             --out "$OUT/hybrid8-s7-sweep.json" 2>&1 | grep -v Warning
           HRES=${HARNESS_OUT:-$OUT/7b-s7b-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --out $HRES --min-start-s 40"
           timeout 185 $PIN $H --systems fsdp2_cpu_offload --caps 24 --batch-sizes 4 --budget-s 180 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 150 $PIN $H --systems lazytrain_fixed --caps 24 --batch-sizes 64 --budget-s 145 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 150 $PIN $H --systems fsdp2_cpu_offload --caps 24 --batch-sizes 1 --budget-s 145 2>&1 | grep -v -i warning | grep -v train_runtime ;;
    s6b)   # 1 GPU (~8.5 min): the Qwen3.5 layer-measure test (3-D rotary positions), the deferred CPU updates' worker
           # and blocked times at 24 GiB B=8 (bench_executor: cpu_upd / wait), then issue 3 at 64 x 1024 tokens/step
           # (stock uncapped vs MILP 24 GiB, same run) and the calibrated MILP at 80 GiB B=64 (issue 5)
           timeout 60 python3 -m pytest -q -m gpu tests/profiling -rfE -p no:cacheprovider 2>&1 | tail -3
           S="--gpu-cap-gib 24 --rows-per-pass 8 --model qwen2.5-7b --seq-len 1024 --loss-chunk-tokens 2048 --out $RES"
           timeout 100 $PIN python3 -m benchmarks.bench_executor --system lazytrain_milp --gpu-optimizer \
             --batch-sizes 8 --steps 4 $S 2>&1 | grep -v Warning
           HRES=${HARNESS_OUT:-benchmarks/results/7b-s6b-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --out $HRES --min-start-s 40"
           timeout 120 $PIN $H --systems stock_trainer --caps none --batch-sizes 64 --budget-s 115 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 300 $PIN $H --systems lazytrain_milp --caps 24,80 --batch-sizes 64 --budget-s 295 2>&1 | grep -v -i warning | grep -v train_runtime
           cp "$HRES" "$OUT/" ;;
    milp24gpu) # 1 GPU (~4 min): 24 GiB, fixed B=8 (the same-run reference) and MILP + GPU-side updates B=8 and 64
           S="--gpu-cap-gib 24 --rows-per-pass 8 --model qwen2.5-7b --seq-len 1024 --loss-chunk-tokens 2048 --out $RES"
           timeout 110 $PIN python3 -m benchmarks.bench_executor --system lazytrain_fixed --checkpoint-every 4 --tier gpu \
             --batch-sizes 8 --steps 3 $S 2>&1 | grep -v Warning
           timeout 180 $PIN python3 -m benchmarks.bench_executor --system lazytrain_milp --gpu-optimizer \
             --batch-sizes 8,64 --steps 4 $S 2>&1 | grep -v Warning ;;
    optim) # (~1.5 min): the optimizer update's params/s on this host's cores (issue 4's >= 3.0 G params/s on 16), fp32
           # master (fp32 grads) and Kahan master (bf16 grads, as the executor runs it), both table-read modes
           T=${LAZYTRAIN_CPU_THREADS:-$(nproc)}
           for mw in fp32 kahan; do
             gd=fp32; [ $mw = kahan ] && gd=bf16
             for lk in gather scalar; do
               sys=hybrid8_cpp,hybrid8_cpp_fp32_states,torch_adamw_fused_fp32
               [ $lk = gather ] && [ $mw = fp32 ] && sys=$sys,hybrid8_torch,bnb_adamw8bit_cpu
               LAZYTRAIN_CPU_LOOKUP=$lk timeout 120 $PIN python3 -m benchmarks.bench_optim --threads "$T" --params 67108864 \
                 --master-weights $mw --grad-dtype $gd --systems $sys --out "$OUT/hybrid8-$mw-$lk.json" 2>&1 | grep -v Warning
             done
           done
           # 4K aliasing probe: the Kahan path with its buffers at distinct page offsets (bench_optim --stagger)
           timeout 60 $PIN python3 -m benchmarks.bench_optim --threads "$T" --params 67108864 --master-weights kahan \
             --grad-dtype bf16 --systems hybrid8_cpp --stagger 1088 --out "$OUT/hybrid8-kahan-stagger.json" 2>&1 | grep -v Warning ;;
    optim4) # 1 GPU (~1.5 min): issue 4's benchmark table: the C++ kernel (Kahan + bf16 grads, as the executor runs it)
           # and torch's fused fp32 AdamW on 1, 8 and 16 threads, then the GPU rows (Hybrid8 through bitsandbytes'
           # blockwise kernel, bitsandbytes AdamW8bit, torch AdamW fused and foreach), 64 Mi parameters
           LAZYTRAIN_CPU_LOOKUP=gather timeout 150 $PIN python3 -m benchmarks.bench_optim --threads 1,8,16 \
             --params 67108864 --master-weights kahan --grad-dtype bf16 \
             --systems hybrid8_cpp,torch_adamw_fused_fp32,hybrid8_gpu,bnb_adamw8bit_gpu,torch_adamw_fused_fp32_gpu,torch_adamw_foreach_fp32_gpu \
             --out "$OUT/hybrid8-sweep.json" 2>&1 | grep -v Warning ;;
    gputests) # nvidia-h200-x2 (~3.5 min): every GPU test, 2 GPUs over NCCL == 1 GPU included
           export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
           timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -m gpu tests/streaming tests/optim tests/hf/test_ddp.py \
             -p no:cacheprovider 2>&1 | tee "$OUT/pytest-gpu.log" | tail -15 ;;
    fixed) timeout 300 python3 -m benchmarks.bench_executor --system lazytrain_fixed --gpu-cap-gib 24 \
             --batch-sizes 8,16,32,64 --rows-per-pass 8 --checkpoint-every 4 --tier gpu $COMMON 2>&1 | grep -v Warning ;;
    overlap) timeout 250 python3 -m benchmarks.bench_executor --system lazytrain_fixed --gpu-cap-gib 24 \
             --batch-sizes 32,64 --rows-per-pass 8 --checkpoint-every 4 --tier gpu $COMMON 2>&1 | grep -v Warning ;;
    milp)  timeout 330 python3 -m benchmarks.bench_executor --system lazytrain_milp --gpu-cap-gib 24 \
             --batch-sizes 16,32,64 --rows-per-pass 8 $COMMON 2>&1 | grep -v Warning ;;
    s6harness) # 1 GPU (~9.5 min): issue 3's same-run comparison (stock Trainer uncapped vs LazyTrain MILP at 24 GiB,
           # B=8/16/32; the MILP plan calibrated on the warm-up steps), then the fixed policy at 24 and 80 GiB (issue 5's
           # MILP vs fixed, issue 6's table) into one resumable file ($HARNESS_OUT, default 7b-s6-<date>.json).
           HRES=${HARNESS_OUT:-benchmarks/results/7b-s6-$(date +%Y%m%d).json}
           H="python3 -m benchmarks.run --suite 7b --out $HRES --min-start-s 40"
           timeout 130 $PIN $H --systems stock_trainer --caps none --batch-sizes 8,16,32 --budget-s 125 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 200 $PIN $H --systems lazytrain_milp --caps 24 --batch-sizes 8,16,32 --budget-s 195 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 105 $PIN $H --systems lazytrain_fixed --caps 24 --batch-sizes 8 --budget-s 100 2>&1 | grep -v -i warning | grep -v train_runtime
           timeout 140 $PIN $H --systems lazytrain_fixed --caps 80 --batch-sizes 64 --budget-s 135 2>&1 | grep -v -i warning | grep -v train_runtime
           cp "$HRES" "$OUT/" ;;
    harness7b|harness7b-maxbatch)
           export PYTHONPATH=$PWD/.dssite:$PYTHONPATH
           HRES=${HARNESS_OUT:-benchmarks/results/7b-$(date +%Y%m%d).json}
           if [ "$stage" = harness7b ]; then
             HARGS="--systems ${HARNESS_SYSTEMS:-lazytrain_milp,lazytrain_fixed,stock_trainer,stock_trainer_bnb8,fsdp2_cpu_offload,zero_offload} --caps ${HARNESS_CAPS:-24,80}"
           else
             HARGS="--systems ${HARNESS_SYSTEMS:-lazytrain_milp,stock_trainer_bnb8} --caps ${HARNESS_CAPS:-24} --find-max-batch --max-batch-limit 256"
           fi
           # shellcheck disable=SC2086
           timeout 585 python3 -m benchmarks.run --suite 7b $HARGS --budget-s "${HARNESS_BUDGET_S:-540}" \
             --out "$HRES" 2>&1 | grep -v -i warning
           cp "$HRES" "$OUT/" && python3 -m benchmarks.report "$HRES" --md "$OUT/BENCHMARKS.md" \
             --png "$OUT/$(basename "${HRES%.json}").png" ;;
    ddp)   # nvidia-h200-x2 (~7.5 min): data-parallel scaling, 1 GPU vs 2 GPUs on the same host in the same call. A fresh
           # machine grows host memory ~3 s per 8 GiB: a 7B process needs >= 150 s (2 replicas: ~115 GB host).
           # DDP_HALF_THREADS=1 adds 1 GPU with half the cores (what each of 2 ranks gets; +2.5 min).
           export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
           DDP="--system lazytrain_fixed --gpu-cap-gib 24 --rows-per-pass 8 --checkpoint-every 4 --tier gpu $COMMON --steps ${DDP_STEPS:-5}"
           timeout 170 python3 -m benchmarks.bench_executor $DDP --batch-sizes 32 2>&1 | grep -v Warning
           if [ "${DDP_HALF_THREADS:-0}" = 1 ]; then
             LAZYTRAIN_CPU_THREADS=$(( $(nproc) / 2 )) timeout 150 python3 -m benchmarks.bench_executor $DDP \
               --batch-sizes 32 2>&1 | grep -v Warning
           fi
           timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m benchmarks.bench_executor \
             $DDP --batch-sizes 32 2>&1 | grep -v Warning ;;
    ddpshard) # nvidia-h200-x2 (~8.5 min; each run <= 160-190 s): replicated vs sharded optimizer updates (issue 7),
           # MILP plan with GPU-side layer updates, 24 GiB cap, batch 32 per GPU: 1 GPU, then 2 GPUs replicated, then
           # 2 GPUs sharded (lazytrain_config.dp_updates). DDPSHARD_ONE=0 skips the 1-GPU baseline (~2.5 min less).
           export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
           DS="--system lazytrain_milp --gpu-optimizer --gpu-cap-gib 24 --rows-per-pass 8 --batch-sizes 32 $COMMON --steps ${DDP_STEPS:-3}"
           if [ "${DDPSHARD_ONE:-1}" = 1 ]; then
             timeout 160 python3 -m benchmarks.bench_executor $DS 2>&1 | grep -v Warning
           fi
           for mode in replicated sharded; do
             timeout 190 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m benchmarks.bench_executor \
               $DS --dp-updates $mode 2>&1 | grep -v Warning
           done ;;
    ddptests) # nvidia-h200-x2 (~3 min): the GPU tests, including 2 GPUs over NCCL == 1 GPU (replicated and sharded)
           export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
           timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -m gpu tests/streaming tests/hf/test_ddp.py -p no:cacheprovider 2>&1 | tail -6 ;;
    memcal) # 1 GPU (~9.5 min): where the GPU memory goes per step phase (base / forward+backward / optimizer), the
           # MILP plan for 24 GiB run uncapped with no margin (the plan that ran out of memory), then MILP vs fixed
           # with the default 12% margin at 24 GiB and at 80 GiB.
           timeout 90 python3 -m benchmarks.bench_executor --system lazytrain_milp --plan-gpu-gib 24 \
             --gpu-memory-margin 0 --batch-sizes 8 --rows-per-pass 8 $COMMON 2>&1 | grep -v Warning
           timeout 80 python3 -m benchmarks.bench_executor --system lazytrain_fixed --batch-sizes 8 --rows-per-pass 8 \
             --checkpoint-every 4 --tier gpu $COMMON 2>&1 | grep -v Warning
           timeout 200 python3 -m benchmarks.bench_executor --system lazytrain_milp --gpu-cap-gib 24 \
             --batch-sizes 8,16,64 --rows-per-pass 8 $COMMON 2>&1 | grep -v Warning
           timeout 100 python3 -m benchmarks.bench_executor --system lazytrain_milp --gpu-cap-gib 80 \
             --batch-sizes 64 --rows-per-pass 16 $COMMON 2>&1 | grep -v Warning
           timeout 90 python3 -m benchmarks.bench_executor --system lazytrain_fixed --gpu-cap-gib 80 \
             --batch-sizes 64 --rows-per-pass 16 --checkpoint-every 4 --tier gpu $COMMON 2>&1 | grep -v Warning ;;
    milp24|cap80) # 1 GPU (~9 min each): fixed vs MILP vs MILP with GPU-side layer updates, same run, batch 8 and 64
           # (milp24: 24 GiB cap, 8 rows per pass; cap80: 80 GiB, 16 rows per pass)
           if [ "$stage" = milp24 ]; then CAP="--gpu-cap-gib 24 --rows-per-pass 8"; else CAP="--gpu-cap-gib 80 --rows-per-pass 16"; fi
           S="--batch-sizes 8,64 --steps 4 --model qwen2.5-7b --seq-len 1024 --loss-chunk-tokens 2048 --out $RES"
           timeout 180 $PIN python3 -m benchmarks.bench_executor --system lazytrain_fixed --checkpoint-every 4 --tier gpu \
             $CAP $S 2>&1 | grep -v Warning
           timeout 180 $PIN python3 -m benchmarks.bench_executor --system lazytrain_milp $CAP $S 2>&1 | grep -v Warning
           timeout 180 $PIN python3 -m benchmarks.bench_executor --system lazytrain_milp --gpu-optimizer $CAP $S 2>&1 \
             | grep -v Warning ;;
    cap80big) # 1 GPU (~4 min): MILP with GPU-side updates at 80 GiB, batch 96 and 128 (the 450 TFLOPS target)
           timeout 240 $PIN python3 -m benchmarks.bench_executor --system lazytrain_milp --gpu-optimizer --gpu-cap-gib 80 \
             --rows-per-pass 16 --batch-sizes 96,128 --steps 3 --model qwen2.5-7b --seq-len 1024 --loss-chunk-tokens 2048 \
             --out $RES 2>&1 | grep -v Warning ;;
    stock) timeout 110 python3 -m benchmarks.bench_executor --system stock_trainer --batch-sizes 8,16 $COMMON \
             2>&1 | grep -v Warning ;;
  esac
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null | tail -1

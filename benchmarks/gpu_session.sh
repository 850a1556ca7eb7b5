#!/bin/bash
# One device call: the named suites given as arguments, each under its own time limit; results and logs land in
# $OUT (packed into one archive at the end).
# Usage (device tool): HFQ_COMMIT=<sha> bash benchmarks/gpu_session.sh tests qerl
#
#   tests         GPU correctness of the kernel and method test files
#   alltests      the whole suite but the real-model tier (the device has no SmolLM2 checkpoint, no PyPI),
#                 its files dealt over the GPUs (one pytest each), failures listed at the end
#   multi_gpu     2-GPU tests: DDP with INT8 gradients over NCCL, Trainer under accelerate launch, and
#                 tests/test_scaleout.py (DDP on the GPUs, FSDP2 under torchrun)                         (2 GPUs)
#   scaleout      the scaling table: qerl/eco/qft/quest, DDP and FSDP2, world 1 and 2, 32B FSDP2 row (2 GPUs)
#   nvfp4         W4A16 matmul vs BF16 / NF4, NVFP4Linear's per-call overhead at M <= 16 and >= 256, grad-input
#   rollout       rollout throughput table: hfq engine vs generate / continuous batching, 7B-shaped
#   rollout_b8    NVFP4 and NVFP4+LoRA at batch 8, 512 new tokens (rollout_nvfp4_b8.*)
#   qerl          QeRL GRPO step vs BF16 LoRA vs QLoRA, gradient checkpointing (qerl_step_gc.*), batch 2, then 32B
#   qerl_2048     the QeRL paper's completion length, 2048 tokens (qerl_step_new2048_gc.*)
#   qerl_compile  the step with regional torch.compile of the decoder layers, without and with gradient
#                 checkpointing (qerl_step_compile.*, qerl_step_gc_compile.*)
#   kernels       ECO optimizer step, QuEST step + kernels, QFT INT8 kernels
#   qft_memory    QFT paper Table 1: training memory of LLaMA-2-7B-shaped methods, step times
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python -m pip install -q --no-deps .whl/*.whl > "$OUT/pip.log" 2>&1
[ -d .whl_bnb ] && python -m pip install -q --no-deps .whl_bnb/*.whl >> "$OUT/pip.log" 2>&1
# trl + datasets (+ dill, multiprocess, xxhash, pandas): TRL's GRPO tests and its fused LM head in qerl_step
[ -d .whl_trl ] && python -m pip install -q --no-deps .whl_trl/*.whl >> "$OUT/pip.log" 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
PYTEST="python -m pytest -q -p no:cacheprovider"
for part in "$@"; do
  start=$(date +%s)
  case $part in
    tests) timeout 560 $PYTEST tests/test_kernels_nvfp4.py tests/test_eco_kernel.py tests/test_quest.py \
             tests/test_eco.py tests/test_qparam.py tests/test_qft_lion.py tests/test_nvfp4_model.py \
             tests/test_nvfp4_g4.py tests/test_nvfp4_grad.py tests/test_rollout_kernels.py tests/test_rollout.py tests/test_hadamard.py \
             tests/test_kernels_imports.py tests/test_peft_routes.py tests/test_optim_guard.py \
             tests/test_qft_kernels.py tests/test_qft_grads.py tests/test_qft_outliers.py tests/test_qft.py \
             > "$OUT/tests.txt" 2>&1 ;;
    alltests) ngpu=$(nvidia-smi -L | wc -l)  # the files dealt round-robin to one pytest per GPU
              for g in $(seq 0 $((ngpu - 1))); do
                files=$(ls tests/test_*.py | grep -v test_packaging.py | awk -v n="$ngpu" -v g="$g" 'NR % n == g')
                CUDA_VISIBLE_DEVICES=$g timeout -s INT 560 $PYTEST -n $((12 / ngpu > 4 ? 12 / ngpu : 4)) --dist loadfile \
                  -rfE -m "not real_model" $files > "$OUT/alltests_$g.txt" 2>&1 &
              done
              wait ;;
    multi_gpu) timeout 300 $PYTEST tests/test_qft_grads.py -k "two_gpus or ddp or accelerate" > "$OUT/multi_gpu.txt" 2>&1
               timeout 280 $PYTEST tests/test_scaleout.py >> "$OUT/multi_gpu.txt" 2>&1 ;;
    scaleout) timeout 580 python benchmarks/scaleout.py --out "$OUT" > "$OUT/scaleout.txt" 2>&1 ;;
    nvfp4) timeout 400 python benchmarks/nvfp4_matmul.py --out "$OUT" > "$OUT/nvfp4_matmul.txt" 2>&1
           timeout 150 python benchmarks/nvfp4_overhead.py --ms 1,8,16,256,768,2048 --out "$OUT" \
             > "$OUT/nvfp4_overhead.txt" 2>&1
           timeout 120 python benchmarks/nvfp4_grad_input.py --out "$OUT" > "$OUT/nvfp4_grad_input.txt" 2>&1 ;;
    rollout) timeout 580 python benchmarks/rollout.py --out "$OUT" > "$OUT/rollout.txt" 2>&1 ;;
    rollout_b8) timeout 400 python benchmarks/rollout.py --what nvfp4,nvfp4+lora --batches 8 --new-tokens 512 \
                  --budget-s 360 --name rollout_nvfp4_b8 --out "$OUT" > "$OUT/rollout_b8.txt" 2>&1 ;;
    qerl) timeout 220 python benchmarks/qerl_step.py --methods qerl,bf16_lora,qlora --grad-ckpt --out "$OUT" \
            > "$OUT/qerl.txt" 2>&1
          timeout 150 python benchmarks/qerl_step.py --methods qerl,bf16_lora --batch 2 --grad-ckpt --out "$OUT" \
            >> "$OUT/qerl.txt" 2>&1
          timeout 360 python benchmarks/qerl_step.py --methods qerl_32b --grad-ckpt --out "$OUT" > "$OUT/qerl32.txt" 2>&1 ;;
    qerl_2048) timeout 480 python benchmarks/qerl_step.py --methods qerl,bf16_lora --new 2048 --grad-ckpt --out "$OUT" \
                 > "$OUT/qerl_2048.txt" 2>&1 ;;
    qerl_compile) timeout 280 python benchmarks/qerl_step.py --methods qerl,bf16_lora --compile --rounds 4 --out "$OUT" \
                    > "$OUT/qerl_compile.txt" 2>&1
                  timeout 280 python benchmarks/qerl_step.py --methods qerl,bf16_lora --compile --grad-ckpt --rounds 4 \
                    --out "$OUT" >> "$OUT/qerl_compile.txt" 2>&1 ;;
    kernels) timeout 150 python benchmarks/eco.py --out "$OUT" > "$OUT/eco.txt" 2>&1
             timeout 110 python benchmarks/quest_step.py --out "$OUT" > "$OUT/quest.txt" 2>&1
             timeout 200 python benchmarks/qft_kernels.py --out "$OUT" > "$OUT/qft_kernels.txt" 2>&1 ;;
    qft_memory) timeout 540 python benchmarks/qft_memory.py --out "$OUT" > "$OUT/qft_memory.txt" 2>&1 ;;
    *) echo "unknown suite $part (see the list at the top of benchmarks/gpu_session.sh)" ;;
  esac
  echo "$part rc=$? $(( $(date +%s) - start ))s" | tee -a "$OUT/parts.txt"
done
tail -3 "$OUT"/tests.txt "$OUT"/alltests_*.txt 2>/dev/null
grep -h "^FAILED\|^ERROR" "$OUT"/alltests_*.txt 2>/dev/null
# the device returns at most 8 files: pack everything into one archive
cd "$OUT" && tar czf /tmp/gpu_session.tgz . && find . -mindepth 1 -delete && mv /tmp/gpu_session.tgz .

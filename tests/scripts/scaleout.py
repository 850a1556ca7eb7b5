"""Worker for tests/test_scaleout.py: train tiny models of each hfq method on several processes and save what the
test compares. DDP: under `accelerate launch --config_file examples/accelerate/ddp.yaml` (or one plain process).
FSDP2: under `torchrun` with SCALEOUT_FSDP2=1, accelerate's Accelerator with examples/accelerate/fsdp2.yaml's plugin
(`fsdp2_accelerator`); gloo on CPU, or NCCL with one GPU per process when SCALEOUT_DEVICE=cuda.

python scaleout.py OUT TINY_DIR METHODS [RESUME_FROM_WORLD]
  METHODS: comma-separated, of quest, nvfp4_lora, eco, qft, eco_bf16, eco_bf16_fused, qft_bf16 (ECO / QFT on a bf16
  model, SR keyed by element: what FSDP2 shards, FSDP2 needing one dtype per layer; eco_bf16_fused: ECO's Triton
  step, interpreted on CPU; QLion's, interpreted, would take minutes here: its sharded route runs on the GPUs)
  and qerl (only builds QeRLGRPOTrainer).
  For each method: STEPS optimizer steps on a fixed global batch split over the ranks (eco_bf16 / qft_bf16: two
  micro-steps of gradient accumulation and clip_grad_norm_ per step, the norms saved too). The mean loss over ranks per
  step, every parameter and buffer (full, gathered under FSDP2) and what was sharded go to
  OUT/<method>_w<world>_rank<r>.pt; a full checkpoint after SAVE_AT steps (model + optimizer, saved by rank 0) to
  OUT/<method>_w<world>.ckpt. With RESUME_FROM_WORLD: start from OUT/<method>_w<RESUME_FROM_WORLD>.ckpt and run the
  remaining steps, results in OUT/<method>_w<world>_from<RESUME_FROM_WORLD>_rank<r>.pt. eco_bf16 / qft_bf16 also
  save the final logits on a fixed batch, and (uninterrupted runs) a save_pretrained checkpoint of the trained model
  to OUT/<method>_w<world>_pretrained.
"""
import os
import sys

import torch

STEPS, SAVE_AT, GLOBAL_BATCH, SEQ = 4, 2, 8, 16
BF16 = ("eco_bf16", "eco_bf16_fused", "qft_bf16")
CLIP = 0.5  # max_grad_norm of the eco_bf16 / qft_bf16 runs (their gradient norms are ~1.3: clipping acts)


def build(method, tiny_dir):
    """(model, function model -> optimizer) for a method: QuEST QAT + AdamW, NVFP4 base + LoRA + AdamW,
    ECO (fp8 QParams + ECOAdamW), QFT (INT8 dense+sparse QParams with INT8 gradients + QLion)."""
    from hfq.tiny import tiny_model

    torch.manual_seed(0)
    if method == "quest":
        from hfq.quest import QuESTConfig, quantize_model

        model = quantize_model(tiny_model("llama", seed=0, hidden=64, intermediate=128, kv_heads=4).train(),
                               QuESTConfig(weight_bits=4, activation_bits=4))
        return model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)
    if method == "nvfp4_lora":
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM

        from hfq.nvfp4 import NVFP4Config, get_peft_model

        base = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=NVFP4Config(), dtype=torch.float32)
        torch.manual_seed(0)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                task_type="CAUSAL_LM")).train()
        for n, p in model.named_parameters():  # LoRA B starts at zero; random B makes the loss depend on A too
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
        return model, lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    from hfq.eco import ECOAdamW
    from hfq.qft import QFTConfig, QLion, quantize_model_

    if method in BF16:
        model = tiny_model("llama", seed=0, hidden=64, intermediate=128, kv_heads=4, dtype=torch.bfloat16).train()
        if method in ("eco_bf16", "eco_bf16_fused"):  # fused: the Triton step (interpreted on CPU)
            quantize_model_(model, QFTConfig(weight_format="fp8_e4m3_row"))
            fused = True if method == "eco_bf16_fused" else None
            return model, lambda m: ECOAdamW(m.parameters(), lr=1e-2, rounding="sr", seed=3, keyed_sr=True,
                                             fused=fused)
        quantize_model_(model, QFTConfig(weight_format="int8_dense_sparse", gradient_bits=8))
        return model, lambda m: QLion(m.parameters(), lr=1e-3, seed=3, keyed_sr=True)
    model = tiny_model("llama", seed=0, hidden=64, intermediate=128, kv_heads=4).train()
    if method == "eco":
        quantize_model_(model, QFTConfig(weight_format="fp8_e4m3_row"))
        return model, lambda m: ECOAdamW(m.parameters(), lr=1e-2, rounding="sr", seed=3)
    if method == "qft":
        quantize_model_(model, QFTConfig(weight_format="int8_dense_sparse", gradient_bits=8))
        return model, lambda m: QLion(m.parameters(), lr=1e-3, seed=3)
    raise ValueError(method)


def batch(step, rank, world):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(4, 90, (GLOBAL_BATCH, SEQ), generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n]


def snapshot(model):
    """name -> full plain tensor of every parameter and buffer (QParam: its stored tensors; DTensor: gathered)."""
    from hfq.qparam import QParam
    from hfq.qparam.fsdp import gather_whole, local

    out = {}
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        t = t.detach()
        if isinstance(local(t), QParam) and local(t) is not t:
            t = gather_whole(t)
        elif hasattr(t, "full_tensor"):
            t = t.full_tensor()
        if isinstance(t, QParam):
            for k, v in t.qtensors().items():
                out[f"{n}.{k}"] = (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v).cpu().clone()
        else:
            out[n] = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).cpu().clone()
    return out


def full_state(acc, model, opt):
    """Full (unsharded) model + optimizer state, as any world size can load it; {} on ranks other than 0.
    hfq's optimizers (replicated state under DDP) save their own state_dict; torch optimizers go through
    torch.distributed.checkpoint's full state dicts (keyed by parameter name), which FSDP2 and one process share."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if getattr(opt, "optimizer", opt).__class__.__module__.startswith("hfq"):  # collectives under FSDP2: all ranks
        from hfq.qparam.fsdp import whole_state_dict

        state = {"model": whole_state_dict(acc.unwrap_model(model)), "optim": opt.state_dict(), "dcp": False}
        return state if acc.is_main_process else {}
    msd, osd = get_state_dict(acc.unwrap_model(model), getattr(opt, "optimizer", opt),
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd, "dcp": True} if acc.is_main_process else {}


def load_full_state(acc, model, opt, ckpt):
    """Load a checkpoint of full_state (written by any world size) into this run's model and optimizer."""
    if ckpt["dcp"]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(acc.unwrap_model(model), getattr(opt, "optimizer", opt), model_state_dict=ckpt["model"],
                       optim_state_dict=ckpt["optim"], options=StateDictOptions(full_state_dict=True))
        return
    from hfq.qparam.fsdp import load_whole_state_dict_

    load_whole_state_dict_(acc.unwrap_model(model), ckpt["model"])  # one process: a plain load_state_dict
    opt.load_state_dict(ckpt["optim"])


def save_dcp(model, opt, path):
    """A torch.distributed.checkpoint checkpoint (sharded state dicts, what accelerate writes for FSDP2 with
    fsdp_state_dict_type SHARDED_STATE_DICT): every rank writes its part."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def load_dcp(model, opt, path):
    """Load a save_dcp checkpoint (written by any world size) into this run's model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def layout(model):
    """What FSDP2 sharded: (names of DTensor parameters with their local numel, names of DTensor buffers,
    numel of every parameter)."""
    from torch.distributed.tensor import DTensor

    sharded = {n: p.to_local().numel() for n, p in model.named_parameters() if isinstance(p, DTensor)}
    bufs = [n for n, b in model.named_buffers() if isinstance(b, DTensor)]
    return sharded, bufs, {n: p.numel() for n, p in model.named_parameters()}


def qerl_trainer(acc, tiny_dir, out):
    """QeRLGRPOTrainer on the (sharded, under FSDP2) NVFP4 + LoRA policy: refused at construction under FSDP."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from hfq.qerl import QeRLConfig, QeRLGRPOTrainer

    model, _ = build("nvfp4_lora", tiny_dir)
    if acc.is_fsdp2:  # accelerate's FSDP2 prepare takes a model only together with its optimizer
        model, _ = acc.prepare(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0))
    args = QeRLConfig(output_dir=f"{out}/qerl", num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=4, max_steps=1, report_to="none", use_cpu=True, bf16=False)
    QeRLGRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                    train_dataset=Dataset.from_list([{"prompt": "1+1=", "answer": "2"}] * 4),
                    processing_class=AutoTokenizer.from_pretrained(tiny_dir))
    with open(os.path.join(out, f"qerl_constructed_rank{acc.process_index}"), "w"):
        pass


def run(acc, method, tiny_dir, out, resume):
    import torch.distributed as dist

    world, rank = acc.num_processes, acc.process_index
    model, make_opt = build(method, tiny_dir)
    if acc.is_fsdp2:  # the plugin keeps the decoder layer class of the first model it wrapped
        acc.state.fsdp_plugin = fsdp2_plugin()
    model, opt = acc.prepare(model, make_opt(model))  # as Trainer does (under FSDP2 too)
    first = 0
    if resume is not None and resume.startswith("dcp"):
        load_dcp(model, opt, os.path.join(out, f"{method}_w{resume[3:]}.dcp"))
        first = SAVE_AT
    elif resume is not None:
        ckpt = torch.load(os.path.join(out, f"{method}_w{resume}.ckpt"), weights_only=False, map_location="cpu")
        load_full_state(acc, model, opt, ckpt)
        first = SAVE_AT
    losses = []
    norms = []
    for step in range(first, STEPS):
        x = batch(step, rank, world).to(acc.device)
        if method in BF16:  # two micro-steps (gradient accumulation), then clipping, as Trainer does
            loss = 0
            for part in x.chunk(2):
                micro = model(input_ids=part, labels=part).loss / 2
                acc.backward(micro)
                loss = loss + micro.detach()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        else:
            loss = model(input_ids=x, labels=x).loss
            acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(float(mean))
        if step + 1 == SAVE_AT and resume is None:
            if method in BF16:
                save_dcp(model, opt, os.path.join(out, f"{method}_w{world}.dcp"))
            state = full_state(acc, model, opt)
            if acc.is_main_process:
                torch.save(state, os.path.join(out, f"{method}_w{world}.ckpt"))
    sharded, sharded_bufs, numel = layout(model)
    snap = snapshot(acc.unwrap_model(model))
    tag = f"{method}_w{world}" + (f"_from{resume}" if resume is not None else "")
    extra = {}
    if method in BF16:
        extra = final_logits_and_storage(acc, method, model, out, tag, pretrained=resume is None)
    torch.save({"losses": losses, "norms": norms, "snap": snap, "world": world, "wrapper": type(model).__name__,
                "strategy": "FSDP2" if acc.is_fsdp2 else str(acc.distributed_type),
                "sharded": sharded, "sharded_buffers": sharded_bufs, "numel": numel, **extra},
               os.path.join(out, f"{tag}_rank{rank}.pt"))
    acc.wait_for_everyone()


def final_logits_and_storage(acc, method, model, out, tag, pretrained):
    """Logits of the trained model on a fixed batch (every rank the same batch), bytes of the QParams this rank
    stores (local shards under FSDP2), and with `pretrained` a save_pretrained checkpoint of the whole model
    (FSDP2: save_pretrained_whole, the state dict gathered on every rank and written by rank 0)."""
    from hfq.qparam import QParam
    from hfq.qparam.fsdp import local

    x = batch(99, 0, 1)
    with torch.no_grad():
        logits = model(input_ids=x.to(acc.device)).logits.float().cpu()
    m = acc.unwrap_model(model)
    stored = sum(local(p).storage_bytes for p in m.parameters() if isinstance(local(p), QParam))
    if pretrained:
        from torch.distributed.tensor import DTensor

        from hfq.qparam.fsdp import save_pretrained_whole, whole_state_dict

        if any(isinstance(p, DTensor) for p in m.parameters()):
            save_pretrained_whole(m, os.path.join(out, f"{tag}_pretrained"))  # every rank gathers, rank 0 writes
        else:
            sd = whole_state_dict(m)
            if acc.is_main_process:
                whole, _ = build(method, None)
                whole.load_state_dict(sd)
                whole.save_pretrained(os.path.join(out, f"{tag}_pretrained"))
            acc.wait_for_everyone()
    return {"logits": logits, "qparam_bytes": stored, "probe": x}


def fsdp2_plugin():
    """accelerate's FSDP2 plugin with examples/accelerate/fsdp2.yaml's settings."""
    import yaml
    from accelerate.utils import FullyShardedDataParallelPlugin

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "examples", "accelerate", "fsdp2.yaml")) as f:
        cfg = yaml.safe_load(f)["fsdp_config"]
    return FullyShardedDataParallelPlugin(
        fsdp_version=cfg["fsdp_version"], auto_wrap_policy=cfg["fsdp_auto_wrap_policy"].lower(),
        reshard_after_forward=cfg["fsdp_reshard_after_forward"], state_dict_type=cfg["fsdp_state_dict_type"],
        cpu_ram_efficient_loading=cfg["fsdp_cpu_ram_efficient_loading"], cpu_offload=cfg["fsdp_offload_params"])


def fsdp2_accelerator():
    """accelerate's Accelerator with the FSDP2 plugin (one process per device, under torchrun). On GPUs
    (SCALEOUT_DEVICE=cuda, NCCL) as `accelerate launch` builds it. accelerate runs FSDP on GPUs only, so on CPU
    (gloo) its state is switched to FSDP after construction: model and optimizer then take accelerate's own FSDP2
    route (fsdp2_prepare_model, then the optimizer's parameters swapped for the sharded ones), as Trainer does."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if os.environ.get("SCALEOUT_DEVICE") == "cuda":
        return Accelerator(fsdp_plugin=fsdp2_plugin())
    acc = Accelerator(cpu=True)
    acc.state.fsdp_plugin = fsdp2_plugin()
    # both singletons: each AcceleratorState() call copies PartialState's fields over its own
    PartialState().distributed_type = acc.state.distributed_type = DistributedType.FSDP
    return acc


def main(out, tiny_dir, methods, resume=None):
    torch.set_num_threads(1)
    if os.environ.get("SCALEOUT_FSDP2") == "1":
        acc = fsdp2_accelerator()
    else:
        from accelerate import Accelerator

        acc = Accelerator(cpu=not torch.cuda.is_available())
    for method in methods.split(","):
        if method == "qerl":
            qerl_trainer(acc, tiny_dir, out)
            continue
        run(acc, method, tiny_dir, out, resume)


if __name__ == "__main__":
    main(*sys.argv[1:])

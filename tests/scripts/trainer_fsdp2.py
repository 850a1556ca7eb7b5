"""Worker for tests/test_scaleout_gpu.py: transformers.Trainer on an ECO or QFT model under
`accelerate launch --config_file examples/accelerate/fsdp2.yaml` (FSDP2, one GPU per process), the optimizer given
as `optimizer_cls_and_kwargs` (Trainer refuses `optimizers=` under FSDP).

python trainer_fsdp2.py OUT METHOD [RESUME_CHECKPOINT]
  METHOD: eco_bf16 | qft_bf16 (tests/scripts/scaleout.py's build). STEPS optimizer steps on a fixed dataset with a
  global batch of GLOBAL_BATCH sequences (per device: GLOBAL_BATCH / world), a checkpoint every SAVE_AT steps in
  OUT/<METHOD>_w<world>/. With RESUME_CHECKPOINT: resume from it. Rank 0 writes the logged losses and the final
  logits on a fixed batch to OUT/<METHOD>_w<world>[_resumed].pt, and trainer.save_model() writes
  OUT/<METHOD>_w<world>[_resumed]_final (nothing under SHARDED_STATE_DICT: transformers' rule).
  TRAINER_FSDP2_CPU=<state dict type> in the environment: CPU processes under torchrun (gloo), the Trainer's
  accelerator switched to FSDP2 right after it is built (accelerate runs FSDP on GPUs only), as
  tests/scripts/scaleout.py does for a bare Accelerator.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scaleout import batch, build  # noqa: E402

STEPS, SAVE_AT, GLOBAL_BATCH, SEQ = 4, 2, 8, 16


def main(out, method, resume=None):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    model, make_opt = build(method, None)
    probe = make_opt(torch.nn.Linear(2, 2))  # the optimizer's class and keyword arguments, as build chose them
    kwargs = {k: v for k, v in probe.defaults.items() if k in ("lr", "betas", "weight_decay")}
    kwargs.update(seed=probe._seed, keyed_sr=True, rounding=probe.rounding)
    rows = torch.cat([batch(s, 0, 1) for s in range(STEPS)])
    ds = Dataset.from_dict({"input_ids": rows.tolist(), "labels": rows.tolist()})
    cpu_sdt = os.environ.get("TRAINER_FSDP2_CPU")
    fsdp = {} if not cpu_sdt else dict(fsdp="full_shard auto_wrap", fsdp_config={
        "version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "state_dict_type": cpu_sdt,
        "reshard_after_forward": True, "cpu_ram_efficient_loading": False,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    args = TrainingArguments(output_dir=os.path.join(out, f"{method}_w{world}"), max_steps=STEPS, save_steps=SAVE_AT,
                             save_strategy="steps", per_device_train_batch_size=GLOBAL_BATCH // world,
                             logging_steps=1, report_to="none",
                             use_cpu=not torch.cuda.is_available(), seed=0, data_seed=0, max_grad_norm=1.0,
                             dataloader_drop_last=True, **fsdp)

    class FsdpOnCpu(Trainer):
        def create_accelerator_and_postprocess(self):
            from accelerate.state import PartialState
            from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

            super().create_accelerator_and_postprocess()
            self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            PartialState().distributed_type = self.accelerator.state.distributed_type = DistributedType.FSDP
            self.is_fsdp_enabled = True

    cls = FsdpOnCpu if cpu_sdt else Trainer
    trainer = cls(model=model, args=args, train_dataset=ds, optimizer_cls_and_kwargs=(type(probe), kwargs))
    trainer.train(resume_from_checkpoint=resume)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch(99, 0, 1).to(trainer.args.device)).logits.float().cpu()
    trainer.save_model(os.path.join(out, f"{method}_w{world}{'_resumed' if resume else ''}_final"))
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        torch.save({"losses": losses, "logits": logits, "world": world, "device": trainer.args.device.type,
                    "fsdp": trainer.is_fsdp_enabled},
                   os.path.join(out, f"{method}_w{world}{'_resumed' if resume else ''}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])

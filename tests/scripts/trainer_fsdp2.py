"""Worker for tests/test_scaleout_gpu.py: transformers.Trainer on an ECO or QFT model under
`accelerate launch --config_file examples/accelerate/fsdp2.yaml` (FSDP2, one GPU per process), the optimizer given
as `optimizer_cls_and_kwargs` (Trainer refuses `optimizers=` under FSDP).

python trainer_fsdp2.py OUT METHOD [RESUME_CHECKPOINT]
  METHOD: eco_bf16 | qft_bf16 (tests/scripts/scaleout.py's build). STEPS optimizer steps on a fixed dataset with a
  global batch of GLOBAL_BATCH sequences (per device: GLOBAL_BATCH / world), a checkpoint every SAVE_AT steps in
  OUT/<METHOD>_w<world>/. With RESUME_CHECKPOINT: resume from it. Rank 0 writes the logged losses and the final
  logits on a fixed batch to OUT/<METHOD>_w<world>[_resumed].pt.
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
    args = TrainingArguments(output_dir=os.path.join(out, f"{method}_w{world}"), max_steps=STEPS, save_steps=SAVE_AT,
                             save_strategy="steps", per_device_train_batch_size=GLOBAL_BATCH // world,
                             logging_steps=1, report_to="none",
                             use_cpu=not torch.cuda.is_available(), seed=0, data_seed=0, max_grad_norm=1.0,
                             dataloader_drop_last=True)
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizer_cls_and_kwargs=(type(probe), kwargs))
    trainer.train(resume_from_checkpoint=resume)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch(99, 0, 1).to(trainer.args.device)).logits.float().cpu()
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        torch.save({"losses": losses, "logits": logits, "world": world, "device": trainer.args.device.type,
                    "fsdp": trainer.is_fsdp_enabled},
                   os.path.join(out, f"{method}_w{world}{'_resumed' if resume else ''}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])

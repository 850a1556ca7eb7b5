"""ECO: optimizers that train quantized weights (hfq.qparam.QParam) without master weights (they live in hfq.optim).

Use with transformers' Trainer, either way:
  Trainer(..., optimizers=(ECOAdamW(model.parameters(), lr=...), scheduler))
  Trainer(..., optimizer_cls_and_kwargs=hfq.eco.optimizer_cls_and_kwargs(args, rounding="sr"))
The second lets Trainer build the optimizer and scheduler from TrainingArguments (lr, betas, eps, weight decay
groups, lr_scheduler_type, warm-up; ECO options also from `args.optim_args`).

Selecting ECO by *name* (`TrainingArguments(optim="eco_adamw")`) is not possible without patching transformers
(checked on 5.17): `optim` is converted to the closed enum `OptimizerNames` in `TrainingArguments.__post_init__`
(unknown names raise ValueError), and the name -> optimizer table `transformers.trainer_optimizer._OPTIMIZER_HANDLERS`
is private, with no registration function. `optim_target_modules` only feeds GaLore/APOLLO. The public extension
points are `Trainer(optimizer_cls_and_kwargs=...)`, `Trainer(optimizers=...)` and overriding
`Trainer.create_optimizer`; hfq uses the first and patches nothing.

Distributed: DDP (and `accelerate launch`) all-reduce the bf16 gradients of QParams like any others; every rank then
takes the same ECO step (SR draws from the optimizer's own seeded generator), so ranks stay bit-identical
(tests/test_eco_ddp.py). Ranks must start from the same codes (same checkpoint or seed), or call
`hfq.qparam.broadcast_qparams_(model)` before wrapping. FSDP2 (`fully_shard`, bf16 models): each QParam is sharded
by rows and the optimizers step on the local shards, SR keyed by (seed, parameter, step, global element) so any
sharding draws the same (examples/accelerate/README.md).
"""
from hfq_kernels.reference.eco import RULES, eco_adamw_, eco_sgdm_
from ..optim import ECOAdamW, ECOSGD, optimizer_cls_and_kwargs

__all__ = ["ECOAdamW", "ECOSGD", "RULES", "eco_adamw_", "eco_sgdm_", "optimizer_cls_and_kwargs"]

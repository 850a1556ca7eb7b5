"""`OutlierRefreshPerEpoch`: the paper's outlier schedule (QFT App. C, once per epoch) for transformers' Trainer."""
from __future__ import annotations

from transformers import TrainerCallback

from ..optim.base import QParamOptimizer


class OutlierRefreshPerEpoch(TrainerCallback):
    """Re-select the outliers of every int8_dense_sparse weight once per epoch, on the optimizer step that ends it
    (the next epoch starts with fresh thresholds), as the paper does (App. C).

    At train begin it sets the optimizer's `refresh_thresholds_every` to Trainer's optimizer steps per epoch
    (ceil(batches / gradient_accumulation_steps)), which overrides QFTConfig.outlier_refresh_steps; the refresh
    itself runs inside the optimizer's step, counted by its checkpointed step, so a resumed run refreshes on the
    same steps. Needs an hfq optimizer (QLion, ECOAdamW, ECOSGD) and a training dataloader with a length."""

    def on_train_begin(self, args, state, control, optimizer=None, train_dataloader=None, **kwargs):
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        if not isinstance(opt, QParamOptimizer):
            raise TypeError(f"OutlierRefreshPerEpoch: the optimizer must be an hfq optimizer (QLion, ECOAdamW, "
                            f"ECOSGD), got {type(opt).__name__}")
        try:
            batches = len(train_dataloader)
        except TypeError:
            raise ValueError("OutlierRefreshPerEpoch: the training dataloader has no length, so an epoch has no "
                             "step count; set QFTConfig.outlier_refresh_steps instead") from None
        accum = args.gradient_accumulation_steps
        opt.refresh_thresholds_every = max(-(-batches // accum), 1)
        return control

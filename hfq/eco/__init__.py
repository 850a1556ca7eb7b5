"""ECO: optimizers that train quantized weights (hfq.qparam.QParam) without master weights."""
from .functional import RULES, eco_adamw_, eco_sgdm_
from .optim import ECOAdamW, ECOSGD

__all__ = ["ECOAdamW", "ECOSGD", "RULES", "eco_adamw_", "eco_sgdm_"]

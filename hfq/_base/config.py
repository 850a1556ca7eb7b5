"""The config base of hfq's quantization methods: a dataclass validated at construction (torchao-style).

Each method's config is a `@dataclass` subclass of `HfqConfig` that sets `QUANT_METHOD` and checks its own
fields in `validate()`; the base checks `quant_method` and `modules_to_not_convert` and serialises the fields
as they are (`to_dict` is what config.json stores, `from_dict` rebuilds and re-validates it).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

from transformers.utils.quantization_config import QuantizationConfigMixin


def check_choice(field: str, value, allowed) -> None:
    """`value` must be one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{field}: {value!r} is not supported; allowed {tuple(allowed)}")


def check_bool(field: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{field}: must be True or False, got {value!r}")


def check_positive(field: str, value, allow_none: bool = False) -> None:
    """A positive real number (or None when allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{field}: must be a positive number{' or None' if allow_none else ''}, got {value!r}")


def check_module_names(field: str, value) -> list[str] | None:
    """None or a list of module names/patterns (a bare string is refused: it is one name, not a list)."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(m, str) for m in value):
        raise ValueError(f"{field}: expected a list of module names (str) or None, got {value!r}")
    return list(value)


@dataclass
class HfqConfig(QuantizationConfigMixin):
    """Base of NVFP4Config, QuESTConfig and QFTConfig.

    Subclasses declare `modules_to_not_convert` and `quant_method` fields. `modules_to_not_convert` entries
    follow transformers' own rule for that option (hfq._base.surgery.should_convert): a module is kept in
    high precision when an entry (a regular expression) matches the start of its full name or the name ends
    with it, so "lm_head" keeps `lm_head` and "model.layers.0" keeps that whole block.
    """

    QUANT_METHOD: ClassVar[str] = ""
    # None = transformers' defaults (the output embedding and tied modules) are added to the list
    ADD_DEFAULT_SKIPS: ClassVar[bool] = False

    def __post_init__(self):
        if self.quant_method != self.QUANT_METHOD:
            raise ValueError(f"quant_method: expected {self.QUANT_METHOD!r}, got {self.quant_method!r}")
        self.modules_to_not_convert = check_module_names("modules_to_not_convert", self.modules_to_not_convert)
        self.validate()

    def validate(self) -> None:
        """Check the method's own fields; raise ValueError naming the field and what is allowed."""

    def to_dict(self) -> dict:
        return asdict(self)

    def to_diff_dict(self) -> dict:
        return self.to_dict()

    @property
    def is_trainable(self) -> bool:
        return True

"""The config base of hfq's quantization methods: a dataclass validated at construction (torchao-style).

Each method's config is a `@dataclass` subclass of `HfqConfig` that sets `QUANT_METHOD` and checks its own
fields in `validate()`; the base checks `quant_method` and `modules_to_not_convert` and serialises the fields
as they are (`to_dict` is what config.json stores, `from_dict` rebuilds and re-validates it).
"""
from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import asdict, dataclass, fields
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


def warn_unused(field: str, value, why: str) -> None:
    """A field set to something that the rest of the config makes irrelevant: say so instead of ignoring it. Called
    from a config's validate(); the warning names the line that built the config (validate <- __post_init__ <- the
    dataclass __init__ <- the caller)."""
    warnings.warn(f"{field}={value!r} has no effect: {why}", UserWarning, stacklevel=5)


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

    Subclasses declare `modules_to_not_convert`, `strict` and `quant_method` fields. `strict`: a linear layer the
    method cannot convert (other than by `modules_to_not_convert`) is an error instead of a warning.
    `modules_to_not_convert` entries follow transformers' own rule for that option (hfq._base.surgery.should_convert): a module is kept in
    high precision when an entry (a regular expression) matches the start of its full name or the name ends
    with it, so "lm_head" keeps `lm_head` and "model.layers.0" keeps that whole block.
    """

    QUANT_METHOD: ClassVar[str] = ""
    # None = transformers' defaults (the output embedding and tied modules) are added to the list
    ADD_DEFAULT_SKIPS: ClassVar[bool] = False
    BY_METHOD: ClassVar[dict[str, type]] = {}  # quant_method -> config class, filled as each method is imported
    # fields that a reload of a saved checkpoint takes from the config passed to from_pretrained (how the model runs
    # or trains, not what the checkpoint stores); transformers keeps the checkpoint's config for the rest
    RELOAD_OPTIONS: ClassVar[tuple[str, ...]] = ()
    _NOT_COMPARED: ClassVar[tuple[str, ...]] = ("quant_method", "strict")  # conversion-time only

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.QUANT_METHOD:
            HfqConfig.BY_METHOD[cls.QUANT_METHOD] = cls

    def __post_init__(self):
        if self.quant_method != self.QUANT_METHOD:
            raise ValueError(f"quant_method: expected {self.QUANT_METHOD!r}, got {self.quant_method!r}")
        self.modules_to_not_convert = check_module_names("modules_to_not_convert", self.modules_to_not_convert)
        check_bool("strict", self.strict)
        self.validate()

    def validate(self) -> None:
        """Check the method's own fields; raise ValueError naming the field and what is allowed."""

    def checked_copy(self) -> "HfqConfig":
        """A copy, validated again, for one model to keep: fields assigned after construction (which skip
        __post_init__) are checked here, and later edits of this object cannot reach a model built with it."""
        c = copy.deepcopy(self)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the no-effect warnings were given when this object was built
            HfqConfig.__post_init__(c)
        return c

    def to_dict(self) -> dict:
        return asdict(self)

    def get_loading_attributes(self) -> dict:
        """What transformers copies onto a saved checkpoint's config when this config is passed to from_pretrained:
        the RELOAD_OPTIONS, and this whole request as `hfq_requested`, which the quantizer holds against the
        checkpoint's config (reload_conflicts)."""
        return {**{k: getattr(self, k) for k in self.RELOAD_OPTIONS}, "hfq_requested": self.to_dict()}

    def reload_differences(self, requested: dict) -> tuple[list[str], list[str]]:
        """(conflicts, kept): the fields other than RELOAD_OPTIONS where a config passed to from_pretrained differs
        from this (the checkpoint's) config, which a reload cannot take (the checkpoint stores what they decided).
        Conflicts: set away from the class default (an error names them); kept: left at the default (the
        checkpoint's value is kept, with a warning naming it)."""
        default = asdict(type(self)())
        skip = set(self.RELOAD_OPTIONS) | set(self._NOT_COMPARED)
        conflicts, kept = [], []
        for f in fields(self):
            if f.name in skip or f.name not in requested or requested[f.name] == getattr(self, f.name):
                continue
            if requested[f.name] != default[f.name]:
                conflicts.append(f"{f.name}={requested[f.name]!r} (the checkpoint has {getattr(self, f.name)!r})")
            else:
                kept.append(f"{f.name}={getattr(self, f.name)!r}")
        return conflicts, kept

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        """Rebuild from a config.json `quantization_config`. Fields this method does not have are a ValueError
        naming them and the hfq method they belong to (a config whose quant_method was changed by hand)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config_dict) - known)
        if unknown:
            owners = sorted(m for m, c in HfqConfig.BY_METHOD.items()
                            if c is not cls and set(unknown) <= {f.name for f in fields(c)})
            held = f"; they are fields of {' / '.join(owners)}, so it was written by that method" if owners else ""
            raise ValueError(f"quantization_config says quant_method {cls.QUANT_METHOD!r} but has fields {unknown} "
                             f"that {cls.QUANT_METHOD} does not know{held}. Allowed: {sorted(known)}")
        return super().from_dict(config_dict, return_unused_kwargs, **kwargs)

    def to_diff_dict(self) -> dict:
        return self.to_dict()

    @property
    def is_trainable(self) -> bool:
        return True


def refusing_other_methods_of_one_name(merge):
    """Wrap transformers' AutoHfQuantizer.merge_quantization_configs (a bound classmethod). transformers refuses a
    quantization_config of another class than the checkpoint's, comparing class names; hfq's NVFP4Config and
    transformers' own share a name, so a checkpoint of one method loaded with the other's config loaded with the
    checkpoint's method and a generic warning. Refused as other classes are."""

    @functools.wraps(getattr(merge, "__func__", merge))
    def wrapper(cls, quantization_config, quantization_config_from_args, *args, **kwargs):
        if quantization_config_from_args is not None:
            saved = (quantization_config.get("quant_method") if isinstance(quantization_config, dict)
                     else getattr(quantization_config, "quant_method", None))
            passed = quantization_config_from_args
            asked = passed.get("quant_method") if isinstance(passed, dict) else getattr(passed, "quant_method", None)
            saved, asked = (str(getattr(m, "value", m)) for m in (saved, asked))
            if saved != asked and "hfq_" in saved + asked:
                kind = type(passed)
                name = kind.__name__
                import transformers

                import hfq

                theirs, ours = getattr(transformers, name, None), getattr(hfq, name, None)
                clash = (f"; transformers and hfq both have a class named {name}, and this is transformers'"
                         if kind is theirs and ours is not None and theirs is not ours else "")
                raise ValueError(
                    f"The model is quantized with quant_method {saved!r} but the quantization_config passed to "
                    f"from_pretrained is {kind.__module__}.{name} (quant_method {asked!r}){clash}. Load the "
                    "checkpoint without quantization_config (its own method is used), or pass that method's config")
        return merge(quantization_config, quantization_config_from_args, *args, **kwargs)

    wrapper.hfq_wrapped = merge
    return wrapper


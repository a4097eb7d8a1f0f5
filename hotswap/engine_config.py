"""The engine's resolved configuration (frozen, validated): what `EngineArgs` resolves into.

`EngineConfig`'s fields are generated from the `EngineArgs` rows marked `engine`
(hotswap/args.py): the same names, defaults, choices and bounds, checked by the same `check`.
Two of them are resolved values here (`RESOLVED`): `EngineArgs` leaves `num_pages` and
`max_model_len` to be sized from the model and the devices (`EngineConfig.of`); their defaults
here serve tests and tools that build an engine directly.
"""

from __future__ import annotations

import dataclasses
import math

from hotswap.args import EngineArgs, check, parsed
from hotswap.errors import ConfigError

__all__ = ["RESOLVED", "EngineConfig", "check_pages_fit", "default_dtype"]

RESOLVED = {"num_pages": 512, "max_model_len": 1024}  # name -> default where it is no longer None


def default_dtype(platform: str) -> str | None:
    """The serving dtype when the user names none, for a JAX platform ("tpu", "gpu", "cpu").

    On TPU, bfloat16: the MXU multiplies bf16 natively and a decode step reads half the HBM
    bytes of f32 weights and KV (activations, KV pages and weights all follow the params'
    dtype; logits, softmax, sampling statistics, RMSNorm and rope accumulate in f32, see
    docs/en/python_api.md "dtype"). Elsewhere None: the checkpoint's own dtype.
    """
    return "bfloat16" if platform == "tpu" else None


def check_pages_fit(num_pages: int, page_size: int, max_model_len: int) -> None:
    """A pool of `num_pages` must hold one `max_model_len` sequence beside the null page (page 0)."""
    pages_per_seq = math.ceil(max_model_len / page_size)
    if pages_per_seq > num_pages - 1:
        raise ConfigError(
            f"num_pages={num_pages} cannot hold one max_model_len={max_model_len} sequence "
            f"({pages_per_seq} pages of {page_size} plus the null page)"
        )


class _EngineConfig:
    """What `EngineConfig` does beside holding its fields (generated below)."""

    def __post_init__(self):
        parsed(self)
        for f in dataclasses.fields(self):
            check(f, getattr(self, f.name))
        check_pages_fit(self.num_pages, self.page_size, self.max_model_len)

    @classmethod
    def of(
        cls, args: EngineArgs, *, num_pages: int, max_model_len: int, attention: str | None = None
    ) -> EngineConfig:
        """The config of `args` once the model and the devices are known: the pool's size, the
        sequence bound, and (for a probe) the kernel the backend resolved `attention` to."""
        given = {f.name: getattr(args, f.name) for f in EngineArgs.engine_fields()}
        resolved = dict(
            num_pages=num_pages, max_model_len=max_model_len, attention=attention or args.attention
        )
        return cls(**{**given, **resolved})

    @property
    def pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)


def _engine_config() -> type:
    """Engine knobs, named as in vLLM so users feel at home: the `EngineArgs` rows marked
    `engine`, whose help says what each means (`num_pages` and `max_model_len` resolved)."""
    fields = [
        (
            f.name,
            "int" if f.name in RESOLVED else f.type,
            dataclasses.field(default=RESOLVED.get(f.name, f.default), metadata=f.metadata),
        )
        for f in EngineArgs.engine_fields()
    ]
    cls = dataclasses.make_dataclass(
        "EngineConfig", fields, bases=(_EngineConfig,), frozen=True, kw_only=True
    )
    cls.__module__, cls.__doc__ = __name__, _engine_config.__doc__
    return cls


EngineConfig = _engine_config()

"""`Fleet(**engine_args)` -> the `hotswap serve` flags every replica starts with, checked first
(`EngineArgs.of`: an unknown name is a TypeError, a bad value its ConfigError) so that a typo
fails in the caller, not in N replica logs."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from hotswap.args import EngineArgs


def serve_flags(engine_args: dict[str, Any]) -> list[str]:
    EngineArgs.of(None, engine_args, "Fleet")
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    out: list[str] = []
    for name, value in engine_args.items():
        f = fields[name]
        flag = EngineArgs.flag(f)
        if "serve" not in f.metadata["scopes"]:
            raise TypeError(f"Fleet(): {name!r} is not an option of `hotswap serve`")
        if f.metadata["type"] is bool:
            out.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            continue
        elif isinstance(value, (dict, list)):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out

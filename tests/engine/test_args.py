"""`EngineArgs` is the one table of engine options: every field is a flag of the commands of its
scope and a row of the docs' option tables, each with the field's one default; `LLM`,
`AotConfig` and `EngineConfig` take theirs from it."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from hotswap import EngineArgs
from hotswap.args import SCOPES
from hotswap.errors import ConfigError
from hotswap.speculative import SpeculativeConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"
ROW = re.compile(r"^\| (`[^|]+`) \| ([^|]+) \|", re.M)


def _parser(command: str) -> argparse.ArgumentParser:
    import importlib

    sub = argparse.ArgumentParser().add_subparsers()
    importlib.import_module(f"hotswap.cli.{command}").add_parser(sub)
    return sub.choices[command]


def _doc_rows(page: Path, marker: str) -> dict[str, str]:
    """First code span of each row of the table of `page` that lists `marker` -> its default cell."""
    tables = re.findall(r"(?:^\|.*\n)+", page.read_text(), re.M)
    (table,) = [t for t in tables if f"| `{marker}` |" in t]
    return {re.match(r"`([^`]+)`", name).group(1): default.strip() for name, default in ROW.findall(table)}


@pytest.mark.parametrize("command", ["serve", "aot"])
def test_every_field_of_its_scope_is_a_flag_with_the_one_default(command):
    actions = {a.dest: a for a in _parser(command)._actions}
    for f in EngineArgs.fields():
        if command not in f.metadata["scopes"]:
            assert f.name not in actions, f"{f.name} is not an option of {command}"
            continue
        a = actions[f.name]
        assert EngineArgs.flag(f) in a.option_strings, f.name
        assert a.default == f.default, (command, f.name, a.default, f.default)
        assert a.choices == (list(f.metadata["choices"]) if f.metadata["choices"] else None), f.name


@pytest.mark.parametrize("lang", ["en", "zh_cn"])
def test_every_field_is_a_row_of_the_docs_option_tables_with_the_one_default(lang):
    from hotswap.args import _default_cell

    api = _doc_rows(DOCS / lang / "python_api.md", "max_num_batched_tokens")
    serving = _doc_rows(DOCS / lang / "serving.md", "--max-num-batched-tokens")
    for f in EngineArgs.fields():
        assert api[f.name] == _default_cell(f, lang), f.name
        if "serve" in f.metadata["scopes"]:
            assert serving[EngineArgs.flag(f)] == _default_cell(f, lang), f.name
        if f.metadata["doc_default"] is None:  # a literal default cell states the default itself
            cell = _default_cell(f, lang).strip("`")
            assert cell in (repr(f.default), str(f.default), f'"{f.default}"'), (f.name, cell)


def test_scopes_are_known_and_every_field_is_an_llm_keyword():
    for f in EngineArgs.fields():
        assert set(f.metadata["scopes"]) <= set(SCOPES) and "llm" in f.metadata["scopes"], f.name


def test_llm_takes_exactly_the_fields():
    from hotswap import LLM

    with pytest.raises(TypeError, match="unexpected keyword argument 'page_sise'"):
        LLM("/nonexistent", page_sise=8)  # refused before anything is loaded
    args = EngineArgs.of(EngineArgs(page_size=8), {"max_num_seqs": 2})
    assert (args.page_size, args.max_num_seqs) == (8, 2)


def test_cli_args_round_trip():
    ns = _parser("serve").parse_args(
        ["--page-size", "8", "--no-enable-prefix-caching", "--drain-timeout", "5"]
    )
    args = EngineArgs.from_cli_args(ns, "serve")
    assert (args.page_size, args.enable_prefix_caching, args.drain_timeout_s) == (8, False, 5.0)
    assert args.max_num_seqs == EngineArgs().max_num_seqs


def test_engine_config_and_aot_config_take_the_defaults_from_engine_args():
    from hotswap.engine_config import RESOLVED, EngineConfig
    from hotswap.programs.tpu_slice import AotConfig

    defaults = {f.name: f.default for f in EngineArgs.fields()}
    assert set(RESOLVED) == {"num_pages", "max_model_len"}  # sized once the model and devices are known
    engine = [f.name for f in EngineArgs.fields() if f.metadata["engine"]]
    assert [f.name for f in dataclasses.fields(EngineConfig)] == engine
    for f in dataclasses.fields(EngineConfig):
        assert f.default == RESOLVED.get(f.name, defaults[f.name]), f.name
    aot = {f.name: f.default for f in dataclasses.fields(AotConfig)}
    assert set(aot) == {"topology", "buckets"} | {f.name for f in EngineArgs.fields("aot")}
    for f in EngineArgs.fields("aot"):
        assert aot[f.name] == f.default, f.name
    ecfg = EngineConfig.of(EngineArgs(page_size=8, max_waiting=3), num_pages=10, max_model_len=64)
    assert (ecfg.page_size, ecfg.max_waiting, ecfg.num_pages, ecfg.max_model_len) == (8, 3, 10, 64)
    with pytest.raises(ConfigError, match="attention"):
        EngineConfig.of(EngineArgs(attention="nope"), num_pages=10, max_model_len=64)


def test_every_shared_option_reaches_the_engine_config():
    from hotswap.engine_config import EngineConfig

    shared = {f.name for f in dataclasses.fields(EngineConfig)} & {f.name for f in EngineArgs.fields()}
    changed = dict(
        page_size=8,
        gpu_memory_utilization=0.5,
        max_num_seqs=3,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        disable_hybrid_kv_cache_manager=True,
        weight_update_staging="in_place",
        attention="reference",
        deterministic=True,
        max_waiting=7,
        drain_timeout_s=1.5,
        max_version_lag=2,
        compilation_cache=False,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=32,
        enable_return_routed_experts=True,
        logprobs_mode="processed_logits",
        structured_outputs_strict_mode=False,
        speculative_config=SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4}),
    )
    assert set(changed) == shared - {"num_pages", "max_model_len"}  # those two are resolved
    ecfg = EngineConfig.of(EngineArgs(**changed), num_pages=10, max_model_len=64)
    assert {k: getattr(ecfg, k) for k in changed} == changed


def _bad(f: dataclasses.Field):
    """A value outside the row's choices or bound."""
    if f.metadata["choices"]:
        return "nope"
    return next(v for v in (0, -1, 1.5) if not f.metadata["bound"].ok(v))


def test_choices_and_bounds_are_checked_by_the_row_wherever_an_option_is_built():
    from hotswap.engine_config import EngineConfig

    checked = [f for f in EngineArgs.fields() if f.metadata["choices"] or f.metadata["bound"]]
    assert {"attention", "weight_update_staging", "dtype", "page_size", "gpu_memory_utilization"} <= {
        f.name for f in checked
    }
    for f in checked:
        with pytest.raises(ConfigError, match=f"^{f.name}"):
            EngineArgs(**{f.name: _bad(f)})
        if f.metadata["engine"]:
            with pytest.raises(ConfigError, match=f"^{f.name}"):
                EngineConfig(**{f.name: _bad(f)})
    with pytest.raises(ConfigError, match="max_num_seqs must be > 0, got 0"):
        EngineArgs.of(None, {"max_num_seqs": 0})
    with pytest.raises(ConfigError, match="num_pages must be set"):
        EngineConfig(num_pages=None)  # resolved: None is EngineArgs' "size it", not a pool
    assert EngineArgs(num_pages=None, max_version_lag=None).num_pages is None

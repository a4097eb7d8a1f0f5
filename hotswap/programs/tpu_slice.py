"""`hotswap aot`: compile, on a CPU host, every program the engine would run on a TPU slice.

libtpu (the `[aot]` extra) compiles for TPU without one attached:
`jax.experimental.topologies.get_topology_desc` describes a slice's chips, and programs
lowered from `ShapeDtypeStruct`s on shardings over those chips compile with Mosaic and XLA
for them (docs/en/tpu_pods.md). Nothing here allocates a weight: the model is its config.json.

The report, per chip: the params' bytes, the KV pages that fit at `gpu_memory_utilization`
(sized by `programs/kv_sizing.py`, from the chip's HBM size), every program's memory
analysis (`programs/catalog.py`), whether serving fits the chip's HBM, and a decode
throughput estimate from HBM bandwidth. A compile error names its program. Under
`quantization` (int8; fp8 only on a chip with fp8 matmuls) every program takes the matmul
weights as the engine serves them and every byte count is theirs (`catalog.served_params`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax

from hotswap.args import EngineArgs
from hotswap.engine_config import EngineConfig, check_pages_fit, default_dtype
from hotswap.errors import ConfigError
from hotswap.model import sharding
from hotswap.model.config import ModelConfig
from hotswap.programs import catalog, kv_sizing
from hotswap.programs.step import Buckets
from hotswap.weights import quantize

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    hbm_bytes: int
    hbm_bytes_per_s: float


# Per chip: HBM size and bandwidth (public spec sheets).
CHIPS = {
    "v5e": Chip(16 * GIB, 819e9),
    "v6e": Chip(32 * GIB, 1640e9),
    "v5p": Chip(95 * GIB, 2765e9),
    "v4": Chip(32 * GIB, 1228e9),
}
DEFAULT_HOST_BOUNDS = 4  # libtpu's default chips_per_host_bounds is 2x2x1


def _aot_config() -> type:
    """`AotConfig(topology, <EngineArgs' "aot" options>, buckets)`: the slice, and the engine options
    `hotswap serve` would get there (their defaults are `EngineArgs`'; `dtype=None` is TPU's
    default, `tensor_parallel_size=None` every chip of the slice, `max_model_len=None`
    min(max_position_embeddings, 2048) as in LLM, `num_pages=None` sized from HBM)."""
    engine = [(f.name, f.type, dataclasses.field(default=f.default)) for f in EngineArgs.fields("aot")]
    cls = dataclasses.make_dataclass(
        "AotConfig",
        [
            ("topology", str),
            *engine,
            # "largest": only the largest decode and prefill step; "decode": the largest decode step
            # only (quick checks: the cache is then sized from those steps' temporaries).
            ("buckets", str, dataclasses.field(default="all")),
        ],
        frozen=True,
    )
    cls.__module__, cls.__doc__ = __name__, _aot_config.__doc__
    return cls


AotConfig = _aot_config()
BUCKETS = ("all", "largest", "decode")


def chip_of(topology: str) -> Chip:
    kind = topology.split(":")[0].lower()
    if kind not in CHIPS:
        raise ConfigError(f"unknown TPU topology {topology!r}: the name starts with one of {sorted(CHIPS)}")
    return CHIPS[kind]


def topology_devices(topology: str) -> list[jax.Device]:
    """The chips of a slice named like `v5e:2x4` (`v5e:1x1`: one chip), as compile targets."""
    chip_of(topology)
    if importlib.util.find_spec("libtpu") is None:
        raise ConfigError("compiling for TPU needs libtpu: pip install 'hotswap[aot]'")
    from jax.experimental import topologies

    # Compiling opens no chip, so several processes may hold libtpu at once; without this it
    # takes a machine-wide lock file and a second process (a test's subprocess, another
    # `hotswap aot`) fails with "ABORTED: ... libtpu multi-process lockfile".
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # No TPU VM metadata to read the worker hostnames from: without this libtpu logs an error.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

    dims = re.fullmatch(r"[^:]+:(\d+(?:x\d+)*)", topology)
    if dims is None:
        raise ConfigError(f"bad TPU topology {topology!r}: expected a name like v5e:2x4 or v5p:2x2x1")
    shape = [int(d) for d in dims.group(1).split("x")]
    kwargs = {}
    if math.prod(shape) < DEFAULT_HOST_BOUNDS:  # a slice smaller than one host's default bounds
        kwargs["chips_per_host_bounds"] = tuple(shape + [1] * (3 - len(shape)))
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, **kwargs)
    except Exception as e:  # libtpu's own message says what is wrong with the name
        raise ConfigError(f"bad TPU topology {topology!r}: {str(e).splitlines()[0]}") from e
    return list(desc.devices)


def load_model_config(model: str, dtype: str | None) -> ModelConfig:
    """MODEL: an HF directory (weights not needed, config.json is), or a preset name (a
    preset without an architecture, like `tiny`, is a Llama, as `create-model` makes it)."""
    from hotswap.checkpoint.create import hf_config_for, load_preset
    from hotswap.checkpoint.hf import read_hf_config

    if Path(model).is_dir():
        return ModelConfig.from_hf(read_hf_config(model), dtype=dtype)
    preset = load_preset(model)
    if "architectures" not in preset and "model_type" not in preset:
        preset = hf_config_for(preset, "llama")
    return ModelConfig.from_hf(preset, dtype=dtype)


def compile_for(model: str, acfg: AotConfig, progress: Callable[[str], None] | None = None) -> dict:
    """Compile every program for the slice and return the report (`hotswap aot --json`)."""
    if acfg.attention not in ("auto", "pallas", "reference"):
        raise ConfigError(f"attention={acfg.attention!r}: on TPU use 'auto', 'pallas' or 'reference'")
    if acfg.buckets not in BUCKETS:
        raise ConfigError(f"buckets={acfg.buckets!r}: use 'all', 'largest' or 'decode'")
    # checks each option against its row's choices and bound (hotswap/args.py `check`)
    engine_args = EngineArgs(**{f.name: getattr(acfg, f.name) for f in EngineArgs.fields("aot")})
    chip = chip_of(acfg.topology)
    devices = topology_devices(acfg.topology)
    tp = acfg.tensor_parallel_size or len(devices)
    if not 1 <= tp <= len(devices):
        raise ConfigError(f"tensor_parallel_size={tp}, but {acfg.topology} has {len(devices)} chips")
    mcfg = load_model_config(model, acfg.dtype or default_dtype("tpu"))
    # int8 / fp8 matmul weights as the engine serves them, checked against the slice's chips
    # (fp8 needs a chip with fp8 matmuls) and the model (a group size must divide each row)
    mcfg = quantize.configured(
        mcfg, acfg.quantization, acfg.quantization_group_size, gguf=False, device=devices[0]
    ).with_kv_cache_dtype(acfg.kv_cache_dtype)
    target = catalog.Target.first_chips(mcfg, acfg.attention, devices, tp)
    max_len = acfg.max_model_len or min(mcfg.max_position_embeddings, 2048)
    params_bytes = catalog.params_bytes_per_chip(mcfg, target)
    # the buffers of adapters served by name (`--enable-lora`): resident beside the params
    lora_bytes = (
        catalog.lora_bytes_per_chip(mcfg, acfg.max_loras, acfg.max_lora_rank, target)
        if acfg.enable_lora
        else 0
    )
    # the params (and adapter buffers) and what a hot update needs beside them (weights/place.py)
    weights = catalog.weights_per_chip(mcfg, target, acfg.weight_update_staging)
    weights = dataclasses.replace(weights, params=weights.params + lora_bytes)
    window = kv_sizing.window_bound(
        mcfg,
        acfg.page_size,
        acfg.max_num_seqs,
        acfg.max_num_batched_tokens,
        acfg.disable_hybrid_kv_cache_manager,
    )
    stats: list[catalog.StepStats] = []
    n_steps = compiled_pages = compiled_pool = 0
    verify: catalog.Verification | None = None

    def compile_all(pages: int) -> int:
        """Compile every program for a `pages` pool; returns the steps' largest temporary."""
        nonlocal n_steps, compiled_pages, compiled_pool, verify
        compiled_pages = pages
        ecfg = EngineConfig.of(
            engine_args, num_pages=pages, max_model_len=max_len, attention=target.backend.attention
        )
        backend = target.backend
        shapes = {
            "all": Buckets.for_config(ecfg, backend).shapes(),
            "largest": catalog.largest_shapes(ecfg, backend),
            "decode": catalog.largest_shapes(ecfg, backend)[:1],
        }[acfg.buckets]
        # speculative decoding: whichever buckets, the step that verifies the most drafts
        verify = catalog.verification(ecfg, backend)
        if verify is not None and verify.shape not in shapes:
            shapes = [*shapes, verify.shape]
        layers = catalog.abstract_inputs(mcfg, ecfg, target)[1]
        compiled_pool = catalog.pool_bytes_per_chip(layers)
        pages = set(layers)  # a full and a window layer's
        todo = [
            *catalog.step_programs(mcfg, ecfg, target, shapes),
            *catalog.draft_programs(mcfg, ecfg, target),
        ]
        n_steps = len(todo)
        todo += [*catalog.kv_init_programs(mcfg, ecfg, target), *catalog.update_programs(mcfg, target)]
        for i, (name, lower) in enumerate(todo):
            t = time.perf_counter()
            stats.append(catalog.compile_stats(name, lower, pages))
            if progress is not None:
                progress(f"[{i + 1}/{len(todo)}] {name}: {time.perf_counter() - t:.1f} s")
        return max(s.temp_bytes for s in stats[:n_steps])

    if acfg.num_pages:
        num_pages, temps = acfg.num_pages, compile_all(acfg.num_pages)
    else:  # as the engine sizes a real chip's pool, from the chip's HBM size
        num_pages, temps = kv_sizing.accelerator_pages(
            mcfg,
            chip.hbm_bytes,
            acfg.gpu_memory_utilization,
            weights,
            compile_all,
            page_size=acfg.page_size,
            tp=tp,
            window=window,
        )
    steps, others = stats[:n_steps], stats[n_steps:]
    check_pages_fit(num_pages, acfg.page_size, max_len)
    window = window if window is not None and window < num_pages else None  # kv_sizing.window_pages
    kv_bytes = kv_sizing.pool_bytes(mcfg, num_pages, window, acfg.page_size, tp)
    # While serving: params + cache + the worst step's temporaries and unaliased outputs.
    extra = max(s.temp_bytes + s.output_bytes - s.alias_bytes for s in steps)
    serving = params_bytes + lora_bytes + kv_bytes + extra
    worst = max(steps, key=lambda s: s.temp_bytes + s.output_bytes - s.alias_bytes)
    # A hot update: a staged copy beside the serving params, or in place what one pass holds
    # in flight (weights/place.py), with the conversion programs' temporaries.
    update = weights.total + kv_bytes + max((s.temp_bytes for s in others), default=0)
    # A decode step at max_num_seqs reads this chip's params and every row's cached K/V
    # (rows at max_model_len, as far as the pool holds them): bandwidth-bound on TPU.
    token_bytes = kv_sizing.page_bytes(mcfg, acfg.page_size, tp) // acfg.page_size
    # A MoE step reads only the experts its rows were routed to (model/moe.py).
    expert_bytes = catalog.params_bytes_per_chip(mcfg, target, experts_only=True)
    unread = round(expert_bytes * (1 - catalog.active_expert_fraction(mcfg, acfg.max_num_seqs)))
    read = params_bytes - unread + min(kv_bytes, acfg.max_num_seqs * max_len * token_bytes)
    report = {
        "model": model,
        "topology": acfg.topology,
        "chips": len(devices),
        "tensor_parallel_size": tp,
        # chips holding each kv head's pages: tp / num_kv_heads when tp exceeds it (model/sharding.py)
        "kv_replicas": sharding.kv_replicas(mcfg, tp),
        "dtype": mcfg.dtype,
        "quantization": mcfg.quantization,
        "quantization_group_size": mcfg.quantization_group_size,
        "attention": target.backend.attention,
        "max_model_len": max_len,
        "max_num_seqs": acfg.max_num_seqs,
        "page_size": acfg.page_size,
        "gpu_memory_utilization": acfg.gpu_memory_utilization,
        "params_bytes_per_chip": params_bytes,
        "lora_bytes_per_chip": lora_bytes,
        "max_loras": acfg.max_loras if acfg.enable_lora else 0,
        "max_lora_rank": acfg.max_lora_rank if acfg.enable_lora else 0,
        "kv_cache_bytes_per_chip": kv_bytes,
        "num_pages": num_pages,
        "window_pages": window or 0,
        "compiled_num_pages": compiled_pages,
        "step_temp_bytes": temps,
        "hbm_bytes_per_chip": chip.hbm_bytes,
        "serving_bytes_per_chip": serving,
        "largest_step": worst.name,
        "fits": serving <= chip.hbm_bytes,
        "weight_update_staging": weights.staging,
        # what an update holds beside the serving params (catalog.weights_per_chip)
        "update_reserve_bytes_per_chip": weights.reserve,
        "update_bytes_per_chip": update,
        "update_fits": update <= chip.hbm_bytes,
        "decode_bytes_read_per_chip": read,
        "expert_bytes_per_chip": expert_bytes,
        "decode_expert_fraction": round(catalog.active_expert_fraction(mcfg, acfg.max_num_seqs), 4),
        "est_decode_tok_s": round(acfg.max_num_seqs * chip.hbm_bytes_per_s / read, 1),
        "steps": [dataclasses.asdict(s) for s in stats],
    }
    spec = engine_args.speculative_config  # parsed (a dict or a JSON string given)
    report["speculative_config"] = None if spec is None else json.loads(spec.describe())
    if verify is not None:  # a call reads the params and its sequences' K/V at max_model_len
        rows = verify.sequences * verify.tokens
        unread = round(expert_bytes * (1 - catalog.active_expert_fraction(mcfg, rows)))
        reads = params_bytes - unread + min(kv_bytes, verify.sequences * max_len * token_bytes)
        report["verification"] = _verification(verify, steps, compiled_pool, reads)
    else:
        report["verification"] = None
    draft = [s for s in steps if s.name.startswith("draft ")]
    report["draft"] = _draft(draft[0], spec.draft_layers) if draft else None
    return report


def _draft(s: catalog.StepStats, layers: int) -> dict:
    """A self-draft's step in the report: its bytes per chip (it holds no params or pages of
    its own: they are the model's first layers')."""
    return {
        "step": s.name,
        "layers": layers,
        "temp_bytes": s.temp_bytes,
        "peak_bytes": s.peak_bytes,
        "pallas_calls": s.pallas_calls,
        "kv_copies": s.kv_copies,
    }


def _verification(v: catalog.Verification, steps: list, pool: int, reads: int) -> dict:
    """The verification step's part of the report: its shape, its bytes per chip (XLA's memory
    analysis), whether it updates the KV pages in place (donated, aliased to its output, never
    copied: `pool` is the compiled pool's bytes a chip; for a read-then-write backend, the jnp
    reference, the KV write after the step does the writing), and `reads`, what one call reads
    from HBM (the params, and its sequences' cached K/V at max_model_len)."""
    b, c, p = v.shape
    s = next(s for s in steps if s.name == catalog.step_name(b, c, p))
    write = next((w for w in steps if w.name == f"kv write B={b} C={c}"), None)
    copies = s.kv_copies + (write.kv_copies if write else 0)
    aliased = max(s.alias_bytes, write.alias_bytes if write else 0)
    return {
        "step": s.name,
        "sequences_per_call": v.sequences,
        "tokens_per_sequence": v.tokens,
        "sampled_rows": v.sampled_rows,
        "calls_per_step": v.calls,
        "argument_bytes": s.argument_bytes,
        "output_bytes": s.output_bytes,
        "temp_bytes": s.temp_bytes,
        "alias_bytes": s.alias_bytes,
        "peak_bytes": s.peak_bytes,
        "pallas_calls": s.pallas_calls,
        "kv_copies": s.kv_copies,
        "kv_in_place": copies == 0 and aliased >= pool,
        "bytes_read_per_call": reads,
    }


def does_not_fit(report: dict) -> str | None:
    """What to say when serving does not fit a chip's HBM (None: it fits)."""
    if report["fits"]:
        return None
    return (
        f"does not fit: serving needs {report['serving_bytes_per_chip'] / GIB:.2f} GiB of a chip's "
        f"{report['hbm_bytes_per_chip'] / GIB:.2f} GiB (largest step: {report['largest_step']})"
    )


def table(report: dict) -> str:
    """The report as text: a summary, then one row per program."""
    g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    lines = [
        f"{report['model']} on {report['topology']} ({report['chips']} chips), TP {report['tensor_parallel_size']}, "
        f"{report['dtype']}"
        + (f", {report['quantization']} weights" if report.get("quantization") else "")
        + f", attention {report['attention']}"
        + (f", each kv head on {report['kv_replicas']} chips" if report.get("kv_replicas", 1) > 1 else ""),
        f"per chip: params {g(report['params_bytes_per_chip'])}, KV cache {g(report['kv_cache_bytes_per_chip'])} "
        f"({report['num_pages']} pages of {report['page_size']} at {report['gpu_memory_utilization']}), "
        f"serving {g(report['serving_bytes_per_chip'])} of {g(report['hbm_bytes_per_chip'])} HBM: "
        + ("fits" if report["fits"] else "DOES NOT FIT"),
        *(
            [
                f"LoRA buffers ({report['max_loras']} adapters x rank {report['max_lora_rank']}): {g(report['lora_bytes_per_chip'])}"
            ]
            if report.get("lora_bytes_per_chip")
            else []
        ),
        f"a hot update ({report['weight_update_staging']}): {g(report['update_bytes_per_chip'])}"
        + (
            ""
            if report["update_fits"]
            else " (does not fit: sleep level 2 first, or a lower gpu_memory_utilization)"
        ),
        f"est. decode at {report['max_num_seqs']} seqs x {report['max_model_len']} tokens: "
        f"{report['est_decode_tok_s']:,.0f} tok/s (HBM-bandwidth bound)",
        *_verification_lines(report, g),
        "",
        f"{'program':<34} {'arguments':>12} {'outputs':>12} {'temps':>12} {'aliased':>12} {'pallas':>6}",
    ]
    m = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    verify = (report.get("verification") or {}).get("step")
    for s in report["steps"]:
        name = s["name"] + (" (verify)" if s["name"] == verify else "")
        lines.append(
            f"{name:<34} {m(s['argument_bytes']):>12} {m(s['output_bytes']):>12} "
            f"{m(s['temp_bytes']):>12} {m(s['alias_bytes']):>12} {s['pallas_calls']:>6}"
        )
    return "\n".join(lines)


def _verification_lines(report: dict, g: Callable[[int], str]) -> list[str]:
    """The verification step, in words (nothing without speculative decoding)."""
    v = report.get("verification")
    if v is None:
        return []
    spec = report["speculative_config"]
    place = (
        "KV pages donated and updated in place"
        if v["kv_in_place"]
        else f"KV NOT in place ({v['kv_copies']} page-buffer copies, {g(v['alias_bytes'])} aliased)"
    )
    return [
        f"verification ({spec['method']}, {spec['num_speculative_tokens']} draft tokens): {v['step']}, "
        f"{v['sequences_per_call']} sequences x {v['tokens_per_sequence']} tokens a call, "
        f"{v['sampled_rows']} sampled rows, {v['calls_per_step']} call(s) a step",
        f"  per chip a call: temps {g(v['temp_bytes'])}, peak {g(v['peak_bytes'])}, reads "
        f"{g(v['bytes_read_per_call'])} from HBM; {v['pallas_calls']} Pallas calls; {place}",
        *_draft_lines(report, g),
    ]


def _draft_lines(report: dict, g: Callable[[int], str]) -> list[str]:
    d = report.get("draft")
    if d is None:
        return []
    return [
        f"draft ({d['layers']} of the model's layers and its head): {d['step']}, per chip temps "
        f"{g(d['temp_bytes'])}, peak {g(d['peak_bytes'])}; {d['pallas_calls']} Pallas calls, "
        f"{d['kv_copies']} page-buffer copies (its K/V are the model's first layers')"
    ]

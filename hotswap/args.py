"""`EngineArgs`: the one table of engine options (vLLM's pattern).

Each field carries its default, help (English and Chinese, for the docs), choices and bound,
the commands it is a flag of, and whether it is a field of `EngineConfig`. Everything that takes
engine options is generated from it: the `hotswap serve` and `hotswap aot` flags
(`add_cli_args` / `from_cli_args`), the keywords of `LLM(model, **kwargs)` and
`HotswapRollout`, `programs.tpu_slice.AotConfig`, `EngineConfig`'s fields (hotswap/engine_config.py), and
the option tables of docs/en and docs/zh_cn (`python -m hotswap.args --markdown`, written into
the pages by `tools/option_tables.py`). It resolves into `EngineConfig` once the model and the
devices are known (`EngineConfig.of`). A value is checked against its row's choices and bound in
one place, `check`, which both `EngineArgs` and `EngineConfig` run when they are built.

Imports nothing heavy: the CLI builds its parsers from it before JAX is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from hotswap.errors import ConfigError
from hotswap.speculative import SpeculativeConfig
from hotswap.toolcalls.formats import PARSER_NAMES

# "auto": the Pallas kernel on TPU, the C++ kernels on one CPU device (when they build), else
# "reference" (jnp). The Engine resolves it once (kernels/backend.py `Backend.choose`).
ATTENTION_IMPLS = ("auto", "reference", "cpu", "pallas")
DTYPES = ("float32", "bfloat16", "float16")
# How a hot update is staged (weights/place.py `resolve`): "auto" is "in_place" on TPU/GPU, "copy" on CPU.
WEIGHT_UPDATE_STAGINGS = ("auto", "copy", "in_place")
# Where a field is an option: `LLM(...)` (and `HotswapRollout`), `hotswap serve`, `hotswap aot`.
SCOPES = ("llm", "serve", "aot")
SERVING = ("llm", "serve")  # options of a running engine, meaningless when only compiling
# What a token's log-probs are of (vLLM's `logprobs_mode`; programs/sampler.py): the raw model
# distribution, or the processed one it was drawn from; as log-probs or as logits.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class Bound(NamedTuple):
    """What a number option must be: `ok(value)`, else "<name> must be <must>, got <value>"."""

    must: str
    ok: Callable[[Any], bool]


POSITIVE = Bound("> 0", lambda v: v > 0)


def option(
    default: Any,
    help: str,
    help_zh: str,
    *,
    type: type,
    choices: tuple[str, ...] | None = None,
    bound: Bound | None = None,
    scopes: tuple[str, ...] = SCOPES,
    engine: bool = True,
    doc_default: str | None = None,
    doc_default_zh: str | None = None,
    flag: str | None = None,
    parse: Callable[[Any], Any] | None = None,
) -> Any:
    """A field of `EngineArgs`. `engine`: a field of `EngineConfig` too (else it is read where the
    model is loaded, or handed to the `Engine` or the server on its own); `doc_default`: the docs'
    default cell when the default is resolved later (None here); `flag`: the CLI flag when it is
    not the field's name in dashes; `parse`: what turns a given value (a flag's string, a
    keyword's dict) into the field's value, raising ConfigError (an option that is an object)."""
    meta = dict(
        help=help,
        help_zh=help_zh,
        type=type,
        choices=choices,
        bound=bound,
        scopes=scopes,
        engine=engine,
        doc_default=doc_default,
        doc_default_zh=doc_default_zh or doc_default,
        flag=flag,
        parse=parse,
    )
    return dataclasses.field(default=default, metadata=meta)


def parsed(obj: Any) -> None:
    """Run each `parse` option's parser on the value a frozen dataclass (`EngineArgs`,
    `EngineConfig`) was built with, in place."""
    for f in dataclasses.fields(obj):
        if f.metadata.get("parse") is not None:
            object.__setattr__(obj, f.name, f.metadata["parse"](getattr(obj, f.name)))


def _flag_type(parse: Callable[[Any], Any]) -> Callable[[str], Any]:
    """A `parse` option's parser as argparse's `type`: its ConfigError becomes argparse's usage
    error (exit 2, "argument --flag: <the message>"), not a traceback."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def check(f: dataclasses.Field, value: Any) -> None:
    """`value` of the option `f` against its row: one of its choices, within its bound. None is
    a value only of an option whose default is None (one resolved later, or "no bound")."""
    m = f.metadata
    if value is None:
        if f.default is None:
            return
        raise ConfigError(f"{f.name} must be set, got None")
    if m["choices"] and value not in m["choices"]:
        raise ConfigError(f"{f.name}={value!r}; use one of {', '.join(m['choices'])}")
    if m["bound"] is not None and not m["bound"].ok(value):
        raise ConfigError(f"{f.name} must be {m['bound'].must}, got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """The engine options of `LLM(model, **kwargs)`, `hotswap serve` and `hotswap aot`."""

    max_model_len: int | None = option(
        None,
        "longest sequence, prompt plus output",
        "最长序列长度，提示词加输出",
        type=int,
        bound=POSITIVE,
        doc_default="`min(max_position_embeddings, 2048)`",
    )
    max_num_seqs: int = option(
        32, "sequences decoded together in one step", "一个 step 中一起解码的序列数", type=int, bound=POSITIVE
    )
    max_num_batched_tokens: int = option(
        256,
        "tokens per step; longer prompts are prefilled in chunks",
        "每个 step 的 token 数；更长的提示词分块预填充",
        type=int,
        bound=POSITIVE,
    )
    page_size: int = option(16, "tokens per KV page", "每个 KV 页的 token 数", type=int, bound=POSITIVE)
    num_pages: int | None = option(
        None,
        "KV pages in the pool (plus page 0, reserved)",
        "池中的 KV 页数（另加保留的第 0 页）",
        type=int,
        bound=Bound(">= 2 (page 0 is the null page)", lambda v: v >= 2),
        doc_default="on CPU two full-length sequences or `max_num_seqs` half-length ones, whichever is "
        "more; on TPU/GPU what fits `gpu_memory_utilization`",
        doc_default_zh="CPU 上为两条满长度序列或 `max_num_seqs` 条半长度序列所需，取较多者；TPU/GPU 上为 "
        "`gpu_memory_utilization` 下放得下的页数",
    )
    gpu_memory_utilization: float = option(
        0.9,
        "on TPU/GPU without `num_pages`: the fraction of free device memory for params, KV cache and "
        "the steps' temporaries (vLLM's name)",
        "TPU/GPU 上未给 `num_pages` 时：参数、KV 缓存和各 step 临时内存可占空闲设备内存的比例（沿用 vLLM 的名字）",
        type=float,
        bound=Bound("in (0, 1]", lambda v: 0.0 < v <= 1.0),
    )
    weight_update_staging: str = option(
        "auto",
        '`"copy"`: a hot update builds the new weights beside the serving ones and swaps them in '
        "at once, so serving goes on through the whole transfer; the device holds two copies of the "
        'params. `"in_place"`: the update is checked first (serving goes on), then written over the '
        "serving weights while the engine pauses, so the device holds one copy and the KV cache gets "
        "the rest; a bad update is still refused before anything serving is touched. The KV sizing "
        'counts what the choice needs. `"auto"`: `"in_place"` on TPU/GPU, `"copy"` on CPU',
        '`"copy"`：热更新在正在服务的权重旁构建新权重，再一次性换入，整个传输期间服务不停；设备上有两份参数。'
        '`"in_place"`：先检查更新（服务不停），再在引擎暂停时直接写在正在服务的权重上，设备上只有一份参数，'
        "其余内存归 KV 缓存；坏的更新仍在触及任何正在服务的权重之前被拒绝。KV 容量计算按所选方式计入所需内存。"
        '`"auto"`：TPU/GPU 上为 `"in_place"`，CPU 上为 `"copy"`',
        type=str,
        choices=WEIGHT_UPDATE_STAGINGS,
    )
    enable_prefix_caching: bool = option(
        True,
        "reuse the KV of full pages of an earlier prompt",
        "复用先前提示词中完整页的 KV",
        type=bool,
        scopes=SERVING,
    )
    disable_hybrid_kv_cache_manager: bool = option(
        False,
        "a model with sliding-window layers (Gemma 2/3, Mistral with a window): give those layers as "
        "many pages as the full layers instead of a pool bounded by the window (vLLM's flag; the "
        "sliding windows page of the docs says what the bound saves)",
        "含滑动窗口层的模型（Gemma 2/3、带窗口的 Mistral）：这些层与全注意力层使用同样多的页，而不是按窗口限定"
        "大小的页池（vLLM 的同名选项；文档的滑动窗口一页说明限定能省多少）",
        type=bool,
    )
    dtype: str | None = option(
        None,
        '`"float32"`, `"bfloat16"` or `"float16"`: weights, activations and KV pages (see `dtype` on the '
        "Python API page)",
        '`"float32"`、`"bfloat16"` 或 `"float16"`：权重、激活值与 KV 页（见 Python API 页的 `dtype` 一节）',
        type=str,
        engine=False,
        choices=DTYPES,
        doc_default='`"bfloat16"` on TPU, else the checkpoint\'s',
        doc_default_zh='TPU 上为 `"bfloat16"`，其他平台为检查点自身的',
    )
    kv_cache_dtype: str = option(
        "auto",
        '`"auto"` (the KV pages in `dtype`), `"float32"`, `"bfloat16"` or `"float16"`: the KV pages\' '
        "dtype on its own (vLLM's name; llama.cpp keeps 16-bit KV under f32 weights by default). 16-bit "
        "pages under an f32 model halve the KV cache's bytes; attention still accumulates in f32. The "
        "Pallas kernel reads pages only in `dtype`; the C++ CPU kernels read float32 or bfloat16 pages "
        '(`attention="auto"` takes the jnp reference for float16 ones)',
        '`"auto"`（KV 页与 `dtype` 相同）、`"float32"`、`"bfloat16"` 或 `"float16"`：单独指定 KV 页的 dtype'
        "（沿用 vLLM 的名字；llama.cpp 默认在 f32 权重下用 16 位 KV）。f32 模型配 16 位页时 KV 缓存的字节数减半；"
        "注意力仍以 f32 累加。Pallas 内核只读取 `dtype` 的页；C++ CPU 内核读取 float32 或 bfloat16 的页"
        '（float16 的页由 `attention="auto"` 改用 jnp 参考实现）',
        type=str,
        engine=False,
        choices=("auto", *DTYPES),
    )
    quantization: str | None = option(
        None,
        '`"int8"` (weight-only, f32 scales per output column or per `quantization_group_size` inputs), '
        '`"gguf"` (a GGUF file\'s Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks served as they are; its other tensors '
        'in `dtype`, bfloat16 unless given) or `"fp8"` (chips with fp8 matmuls only): how the matmul '
        "weights are served; every update is checked at full precision and re-quantized on the way in "
        "(the quantization page of the docs)",
        '`"int8"`（仅权重，每个输出列或每 `quantization_group_size` 个输入一个 f32 缩放）、`"gguf"`（按原样服务 '
        'GGUF 文件的 Q8_0/Q4_0/Q4_1/Q4_K/Q6_K 块；其余张量为 `dtype`，未指定时为 bfloat16）或 `"fp8"`'
        "（仅限有 fp8 矩阵乘的芯片）：矩阵乘权重的服务方式；每次更新先以全精度检查，再在写入时重新量化"
        "（见文档的量化一页）",
        type=str,
        engine=False,
        choices=("int8", "gguf", "fp8"),
        doc_default="none (weights in `dtype`)",
        doc_default_zh="无（权重为 `dtype`）",
    )
    quantization_group_size: int | None = option(
        None,
        'with `quantization="int8"`: one scale per this many inputs of each output column (must divide '
        "every quantized weight's input size); none: one scale per column",
        '配合 `quantization="int8"`：每个输出列每这么多个输入一个缩放（须整除每个量化权重的输入维度）；'
        "不设：每列一个缩放",
        type=int,
        engine=False,
        bound=POSITIVE,
    )
    attention: str = option(
        "auto",
        '`"auto"`: the Pallas kernel on TPU (head_dim a multiple of 64; under tensor parallelism each '
        "chip runs it on its own kv heads); the C++ CPU kernel on the CPU backend with the cache on one "
        "device (built on first use with the system C++ compiler, cached in `$HOTSWAP_CACHE_DIR`, default "
        '`~/.cache/hotswap`); else `"reference"` (jnp). `"cpu"`, `"reference"` and `"pallas"` force one '
        '(`"pallas"` runs in interpret mode off TPU); a choice that cannot run here is a `ConfigError` '
        "saying why. The engine logs (logger `hotswap.kernels.backend`) what it chose and why",
        '`"auto"`：TPU 上用 Pallas 内核（head_dim 须为 64 的倍数；张量并行时每个芯片只处理自己的 kv 头）；'
        "CPU 后端且 KV 缓存在单个设备上时用 C++ CPU 内核（首次使用时用系统 C++ 编译器构建，缓存在 "
        '`$HOTSWAP_CACHE_DIR`，默认 `~/.cache/hotswap`）；否则用 `"reference"`（jnp）。`"cpu"`、`"reference"` '
        '和 `"pallas"` 强制选用其一（`"pallas"` 在非 TPU 上为解释模式）；在此处无法运行的选择会抛出 '
        "`ConfigError` 并说明原因。引擎会记录一条日志（logger `hotswap.kernels.backend`）说明选了什么、为什么",
        type=str,
        choices=ATTENTION_IMPLS,
    )
    deterministic: bool = option(
        False,
        "batch-invariant kernels: a request's tokens and log-probs are the same bits whatever else runs "
        "(batch, prefill chunk size, a prefix hit), and `LLM.score` returns the log-probs generation "
        "did. The C++ CPU kernels in f32 only, on one device (else a `ConfigError`)",
        "批次不变的内核：无论同时运行什么（批次、预填充分块大小、前缀命中），请求的 token 与 log-prob "
        "逐位相同，且 `LLM.score` 返回与生成时相同的 log-prob。仅限单设备上 f32 的 C++ CPU "
        "内核（否则抛出 `ConfigError`）",
        type=bool,
        scopes=SERVING,
    )
    warmup: bool = option(
        True,
        "compile every step shape now",
        "立即编译所有 step 形状",
        type=bool,
        engine=False,
        scopes=SERVING,
    )
    compilation_cache: bool = option(
        True,
        "keep compiled steps in `$HOTSWAP_CACHE_DIR/xla` and load them on the next start",
        "把编译好的 step 保存在 `$HOTSWAP_CACHE_DIR/xla`，下次启动时加载",
        type=bool,
        scopes=SERVING,
    )
    seed: int = option(
        0,
        "seeds requests that carry no seed of their own",
        "为没有自带种子的请求提供种子",
        type=int,
        engine=False,
        scopes=SERVING,
    )
    weights_root: str | None = option(
        None,
        "when set, path updates must lie under it (`hotswap serve` refuses path updates without it)",
        "设置后，按路径更新时路径必须位于其下（不设置时 `hotswap serve` 拒绝按路径更新）",
        type=str,
        engine=False,
        scopes=SERVING,
    )
    max_waiting: int = option(
        1024,
        "queue bound; beyond it a request raises `QueueFull` (HTTP 429)",
        "队列上限；超出时请求抛出 `QueueFull`（HTTP 429）",
        type=int,
        scopes=SERVING,
    )
    drain_timeout_s: float = option(
        60.0,
        "seconds a `drain` update waits before aborting what still runs",
        "`drain` 更新在中止仍在运行的请求前等待的秒数",
        type=float,
        scopes=SERVING,
        flag="--drain-timeout",
    )
    max_version_lag: int | None = option(
        None,
        "under the `keep` policy, recompute a running sequence whose oldest KV is more than this many "
        "versions old (AReaL's max_head_offpolicyness; `None`: no bound)",
        "在 `keep` 策略下，最旧 KV 落后超过这么多个版本的运行中序列会被重新计算（AReaL 的 "
        "max_head_offpolicyness；`None`：不设上限）",
        type=int,
        bound=Bound(">= 0 (or None)", lambda v: v >= 0),
        scopes=SERVING,
    )
    tensor_parallel_size: int | None = option(
        None,
        "shard params and KV heads over this many devices (`None`: one device; `hotswap aot`: every chip "
        "of the slice)",
        "把参数和 KV 头分片到这么多个设备上（`None`：一个设备；`hotswap aot`：切片的所有芯片）",
        type=int,
        engine=False,
    )
    enable_lora: bool = option(
        False,
        "serve LoRA adapters by name (`/v1/load_lora_adapter`, `LLM.generate(lora_request=...)`): requests of "
        "different adapters share a batch, each row's low-rank path read from fixed [max_loras, max_lora_rank] "
        "buffers",
        "按名字服务 LoRA 适配器（`/v1/load_lora_adapter`、`LLM.generate(lora_request=...)`）：不同适配器的请求共享一个批次，"
        "每行的低秩路径读取固定形状的 [max_loras, max_lora_rank] 缓冲区",
        type=bool,
    )
    max_loras: int = option(
        4,
        "adapters loaded at once (with `enable_lora`); a compiled shape: loading one never recompiles",
        "同时加载的适配器数（`enable_lora` 时）；这是编译形状：加载适配器从不重新编译",
        type=int,
        bound=POSITIVE,
    )
    max_lora_rank: int = option(
        16,
        "largest adapter rank served by name (with `enable_lora`); a compiled shape",
        "按名字服务的适配器的最大秩（`enable_lora` 时）；这是编译形状",
        type=int,
        bound=POSITIVE,
    )
    tool_call_parser: str | None = option(
        None,
        "how tool calls are read from the model's text (`tools` with tool_choice `auto`) and written into "
        'prompts whose chat template does not: `"hermes"` (`<tool_call>` JSON, Qwen; SGLang\'s `"qwen25"`), '
        '`"llama3_json"` (SGLang\'s `"llama3"`), `"mistral"`, `"smollm2"`',
        "如何从模型输出中读出工具调用（`tools` 且 tool_choice 为 `auto` 时），以及在聊天模板不渲染工具时如何写入提示词："
        '`"hermes"`（`<tool_call>` JSON，Qwen；即 SGLang 的 `"qwen25"`）、`"llama3_json"`（SGLang 的 `"llama3"`）、'
        '`"mistral"`、`"smollm2"`',
        type=str,
        engine=False,
        choices=PARSER_NAMES,
        scopes=SERVING,
        doc_default="chosen from the chat template's markers (`smollm2` when it has none)",
        doc_default_zh="按聊天模板中的标记选择（没有标记时为 `smollm2`）",
    )
    enable_return_routed_experts: bool = option(
        False,
        "a MoE model: every request returns the experts each token was routed to (vLLM's flag: "
        "`CompletionOutput.routed_experts`, the OpenAI routes' `routed_experts`); without it a request "
        "asks with `return_routed_experts`",
        "MoE 模型：每个请求都返回每个词元被路由到的专家（vLLM 的同名选项：`CompletionOutput.routed_experts`，"
        "OpenAI 路由中的 `routed_experts`）；不设置时由请求的 `return_routed_experts` 单独要求",
        type=bool,
        scopes=SERVING,
    )
    logprobs_mode: str = option(
        "raw_logprobs",
        "what returned log-probs are of (vLLM's flag): `raw_logprobs` / `raw_logits`, the model's "
        "distribution; `processed_logprobs` / `processed_logits`, the one a token was drawn from (after the "
        "structured-output mask, temperature, top-k, top-p and min-p; filtered tokens `-inf`). A request's "
        "`logprobs_mode` overrides it",
        "返回的对数概率属于哪个分布（vLLM 的同名选项）：`raw_logprobs` / `raw_logits` 为模型的原始分布；"
        "`processed_logprobs` / `processed_logits` 为词元实际采样所用的分布（经结构化输出掩码、温度、top-k、"
        "top-p 与 min-p 之后；被过滤的词元为 `-inf`）。请求的 `logprobs_mode` 可覆盖它",
        type=str,
        choices=LOGPROBS_MODES,
        scopes=SERVING,
    )
    structured_outputs_strict_mode: bool = option(
        True,
        "JSON schemas (response_format, `structured_outputs`, SGLang's `json_schema`, named and required "
        "tool choices, structural tags) admit only the keys and array items they name, unless the schema "
        "opens them (`additionalProperties: true` or a schema, `items`): xgrammar's strict mode, what "
        "vLLM's default backend does. `--no-structured-outputs-strict-mode`: objects and arrays a schema "
        "leaves unsaid are open, as the JSON Schema spec reads them (a request still closes its own with "
        "`disable_additional_properties` or OpenAI's `strict: true`)",
        "JSON schema（response_format、`structured_outputs`、SGLang 的 `json_schema`、指定函数或 required 的 "
        "tool_choice、structural tag）只接受其中写明的键和数组元素，除非 schema 自己放开（`additionalProperties: "
        "true` 或一个 schema、`items`）：即 xgrammar 的 strict mode，vLLM 默认后端的行为。"
        "`--no-structured-outputs-strict-mode`：schema 未说明的对象和数组是开放的，按 JSON Schema 规范理解"
        "（请求仍可用 `disable_additional_properties` 或 OpenAI 的 `strict: true` 关闭自己的 schema）",
        type=bool,
        scopes=SERVING,
    )
    speculative_config: SpeculativeConfig | None = option(
        None,
        'speculative decoding, vLLM\'s object: `{"method": "ngram", "num_speculative_tokens": k, '
        '"prompt_lookup_min": a, "prompt_lookup_max": b}` (prompt lookup) or `{"method": '
        '"draft_model", "model": "self", "draft_layers": n, "num_speculative_tokens": k}` (the '
        "model's first n layers and its head draft), or `\"model\"`: a draft checkpoint's path (the target's "
        "vocabulary); `disable_by_batch_size`: no drafts while that many sequences run. Exact: every token "
        "is the model's own draw, the one decoding without it draws given the same logits (bitwise in "
        "deterministic mode); rows with structured outputs do not speculate",
        '推测解码，vLLM 的对象：`{"method": "ngram", "num_speculative_tokens": k, '
        '"prompt_lookup_min": a, "prompt_lookup_max": b}`（提示词查找）或 `{"method": '
        '"draft_model", "model": "self", "draft_layers": n, "num_speculative_tokens": k}`'
        '（由模型的前 n 层和输出头起草），或 `"model"` 为草稿检查点的路径（与目标模型同一词表）。`disable_by_batch_size`：运行的序列达到该数时不起草。结果精确：每个词元都是模型自己的抽样，在 logits 相同时与不用推测解码时的抽样相同（确定性模式下逐位相同）；'
        "带结构化输出的请求不做推测",
        type=str,
        parse=SpeculativeConfig.parse,
        doc_default="`None` (off)",
        doc_default_zh="`None`（关闭）",
    )
    revision: str | None = option(
        None,
        "branch, tag or commit of a Hub ID (`None`: `main`); not for local paths",
        "Hub ID 的分支、标签或提交（`None`：`main`）；不适用于本地路径",
        type=str,
        engine=False,
        scopes=SERVING,
    )

    # ---- construction ------------------------------------------------------------

    def __post_init__(self):
        parsed(self)
        for f in dataclasses.fields(self):
            check(f, getattr(self, f.name))

    @classmethod
    def fields(cls, scope: str | None = None) -> list[dataclasses.Field]:
        """The fields that are options of `scope` ("llm", "serve", "aot"; None: all)."""
        return [f for f in dataclasses.fields(cls) if scope is None or scope in f.metadata["scopes"]]

    @classmethod
    def engine_fields(cls) -> list[dataclasses.Field]:
        """The fields that are `EngineConfig`'s too (hotswap/engine_config.py builds it from them)."""
        return [f for f in dataclasses.fields(cls) if f.metadata["engine"]]

    @classmethod
    def of(cls, args: EngineArgs | None, kwargs: dict[str, Any], caller: str = "LLM") -> EngineArgs:
        """`args` (default: every default) with `kwargs` on top; an unknown keyword is a TypeError
        naming it, as a signature would raise."""
        names = {f.name for f in dataclasses.fields(cls)}
        for key in kwargs:
            if key not in names:
                raise TypeError(f"{caller}() got an unexpected keyword argument {key!r}")
        return dataclasses.replace(args or cls(), **kwargs)

    @staticmethod
    def flag(f: dataclasses.Field) -> str:
        return f.metadata["flag"] or "--" + f.name.replace("_", "-")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, scope: str, *, defaults: bool = True) -> None:
        """The options of `scope` as flags of `parser` (dest: the field's name). Without `defaults`,
        a flag the command line does not give is absent from the namespace (`given`): for a
        command whose workload sets its own engine options (`hotswap bench`)."""
        group = parser.add_argument_group("engine options (hotswap.EngineArgs)")
        for f in cls.fields(scope):
            m = f.metadata
            default = f.default if defaults else argparse.SUPPRESS
            kw: dict[str, Any] = dict(dest=f.name, default=default, help=m["help"].replace("%", "%%"))
            if m["type"] is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = _flag_type(m["parse"]) if m["parse"] else m["type"]
                if m["choices"]:
                    kw["choices"] = list(m["choices"])
            group.add_argument(cls.flag(f), **kw)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, scope: str) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in cls.fields(scope)})

    @classmethod
    def given(cls, ns: argparse.Namespace, scope: str) -> dict[str, Any]:
        """The options of `scope` the command line gave (flags added with `defaults=False`)."""
        return {f.name: getattr(ns, f.name) for f in cls.fields(scope) if hasattr(ns, f.name)}

    def kwargs(self, scope: str | None = None) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in self.fields(scope)}


# ---- the docs' option tables -----------------------------------------------------------

HEADERS = {
    ("llm", "en"): "| option | default | meaning |",
    ("llm", "zh_cn"): "| 选项 | 默认值 | 含义 |",
    ("serve", "en"): "| flag | default | meaning |",
    ("serve", "zh_cn"): "| 参数 | 默认值 | 含义 |",
}


def _default_cell(f: dataclasses.Field, lang: str) -> str:
    doc = f.metadata["doc_default_zh" if lang == "zh_cn" else "doc_default"]
    if doc is not None:
        return doc
    if isinstance(f.default, str):
        return f'`"{f.default}"`'
    if f.default is None or isinstance(f.default, bool):
        return f"`{f.default}`"
    return str(f.default)


def markdown_rows(scope: str, lang: str = "en") -> list[str]:
    """One table row per option of `scope`: the Python name (llm) or the flag (serve, aot)."""
    rows = []
    for f in EngineArgs.fields(scope):
        if scope == "llm":
            name = f"`{f.name}`"
        elif f.metadata["type"] is bool:
            flag = EngineArgs.flag(f)
            name = f"`{flag}` / `--no-{flag[2:]}`"
        else:
            name = f"`{EngineArgs.flag(f)}`"
        text = f.metadata["help_zh" if lang == "zh_cn" else "help"]
        rows.append(f"| {name} | {_default_cell(f, lang)} | {text} |")
    return rows


def markdown_table(scope: str, lang: str = "en") -> str:
    return "\n".join([HEADERS[scope, lang], "|---|---|---|", *markdown_rows(scope, lang)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m hotswap.args --markdown {llm,serve} [--lang zh_cn]`: a docs option table."""
    p = argparse.ArgumentParser(prog="python -m hotswap.args", description=main.__doc__)
    p.add_argument("--markdown", required=True, choices=["llm", "serve"])
    p.add_argument("--lang", default="en", choices=["en", "zh_cn"])
    a = p.parse_args(argv)
    sys.stdout.write(markdown_table(a.markdown, a.lang))
    return 0


if __name__ == "__main__":
    sys.exit(main())

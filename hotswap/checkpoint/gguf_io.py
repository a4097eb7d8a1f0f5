"""GGUF files (llama.cpp's format) -> (ModelConfig, params) and a Tokenizer.

The only module that knows GGUF. A file is read with the `gguf` package (llama.cpp's
own reader and dequantizer) and turned into what an HF directory gives: an HF-style
config dict (-> `ModelConfig.from_hf`) and HF-named `[out, in]` tensors (->
`hf.params_from_hf`), so validation (`model/validate.py`) and the layout change stay
in one place; the engine checks the values for NaN/Inf where it places them. The tokenizer is rebuilt from the metadata with `tokenizers`
(`gguf_tokenizer.py`).

What llama.cpp's converter changes, undone here:
- tensor names (`blk.3.attn_q.weight` for `model.layers.3.self_attn.q_proj.weight`);
  Gemma's four norms per layer have their own (`post_attention_norm`, `ffn_norm` for
  the pre-FFN norm, `post_ffw_norm`); Qwen3-MoE's experts are stacked per projection
  (`ffn_gate_exps` ...), in the spec table's stacked HF order, and its expert counts
  are metadata (`expert_count`, `expert_used_count`, `expert_feed_forward_length`);
- for Llama, the rows of q and k are permuted per head so that ggml's rope, which
  rotates adjacent pairs (x0, x1), (x2, x3)..., computes what HF's `rotate_half`
  computes on the halves (x0, x_{d/2})...: `_unpermute` is its inverse. Qwen and Gemma
  files use ggml's NEOX rope, which is HF's, and are not permuted;
- Gemma's RMSNorm scales by (1 + w); the converter stores every `*norm.weight` as
  w + 1 and ggml multiplies by it. 1 is subtracted again here, as transformers' GGUF
  loader does, so the tensors are HF's;
- quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, K-quants, IQ*, ...), dequantized by
  `gguf.quants.dequantize` to float32 (exact), then cast to the engine's dtype. A block
  type the `gguf` package does not know, or cannot dequantize, is a `CheckpointError`
  naming the tensor.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import time
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import ml_dtypes
import numpy as np

from hotswap.checkpoint import converted, gguf_gemma, gguf_header, hf
from hotswap.checkpoint.gguf_tokenizer import tokenizer_from_metadata
from hotswap.checkpoint.tokenizer import Tokenizer
from hotswap.errors import CheckpointError, ConfigError, WeightsMismatch
from hotswap.kernels.qtensor import BY_GGML_TYPE, QTensor
from hotswap.model.config import ModelConfig
from hotswap.model.spec import EMBED, LM_HEAD, Params, hf_specs

Q = gguf.GGMLQuantizationType

# blk.{i}.<key> -> model.layers.{i}.<HF module>
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma: `ffn_norm` is the pre-FFN norm, and each sub-block has a norm on its output too.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Qwen3-MoE: the router (`ffn_gate_inp`, HF `[E, D]`) and each projection's experts stacked in
# one tensor (`ffn_gate_exps` ... , `[E, out, in]` in HF's order): the spec table's stacked rows
# (`model/spec.py`), taken under their stacked HF names as they are.
_MOE_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}


class _Arch(NamedTuple):
    hf_class: str
    model_type: str
    permuted: bool  # q/k rows permuted for ggml's adjacent-pair rope (see the module docstring)
    layer_names: dict[str, str]
    norm_shift: float  # what the converter added to every `*norm.weight`


# general.architecture -> how its files are written. Mistral files are written as "llama".
_ARCHS = {
    "llama": _Arch("LlamaForCausalLM", "llama", True, _LAYER_NAMES, 0.0),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", False, _LAYER_NAMES, 0.0),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", False, _LAYER_NAMES, 0.0),
    "gemma2": _Arch("Gemma2ForCausalLM", "gemma2", False, _GEMMA_LAYER_NAMES, 1.0),
    "gemma3": _Arch("Gemma3ForCausalLM", "gemma3_text", False, _GEMMA_LAYER_NAMES, 1.0),
    "qwen3moe": _Arch("Qwen3MoeForCausalLM", "qwen3_moe", False, _MOE_LAYER_NAMES, 0.0),
}

_GLOBAL_NAMES = {
    "token_embd.weight": EMBED,
    "output_norm.weight": "model.norm.weight",
    "output.weight": LM_HEAD,
}
EMBED_GGUF = "token_embd.weight"
_GGUF_VERSION = importlib.metadata.version("gguf")
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# general.file_type -> the dtype a file holds its weights in; quantized files load as float32,
# the one dtype their dequantized values are exact in (pass dtype= to cast).
_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}

# llama.cpp stores llama3 rope scaling as a tensor of per-frequency factors; the
# published Llama 3.x models all use these constants, with their own `factor`.
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def is_gguf(path: str | os.PathLike) -> bool:
    """A path that names a GGUF file (by its suffix: a directory is never one)."""
    return Path(path).suffix.lower() == ".gguf"


class _Reader(gguf.GGUFReader):
    """`gguf.GGUFReader`, refusing a tensor whose block type `gguf` does not know by its name
    (the reader's own error is a bare `ValueError: 99 is not a valid GGMLQuantizationType`)."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            _, name, _, _, kind, _ = field.parts
            if int(kind[0]) not in Q._value2member_map_:
                raise CheckpointError(
                    f"tensor {bytes(name).decode(errors='replace')!r}: GGUF block type {int(kind[0])} is "
                    f"unknown to the gguf package {_GGUF_VERSION} (known: {', '.join(q.name for q in Q)})"
                )
        super()._build_tensors(start_offs, fields)


class GGUFFile:
    """An opened GGUF file: its metadata (scalars and arrays as Python values) and tensors
    (`gguf_header.Tensor`, read through the header cache)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: not found (expected a .gguf file)")
        cached = gguf_header.load(self.path)
        if cached is not None:
            self.metadata, self.tensors = cached
            return
        start = time.perf_counter()
        try:
            reader = _Reader(self.path, "r")
        except CheckpointError as e:
            raise CheckpointError(f"{self.path}: {e}") from None
        except (ValueError, OSError) as e:  # bad magic, truncated header, ...
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({e})") from e
        self.metadata: dict[str, Any] = {}
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            try:
                self.metadata[name] = gguf_header.plain(field.contents())
            except (ValueError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path}: metadata {name} cannot be read ({e})") from e
        self.tensors = {
            t.name: gguf_header.Tensor(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), t.data)
            for t in reader.tensors
        }
        if time.perf_counter() - start > gguf_header.WORTH_CACHING_S:
            offsets = {t.name: t.data_offset for t in reader.tensors}
            gguf_header.store(self.path, self.metadata, self.tensors, offsets)

    def need(self, key: str) -> Any:
        if key not in self.metadata:
            raise ConfigError(f"{self.path}: GGUF metadata lacks {key!r}")
        return self.metadata[key]

    @property
    def arch(self) -> str:
        arch = self.need("general.architecture")
        if arch not in _ARCHS:
            raise ConfigError(
                f"{self.path}: GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHS)}"
            )
        return arch


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """An HF config.json dict from the GGUF metadata (and tensor list: tied head, vocab rows)."""
    arch = f.arch
    p = f"{arch}."
    heads = int(f.need(p + "attention.head_count"))
    kv_heads = int(f.metadata.get(p + "attention.head_count_kv", heads))
    hidden = int(f.need(p + "embedding_length"))
    head_dim = int(f.metadata.get(p + "attention.key_length", hidden // heads))
    rotary = int(f.metadata.get(p + "rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ConfigError(
            f"{f.path}: partial rotary embeddings (rope.dimension_count={rotary}) are not supported"
        )
    scaling = f.metadata.get(p + "rope.scaling.type", "none")
    if scaling not in ("none", "") and not arch.startswith("gemma"):
        raise ConfigError(f"{f.path}: rope scaling {scaling!r} is not supported")
    if EMBED_GGUF not in f.tensors:
        raise CheckpointError(f"{f.path}: no {EMBED_GGUF} tensor")
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": gguf_header.decimal32(f.metadata.get(p + "rope.freq_base", 10000.0)),
    }
    if "rope_freqs.weight" in f.tensors:
        rope.update(_llama3_rope(f, rope["rope_theta"], head_dim))
    eos = f.metadata.get("tokenizer.ggml.eos_token_id")
    file_type = int(f.metadata.get("general.file_type", -1))
    layers = int(f.need(p + "block_count"))
    cfg = {
        "architectures": [_ARCHS[arch].hf_class],
        "model_type": _ARCHS[arch].model_type,
        "vocab_size": int(f.tensors[EMBED_GGUF].shape[-1]),  # ggml lists dims innermost first
        "hidden_size": hidden,
        "intermediate_size": int(
            f.metadata.get(p + "feed_forward_length") or f.need(p + "expert_feed_forward_length")
        ),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": gguf_header.decimal32(f.metadata.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": rope,
        "max_position_embeddings": int(f.metadata.get(p + "context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "bos_token_id": f.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
        "dtype": _FILE_DTYPES.get(file_type, "float32"),
    }
    if arch == "qwen3moe":
        cfg.update(_moe_config(f, p))
    if arch.startswith("gemma"):
        cfg.pop("hidden_act")
        cfg.update(
            gguf_gemma.hf_config(f.metadata, arch, layers, hidden // heads, head_dim, rope, where=f.path)
        )
    return cfg


def _moe_config(f: GGUFFile, p: str) -> dict[str, Any]:
    """Qwen3-MoE's expert fields. llama.cpp makes every layer sparse and always renormalises the
    top-k weights (its `qwen3moe` graph), whatever the HF config said (`norm_topk_prob`)."""
    return {
        "num_experts": int(f.need(p + "expert_count")),
        "num_experts_per_tok": int(f.need(p + "expert_used_count")),
        "moe_intermediate_size": int(f.need(p + "expert_feed_forward_length")),
        "norm_topk_prob": True,
    }


def _llama3_rope(f: GGUFFile, theta: float, head_dim: int) -> dict[str, Any]:
    """The llama3 scaling whose per-frequency factors are the file's `rope_freqs.weight`.

    Only the factors are stored; the published constants are tried with the largest
    factor as `factor` and accepted when they reproduce every stored factor.
    """
    stored = np.asarray(_dequantize(f.tensors["rope_freqs.weight"]), np.float64).reshape(-1)
    factor = float(stored.max())
    c = _LLAMA3_ROPE
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (c["original_max_position_embeddings"] / wavelen - c["low_freq_factor"]) / (
        c["high_freq_factor"] - c["low_freq_factor"]
    )
    expected = np.where(
        wavelen < c["original_max_position_embeddings"] / c["high_freq_factor"],
        1.0,
        np.where(
            wavelen > c["original_max_position_embeddings"] / c["low_freq_factor"],
            factor,
            1.0 / ((1 - smooth) / factor + smooth),
        ),
    )
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-3):
        raise ConfigError(f"{f.path}: rope_freqs.weight is not a llama3 rope scaling hotswap can express")
    return {"rope_type": "llama3", "factor": factor, **c}


def hf_name(name: str, arch: str = "llama") -> str:
    """A GGUF tensor name -> its HF name (unknown names are kept, and rejected by the HF check)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    layer_names = _ARCHS[arch].layer_names
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
    return name


def _dequantize(t) -> np.ndarray:
    """One tensor's data as numpy in HF's `[out, in]` order (ggml's dims reversed)."""
    kind = Q(t.tensor_type)
    if kind in (Q.F32, Q.F16):
        return t.data  # a view of the memmapped file
    if kind == Q.BF16:
        return t.data.view(ml_dtypes.bfloat16)  # the reader hands BF16 over as raw bytes
    try:
        return gguf.quants.dequantize(t.data, kind)
    except NotImplementedError as e:
        raise CheckpointError(
            f"tensor {t.name!r}: GGUF block type {kind.name} cannot be dequantized by the gguf package "
            f"{_GGUF_VERSION} ({e})"
        ) from e


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `LlamaModel.permute` on q/k rows (see the module docstring)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(f: GGUFFile, cfg: ModelConfig, dtype: np.dtype, *, blocks: bool = False) -> dict[str, Any]:
    """Every weight of the file under its HF name, `[out, in]`, q/k unpermuted, Gemma's
    norms unshifted.

    Quantized tensors are dequantized one at a time and cast to `dtype` at once, so
    the float32 copy of one tensor is the largest extra memory held. With `blocks`
    (`quantization="gguf"`), a matmul weight or the embedding stored in a block format the
    engine serves (`qtensor.BY_GGML_TYPE`) is kept as its bytes instead: a host QTensor whose
    `data` is the file's `[out, bytes]` rows (memory-mapped; q/k rows unpermuted), the other
    tensors dequantized as above.
    """
    arch = _ARCHS[f.arch]
    specs = hf_specs(cfg) if blocks else {}
    out: dict[str, Any] = {}
    for name, t in f.tensors.items():
        if name == "rope_freqs.weight":  # folded into the config's rope scaling
            continue
        spec, fmt = specs.get(hf_name(name, f.arch)), BY_GGML_TYPE.get(int(t.tensor_type))
        if fmt is not None and spec is not None and (spec.quantizable or spec.path == ("embed",)):
            a = np.asarray(t.data).reshape(t.data.shape[0], -1)
        else:
            a = _dequantize(t)
            if arch.norm_shift and name.endswith("norm.weight"):
                a = np.asarray(a, np.float32) - np.float32(arch.norm_shift)  # in float32, as transformers
            if a.dtype == np.float32 and dtype != np.float32:
                a = a.astype(dtype)
            fmt = None
        if arch.permuted and name.endswith((".attn_q.weight", ".attn_k.weight")):
            a = _unpermute(a, cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
        out[hf_name(name, f.arch)] = a if fmt is None else blocks_of(a, fmt, spec)
    return out


def blocks_of(data: np.ndarray, fmt: str, spec) -> QTensor:
    """A GGUF tensor's `[out, bytes]` block rows as the QTensor serving `spec`'s row. The
    embedding is held as the `[D, V]` head it ties to: its rows are the head's outputs
    (`qtensor.take_rows`)."""
    shape = (spec.shape[1], spec.shape[0]) if spec.path == ("embed",) else tuple(spec.shape)
    return QTensor(data, None, fmt, shape, 1 if spec.path == ("embed",) else spec.n_in)


def in_gguf_terms(f: GGUFFile, e: WeightsMismatch) -> WeightsMismatch:
    """The validator's error (HF names) with the file, the GGUF name of its tensor and, for an
    expert tensor, the metadata its expected shape came from."""
    message = str(e)
    gguf_names = {hf_name(n, f.arch): n for n in f.tensors}
    hf_tensor = message.split(":", 1)[0]
    name = gguf_names.get(hf_tensor)
    if name is None:
        return WeightsMismatch(f"{f.path}: {message}")
    said = ""
    if name.endswith(("_exps.weight", "ffn_gate_inp.weight")):
        said = f" ({f.arch}.expert_count={f.metadata.get(f.arch + '.expert_count')} in the metadata)"
    return WeightsMismatch(f"{f.path}: {name}{said}: {message}")


def model_config(f: GGUFFile, *, dtype: str | None = None) -> ModelConfig:
    """The ModelConfig a GGUF file's metadata states; `dtype` overrides the file's."""
    return ModelConfig.from_hf(hf_config(f), dtype=dtype)


def cached_hf_tensors(f: GGUFFile, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The file's HF-named tensors in `cfg`'s dtype, dequantized once and cached
    (`converted.py`): a second read loads them back."""
    target = hf.np_dtype(cfg.dtype)
    tensors = converted.load(f.path, cfg, target)
    if tensors is None:
        start = time.perf_counter()
        tensors = hf_tensors(f, cfg, target)
        if time.perf_counter() - start > converted.WORTH_CACHING_S:
            converted.store(f.path, cfg, tensors, target)
    return tensors


def load_gguf(
    path: str | os.PathLike, *, dtype: str | None = None
) -> tuple[ModelConfig, Params, Tokenizer | None]:
    """A GGUF file as (ModelConfig, numpy params, Tokenizer or None), converted on the host: a
    tool's view of the file (tests' oracle, `hotswap create-model`). The engine reads a GGUF
    through the ingest pipeline (`weights/readers.py`), on its devices."""
    f = GGUFFile(path)
    cfg = model_config(f, dtype=dtype)
    try:
        params = hf.params_from_hf(cfg, cached_hf_tensors(f, cfg))
    except WeightsMismatch as e:
        raise in_gguf_terms(f, e) from e
    return cfg, params, tokenizer_from_metadata(f.metadata, where=str(f.path))

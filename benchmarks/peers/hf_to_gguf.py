"""An HF-format Llama checkpoint -> an f32 or bf16 GGUF file llama.cpp loads, with llama.cpp's `gguf` writer.

Runs in the llama.cpp peer venv (it needs `gguf`, `numpy`, `safetensors`):

    benchmarks/peers/.venv-llama_cpp/bin/python benchmarks/peers/hf_to_gguf.py MODEL_DIR OUT.gguf [bfloat16]

In bf16 the matrices are rounded to bf16 (to nearest even, as hotswap's cast rounds them) and the
norm vectors stay f32, as llama.cpp's own converter writes a bf16 model.

Covers what `hotswap.checkpoint.create` writes for arch="llama" (tied or untied embeddings,
GQA, default rope, one or several safetensors files). The benchmark feeds token ids, so the
tokenizer only has to load: the byte-level BPE of tokenizer.json becomes a "gpt2" vocab with
its merges, padded with unused tokens up to the model's vocab_size (llama.cpp sizes the
embedding table from the token list).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file


class ConversionError(Exception):
    """The checkpoint is not a plain Llama this converter understands (names what is not)."""


def interleave_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """q_proj/k_proj rows from HF's rotate-half rope layout to llama.cpp's interleaved one.

    HF pairs dimension i with i + head_dim/2 of each head; llama.cpp's LLAMA_ROPE_TYPE_NORM
    pairs 2i with 2i+1. Reordering each head's output rows [h0 | h1] -> [h0_0, h1_0, h0_1, ...]
    makes both compute the same attention scores. w: [n_heads * head_dim, d_model].
    """
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, cols).swapaxes(1, 2).reshape(rows, cols)


def read_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{model_dir}: no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def check_config(cfg: dict) -> None:
    if cfg.get("model_type") != "llama":
        raise ConversionError(f"model_type={cfg.get('model_type')!r}: only llama is converted")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConversionError(f"rope_type={rope.get('rope_type')!r}: only default rope is converted")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ConversionError("attention_bias/mlp_bias: biases are not converted")


def write_vocab(w: gguf.GGUFWriter, model_dir: Path, cfg: dict) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    model = tok["model"]
    if model["type"] != "BPE":
        raise ConversionError(f"tokenizer model {model['type']!r}: only byte-level BPE is converted")
    vocab = {**model["vocab"], **{t["content"]: t["id"] for t in tok.get("added_tokens", [])}}
    n = cfg["vocab_size"]
    by_id = {i: t for t, i in vocab.items()}
    if max(by_id) >= n:
        raise ConversionError(f"tokenizer has id {max(by_id)} >= vocab_size {n}")
    special = {t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    tokens, types = [], []
    for i in range(n):  # ids the tokenizer never produces keep their embedding rows as unused tokens
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # the ByteLevel pre-tokenizer's regex is GPT-2's
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    bos = cfg.get("bos_token_id")
    eos = cfg.get("eos_token_id")
    if bos is not None:
        w.add_bos_token_id(int(bos))
    if eos is not None:
        w.add_eos_token_id(int(eos[0] if isinstance(eos, list) else eos))
    w.add_add_bos_token(False)  # prompts arrive as ids, BOS included or not by the caller


def convert(model_dir: Path, out: Path, dtype: str = "float32") -> Path:
    cfg = json.loads((model_dir / "config.json").read_text())
    check_config(cfg)
    t = read_tensors(model_dir)
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head

    tmp = out.with_suffix(".tmp")  # a killed conversion must not leave a GGUF that looks done
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float((cfg.get("rope_parameters") or cfg).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if dtype not in ("float32", "bfloat16"):
        raise ConversionError(f"dtype {dtype!r}: float32 or bfloat16")
    bf16 = dtype == "bfloat16"
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    write_vocab(w, model_dir, cfg)

    def add(name: str, x: np.ndarray) -> None:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if bf16 and x.ndim == 2:
            qtype = gguf.GGMLQuantizationType.BF16
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, x)

    add("token_embd.weight", t["model.embed_tokens.weight"])
    add("output_norm.weight", t["model.norm.weight"])
    if not cfg.get("tie_word_embeddings", False):  # tied: no output.weight, llama.cpp reuses token_embd
        if "lm_head.weight" not in t:
            raise ConversionError("tie_word_embeddings is false but lm_head.weight is missing")
        add("output.weight", t["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", t[p + "input_layernorm.weight"])
        add(f"blk.{i}.attn_q.weight", interleave_rope(t[p + "self_attn.q_proj.weight"], n_head))
        add(f"blk.{i}.attn_k.weight", interleave_rope(t[p + "self_attn.k_proj.weight"], n_kv))
        add(f"blk.{i}.attn_v.weight", t[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", t[p + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_norm.weight", t[p + "post_attention_layernorm.weight"])
        add(f"blk.{i}.ffn_gate.weight", t[p + "mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", t[p + "mlp.up_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", t[p + "mlp.down_proj.weight"])

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    print(convert(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:]))

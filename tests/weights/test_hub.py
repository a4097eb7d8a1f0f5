"""Hub IDs (`LLM("org/name")`, `hotswap serve org/name`) resolved offline from a prepared HF cache.

The cache is laid out as huggingface_hub lays it out (`models--org--name/{blobs,refs,snapshots}`,
snapshot files symlinked into `blobs/`) and checked with huggingface_hub's own `scan_cache_dir`.
HF_HUB_OFFLINE=1 throughout: nothing here reaches the network.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants

from hotswap.checkpoint import hub
from hotswap.engine.llm import LLM, SamplingParams
from hotswap.errors import CheckpointNotFound

REPO = "hotswap-test/tiny-llama"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
KW = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64, page_size=16, warmup=False)


def write_hub_cache(cache: Path, repo_id: str, commits: dict[str, Path], refs: dict[str, str]) -> Path:
    """Lay out `commits` (commit hash -> model dir) and `refs` (branch -> commit) as the Hub cache does."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for commit, src in commits.items():
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in sorted(src.iterdir()):
            data = f.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir(exist_ok=True)
    for ref, commit in refs.items():
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return repo


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, tiny_dir, tiny_dir_b):
    """HF_HOME with one repo: `main` at commit A (seed 0), branch `seed1` at commit B (seed 1); offline."""
    home = tmp_path / "hf"
    write_hub_cache(
        home / "hub", REPO, {COMMIT_A: tiny_dir, COMMIT_B: tiny_dir_b}, {"main": COMMIT_A, "seed1": COMMIT_B}
    )
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads both once, at import: pin them too, so no code path can go online.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    return home / "hub"


def _greedy(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [
        o.outputs[0].token_ids for o in llm.generate(["Once upon a time", "The wind"], sp, use_tqdm=False)
    ]


def test_cache_layout_is_huggingface_hubs(hf_cache):
    info = huggingface_hub.scan_cache_dir(hf_cache)
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    assert {r.commit_hash for r in repo.revisions} == {COMMIT_A, COMMIT_B}
    assert {ref for r in repo.revisions for ref in r.refs} == {"main", "seed1"}


def test_locate_paths_and_ids(hf_cache, tiny_dir, tmp_path):
    assert hub.locate(tiny_dir) == tiny_dir and hub.locate(str(tiny_dir)) == tiny_dir
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert hub.locate(gguf) == gguf  # files are the loader's business
    snap = hf_cache / f"models--{REPO.replace('/', '--')}" / "snapshots"
    assert hub.locate(REPO) == snap / COMMIT_A
    assert hub.locate(REPO, revision="seed1") == snap / COMMIT_B
    assert hub.locate(REPO, revision=COMMIT_B) == snap / COMMIT_B
    assert hub.display_name(REPO, snap / COMMIT_A) == REPO
    assert hub.display_name(tiny_dir, tiny_dir) == tiny_dir.name
    for s in ("org/name", "Qwen/Qwen2.5-0.5B-Instruct"):
        assert hub.looks_like_repo_id(s)
    for s in ("./org/name", "/abs/dir", "~/x/y", "a/b/c", "org/name.gguf", "no-slash", "org/na me"):
        assert not hub.looks_like_repo_id(s)


def test_llm_from_hub_id_matches_local_dir(hf_cache, tiny_dir, tiny_dir_b):
    local = _greedy(LLM(tiny_dir, **KW))
    llm = LLM(REPO, **KW)
    assert llm.model_id == REPO and REPO in repr(llm)
    assert _greedy(llm) == local
    assert llm.tokenizer is not None and llm.tokenizer.chat_template is not None
    other = LLM(REPO, revision="seed1", **KW)
    assert _greedy(other) == _greedy(LLM(tiny_dir_b, **KW)) != local


def test_missing_model_offline_names_id_revision_and_cache(hf_cache):
    with pytest.raises(CheckpointNotFound) as e:
        LLM("hotswap-test/not-downloaded", **KW)
    msg = str(e.value)
    assert "'hotswap-test/not-downloaded'" in msg and "revision main" in msg
    assert str(hf_cache) in msg and "HF_HUB_OFFLINE=1" in msg
    assert e.value.__cause__ is None and e.value.__suppress_context__  # one error, not the Hub's traceback
    with pytest.raises(CheckpointNotFound, match=r"revision nope\).*" + str(hf_cache)):
        hub.locate(REPO, revision="nope")  # a revision the cache has no ref for


def test_env_set_after_import_is_honoured(hf_cache, monkeypatch, tmp_path):
    """HF_HUB_CACHE set after huggingface_hub was imported still decides where to look."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(CheckpointNotFound, match="elsewhere"):
        hub.locate(REPO)
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # only the env var says offline now
    guarded = _no_network(huggingface_hub.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", guarded)
    assert hub.locate(REPO).name == COMMIT_A
    assert guarded.calls == [True]


def _no_network(real):
    def wrapped(*args, **kwargs):
        wrapped.calls.append(kwargs.get("local_files_only"))
        assert kwargs.get("local_files_only"), "would have gone online"
        return real(*args, **kwargs)

    wrapped.calls = []
    return wrapped


def test_not_a_path_nor_an_id(hf_cache, tiny_dir):
    for bad in ("./no/such/dir", "no-such-dir", "a/b/c"):
        with pytest.raises(
            CheckpointNotFound, match="no such file or directory, and not a Hugging Face Hub ID"
        ):
            LLM(bad, **KW)
    with pytest.raises(CheckpointNotFound, match="applies to Hub IDs only"):
        hub.locate(tiny_dir, revision="main")


def test_unknown_repo_online(monkeypatch, hf_cache):
    from huggingface_hub.errors import RepositoryNotFoundError

    class Response:  # what HfHubHTTPError reads of an HTTP response
        status_code = 404
        headers: dict = {}
        request = None

    def not_found(*args, **kwargs):
        raise RepositoryNotFoundError("404 Client Error: Repository Not Found", response=Response())

    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_found)
    with pytest.raises(
        CheckpointNotFound, match=r"'org/typo' \(revision main\): no such repository on the Hub"
    ):
        hub.locate("org/typo")


def test_serve_missing_hub_id_is_one_line(hf_cache, capsys):
    from hotswap.cli import main

    assert main(["serve", "hotswap-test/not-downloaded", "--revision", "v1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hotswap serve: error: model 'hotswap-test/not-downloaded' (revision v1)")
    assert "\n" not in err and str(hf_cache) in err and "Traceback" not in err

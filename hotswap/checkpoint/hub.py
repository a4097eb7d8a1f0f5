"""Where a model lives: a local path as given, or a Hugging Face Hub repo id resolved to a snapshot.

`locate("org/name")` goes through `huggingface_hub.snapshot_download`, so the files land
in (and are read from) the standard Hub cache that transformers and vLLM share, and the
Hub's own environment applies: `HF_HOME` / `HF_HUB_CACHE` (where), `HF_HUB_OFFLINE=1`
(cache only), `HF_TOKEN` (gated repos). Only the files the loader reads are fetched
(`ALLOW_PATTERNS`), never `.bin`, `.pt` or optimizer states.

Every way of not finding a model is one `CheckpointNotFound` naming the ID, the
revision and the cache directory, instead of the Hub client's traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

from hotswap.errors import CheckpointNotFound

# What `hf.load_hf_dir` and `Tokenizer.from_dir` read; nothing else is downloaded.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
]


def looks_like_repo_id(model: str) -> bool:
    """`org/name` as the Hub spells it; `./x`, `/abs`, `~/x` and `x.gguf` are paths."""
    if model.count("/") != 1 or model.startswith((".", "/", "~")) or model.endswith(".gguf"):
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")  # huggingface_hub's spelling


def hub_cache() -> Path:
    """The Hub cache directory: `HF_HUB_CACHE`, else `$HF_HOME/hub`, else huggingface_hub's default.

    Read at call time: huggingface_hub reads these once, when it is imported, and a notebook
    or a test may set them later.
    """
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return Path(env).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def is_offline() -> bool:
    """`HF_HUB_OFFLINE` (or transformers' `TRANSFORMERS_OFFLINE`), now or when huggingface_hub was imported."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def locate(model: str | Path, revision: str | None = None) -> Path:
    """The local path to load `model` from: an existing path as is, else a Hub snapshot directory.

    `revision` (a branch, tag or commit hash; default `main`) applies to Hub IDs only.
    An existing file (e.g. a `.gguf`) is returned as is: the loader decides what it reads.
    """
    path = Path(model).expanduser()
    if path.exists():
        if revision is not None:
            raise CheckpointNotFound(
                f"revision={revision!r} applies to Hub IDs only, but {str(model)!r} is a local path"
            )
        return path
    name = str(model)
    if isinstance(model, Path) or not looks_like_repo_id(name):
        raise CheckpointNotFound(
            f"model {name!r}: no such file or directory, and not a Hugging Face Hub ID (org/name)"
        )
    return _snapshot(name, revision)


def display_name(model: str | Path, located: Path) -> str:
    """How to call the model: the Hub ID as given, else the directory's name (a file's stem)."""
    if Path(model).expanduser() != located:
        return str(model)
    return located.stem if located.is_file() else located.name


def _snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache()
    where = f"model {repo_id!r} (revision {revision or 'main'})"
    offline = is_offline()
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache,
                allow_patterns=ALLOW_PATTERNS,
                local_files_only=offline,
            )
        )
    except LocalEntryNotFoundError:  # includes an incomplete snapshot (a download cut short)
        how = (
            "HF_HUB_OFFLINE=1 forbids downloading it"
            if offline
            else "the Hub could not be reached to download it"
        )
        raise CheckpointNotFound(
            f"{where}: not a local path and not in the Hugging Face cache at {cache}; {how}. "
            f"Download it once with network access (`hf download {repo_id}`), "
            "or set HF_HOME / HF_HUB_CACHE to the cache that holds it"
        ) from None
    except GatedRepoError:
        raise CheckpointNotFound(
            f"{where}: the repository is gated; accept its terms on the Hub and set HF_TOKEN (cache: {cache})"
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointNotFound(
            f"{where}: no such repository on the Hub (or it is private: set HF_TOKEN), "
            f"and not a local path (cache: {cache})"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointNotFound(f"{where}: the repository has no such revision (cache: {cache})") from None
    except HfHubHTTPError as e:
        raise CheckpointNotFound(
            f"{where}: the Hub answered {e.__class__.__name__}: {e} (cache: {cache})"
        ) from None

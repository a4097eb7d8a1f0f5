"""The repository passes its own pre-commit hooks (ruff, whitespace, end of file; `tools/`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pre_commit_passes_on_repository(tmp_path):
    # Check a clone of HEAD: pre-commit stashes unstaged edits in the tree it runs in,
    # which must never happen to a developer's working copy.
    clone = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    bin_dir = str(Path(sys.executable).parent)  # ruff, python and pre-commit of this environment
    env = dict(
        os.environ, PRE_COMMIT_HOME=str(tmp_path / "pc"), PATH=bin_dir + os.pathsep + os.environ["PATH"]
    )
    proc = subprocess.run(
        [os.path.join(bin_dir, "pre-commit"), "run", "--all-files"],
        cwd=clone,
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_end_of_file_hook_flags_a_missing_or_doubled_newline(tmp_path):
    files = {"ok.txt": b"a\n", "empty.txt": b"", "none.txt": b"a", "two.txt": b"a\n\n"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "eof.py"), *(str(tmp_path / n) for n in files)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    flagged = {Path(line.split(":")[0]).name for line in proc.stdout.splitlines()}
    assert flagged == {"none.txt", "two.txt"}


def _package_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "hotswap").rglob("*.py"))}


def _files_matching(pattern: str) -> dict[str, int]:
    import re

    found = {path: len(re.findall(pattern, text)) for path, text in _package_sources().items()}
    return {path: n for path, n in found.items() if n}


def test_one_decode_site_one_finiteness_check_one_safetensors_parser():
    """A payload is decoded in one place, weights are checked for NaN/Inf by one module, and
    one codec parses safetensors (files and payloads alike), with one dtype table."""
    assert _files_matching(r"(?<!def )\bdecode_payload\(") == {"hotswap/weights/readers.py": 1}
    assert set(_files_matching(r"\bnp\.isfinite|cpu_finite\.all_finite|isfinite\(jnp\.sum")) == {
        "hotswap/kernels/finite.py"
    }
    assert set(_files_matching(r"\"BF16\":|struct\.unpack\(\"<Q\"")) == {"hotswap/checkpoint/payload.py"}
    assert not _files_matching(r"from safetensors|import safetensors")  # no second parser


def test_one_validator_one_finiteness_pass():
    """Every weight source is validated by one module, beside the spec table: each
    "missing/unexpected tensor" error is raised there. Whether and which values are checked
    for NaN/Inf is decided in one module, the update's one pass (`kernels/finite.py` computes
    it); the Tunix integration only renames that error with the NNX path."""
    raised = _files_matching(r"(?s)WeightsMismatch\(\s*f?\"[^\"]*\b(?:missing|unexpected)\b")
    assert set(raised) == {"hotswap/model/validate.py"}, raised
    assert set(_files_matching(r"\bfinite\.(?:FiniteCheck|non_finite)\(")) == {
        "hotswap/weights/finiteness.py"
    }
    assert set(_files_matching(r"(?<!class )\bNonFiniteWeights\(")) == {
        "hotswap/weights/finiteness.py",
        "hotswap/integrations/tunix.py",
    }


def test_no_private_name_is_imported_across_modules():
    """A module's private names (`_check_manifest`) stay in it: one concept, one module."""
    import ast

    private = [
        f"{path}: {node.module}.{a.name}"
        for path, text in _package_sources().items()
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hotswap")
        for a in node.names
        if a.name.startswith("_")
    ]
    assert not private, private


def test_checkpoint_reads_the_model_not_the_engine():
    imports = _files_matching(r"from hotswap\.engine|import hotswap\.engine")
    assert not {path for path in imports if path.startswith("hotswap/checkpoint/")}


def _unit(module: str) -> str:
    """The package (`hotswap.engine`) or top-level module (`hotswap.errors`) a module belongs to."""
    return ".".join(module.split(".")[:2])


def _is_module(name: str) -> bool:
    path = ROOT / name.replace(".", "/")
    return path.is_dir() or path.with_suffix(".py").is_file()


def _import_graph() -> dict[str, dict[str, str]]:
    """unit -> {imported unit: an example "module imports module"}, over every import in the package
    (function-local ones too: a lazy import is still an arrow)."""
    import ast

    graph: dict[str, dict[str, str]] = {}
    for path, text in _package_sources().items():
        module = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] in ("hotswap", "benchmarks") and _is_module(name):
                    a, b = _unit(module), _unit(name)
                    if a != b:
                        graph.setdefault(a, {}).setdefault(b, f"{module} imports {name}")
    return graph


def test_import_graph_has_no_cycle_and_never_reaches_benchmarks():
    """Packages by concept, arrows one way: no cycle between `hotswap` packages or top-level modules
    (`model/` below `weights/` below `engine/`, ...), and the package never imports `benchmarks/`."""
    graph = _import_graph()
    benchmarks = [why for edges in graph.values() for unit, why in edges.items() if unit == "benchmarks"]
    assert not benchmarks, benchmarks

    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            unit, path = stack.pop()
            for nxt in graph.get(unit, {}):
                if nxt == start:
                    return path + [nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    for unit in sorted(graph):
        cycle = cycle_from(unit)
        assert cycle is None, (
            " -> ".join(cycle) + ": " + "; ".join(graph[a][b] for a, b in zip(cycle, cycle[1:], strict=False))
        )


def test_the_package_reaches_benchmarks_by_no_dynamic_import():
    """Nor through `importlib`/`__import__` with a name in a string: `hotswap bench` runs them in a
    child process (hotswap/cli/bench.py)."""
    import ast

    found = []
    for path, text in _package_sources().items():
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func, arg = ast.unparse(node.func), node.args[0]
            if isinstance(arg, ast.JoinedStr) and arg.values:  # f"benchmarks.{name}": its fixed start
                arg = arg.values[0]
            name = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else ""
            if (func.endswith("import_module") or func == "__import__") and name.startswith("benchmarks"):
                found.append(f"{path}: {func}({name!r})")
    assert not found, found


# ---- the ingest pipeline's shape: each check is a function of the sources, run on the package
# ---- and on a copy with a planted violation, so every check is shown to fail when it should.

# How a function tells weight sources apart: two or more of these in one function is a ladder
# of source forms, which belongs in the reader table (`weights/readers.py`) as rows.
_FORM_TESTS = {
    "transfer": r"TransferRef",
    "adapter": r"AdapterSource",
    "path": r"PathLike",
    "bytes": r"\bbytes\b|memoryview|bytearray",
    "mapping": r"\bMapping\b",
    "flax": r"\bnnx\.(?:State|Module)\b",
}
# The validator's entry points (`model/validate.py`): called from the plan only.
_VALIDATORS = (
    "hf_tensors",
    "tree",
    "layout",
    "ordered_layout",
    "nnx_variables",
    "lora_tensors",
    "lora_targets",
    "same_model",
)
# The host converter for tools (`hotswap create-model`, `load_hf_dir`, the tests' oracle) keeps
# its own call; no engine, weights or api module may reach it (`test_the_engine_never_reaches_the_host_converter`).
_VALIDATOR_SITES = {"hotswap/weights/plan.py", "hotswap/checkpoint/hf.py"}
# Packages and top-level modules, bottom first: a module imports only from its own rank or below.
_LAYERS = (
    ("hotswap.errors", "hotswap.cache_dir", "hotswap.host_memory"),
    ("hotswap.toolcalls", "hotswap.speculative"),  # speculative: the option's value, parsed
    ("hotswap.args",),
    ("hotswap.engine_config",),
    ("hotswap.kernels",),
    ("hotswap.model",),
    ("hotswap.checkpoint",),
    ("hotswap.weights",),
    ("hotswap.programs",),
    ("hotswap.engine",),
    ("hotswap.integrations", "hotswap.rl", "hotswap.api"),
    ("hotswap.fleet",),  # replicas running `hotswap serve`, driven over its routes
    ("hotswap.cli",),
)


def _source_ladders(sources: dict[str, str]) -> list[str]:
    import ast
    import re

    found = []
    for path, text in sources.items():
        if path == "hotswap/weights/readers.py":
            continue
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            kinds = set()
            for node in ast.walk(fn):
                if not isinstance(node, ast.Call):
                    continue
                func = ast.unparse(node.func)
                if func == "isinstance" and len(node.args) == 2:
                    kinds |= {
                        k for k, pat in _FORM_TESTS.items() if re.search(pat, ast.unparse(node.args[1]))
                    }
                elif func.endswith("is_gguf"):
                    kinds.add("gguf")
            # chat.py's message content (str or a list of parts) is not a weight source
            if len(kinds) >= 2 and kinds != {"bytes", "mapping"}:
                found.append(f"{path}: {fn.name} tests {sorted(kinds)}")
    return found


def _validator_calls(sources: dict[str, str]) -> set[str]:
    import re

    pattern = r"\bvalidate\.(?:" + "|".join(_VALIDATORS) + r")\("
    return {path for path, text in sources.items() if re.search(pattern, text)}


def _private_attributes(sources: dict[str, str]) -> list[str]:
    """`module._name` where `module` is a hotswap module this file imported."""
    import ast

    found = []
    for path, text in sources.items():
        tree = ast.parse(text)
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hotswap"):
                modules |= {a.asname or a.name for a in node.names if _is_module(f"{node.module}.{a.name}")}
            elif isinstance(node, ast.Import):
                modules |= {a.asname for a in node.names if a.asname and a.name.startswith("hotswap")}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{path}: {node.value.id}.{node.attr}")
    return found


def _upward_imports(graph: dict[str, dict[str, str]]) -> list[str]:
    rank = {unit: i for i, layer in enumerate(_LAYERS) for unit in layer}
    found = []
    for a, edges in graph.items():
        for b, why in edges.items():
            if b == "hotswap":  # the package's lazy public names (`hotswap/__init__.py`)
                continue
            assert a in rank and b in rank, f"{a} or {b} has no layer in _LAYERS: give it one"
            if rank[b] > rank[a]:
                found.append(why)
    return found


def test_sources_are_told_apart_in_one_table():
    """No function outside the reader table tells weight-source forms apart (an `isinstance`
    ladder over paths, bytes, transfer refs, adapters, NNX states)."""
    assert not _source_ladders(_package_sources())


def test_the_validator_is_called_from_the_plan_only():
    assert _validator_calls(_package_sources()) == _VALIDATOR_SITES


def test_the_engine_never_reaches_the_host_converter():
    """`hf.params_from_hf` / `load_hf_dir` / `gguf_io.load_gguf` convert on the host for tools;
    the engine's weights go through the pipeline."""
    users = _files_matching(r"\b(?:params_from_hf|load_hf_dir|load_gguf)\(")
    engine_side = {
        p for p in users if p.split("/")[1] in ("engine", "weights", "api", "programs", "integrations")
    }
    assert not engine_side, engine_side


def test_no_private_name_is_reached_by_attribute():
    assert not _private_attributes(_package_sources())


def test_imports_point_down_the_layers():
    assert not _upward_imports(_import_graph())


def test_each_structure_check_fails_on_a_planted_violation():
    sources = _package_sources()
    engine = "hotswap/engine/engine.py"
    planted = dict(sources)
    planted[engine] += (
        "\n\ndef _resolve(source):\n"
        "    if isinstance(source, transfer.TransferRef):\n        return 1\n"
        "    if isinstance(source, (bytes, bytearray)):\n        return 2\n"
        "    return validate.tree(source, None)\n"
    )
    assert any(engine in f and "_resolve" in f for f in _source_ladders(planted))
    assert engine in _validator_calls(planted)
    planted = dict(sources)
    planted["hotswap/api/management.py"] += (
        "\nfrom hotswap.checkpoint import payload\nLOOKS = payload._looks_like_safetensors\n"
    )
    assert _private_attributes(planted) == ["hotswap/api/management.py: payload._looks_like_safetensors"]
    graph = _import_graph()
    graph.setdefault("hotswap.weights", {})["hotswap.engine"] = (
        "hotswap.weights.x imports hotswap.engine.engine"
    )
    assert _upward_imports(graph) == ["hotswap.weights.x imports hotswap.engine.engine"]


def test_module_names_are_unique_across_the_package():
    """No two modules share a name and mean different things (`errors.py` and `api/errors.py`,
    `config.py` and `model/config.py` once did): a name says which concept it holds."""
    from collections import Counter

    names = Counter(
        p.name for p in (ROOT / "hotswap").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")
    )
    assert not [n for n, k in names.items() if k > 1]

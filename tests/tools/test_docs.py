"""README.md and docs/*.md stay true to the tree.

- Every repository path they cite (backticked or not, and every relative link) exists: a file,
  a folder, or, for a brace or glob pattern (``quant.{h,cu}``, ``tests/**/*.cu``), at least one
  match. Exceptions are listed below with their reason: files of other repositories that the
  compat pages name as the sources they were checked against, and outputs a run creates.
- Every dotted module path they cite (``moecomm.runtime.placement.PlacementController``) names a
  module of the tree, and a name that module defines or imports.
- Every ``bench/results/`` file they cite is tracked by git (a figure names a committed result),
  and every benchmark paragraph of the README's "Benchmarks" names one.
- The README's layout tables name every top-level module and package of ``python/moecomm`` and
  ``serving/moecomm_serving``, and nothing that does not exist.
"""

from __future__ import annotations

import glob
import itertools
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
TOP_DIRS = ("csrc", "python", "serving", "tests", "bench", "docs", "tools", "engines", "bindings")
TOP_DIRS += ("cmake",)
TOP_FILES = ("Makefile", "CMakeLists.txt", "pyproject.toml", "README.md")
PATH = re.compile(
    rf"(?<![\w./-])((?:{'|'.join(TOP_DIRS)})/[\w./*{{}},-]*[\w*/}}]|(?:{'|'.join(TOP_FILES)})\b)"
)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
MODULE = re.compile(r"`((?:moecomm|moecomm_serving)(?:\.\w+)+)")
# Paths of other repositories, named as what moecomm was checked against (DeepEP, NIXL-EP).
EXTERNAL = {
    "csrc/kernels/legacy/internode_ll.cu": "DeepEP",
    "csrc/kernels/legacy/utils.cuh": "DeepEP",
    "csrc/kernels/legacy/intranode.cu": "DeepEP",
    "csrc/legacy/buffer.hpp": "DeepEP",
    "csrc/elastic/buffer.hpp": "DeepEP",
    "csrc/kernels/internode_ll.cu": "DeepEP V1",
    "csrc/kernels/ibgda_device.cuh": "DeepEP V1",
    "tests/legacy/test_low_latency.py": "DeepEP",
    "tests/legacy/test_intranode.py": "DeepEP",
    "tests/elastic/test_ep.py": "DeepEP",
    "docs/legacy.md": "DeepEP",
    "csrc/nixl_ep.cpp": "NIXL-EP",
    "csrc/config.hpp": "NIXL-EP",
    "csrc/kernels/nixl_ep_ll.cu": "NIXL-EP",
    "tests/elastic/elastic.py": "NIXL-EP",
}
# Written by a run, committed when it has happened: the GPU check's results (docs/gpu-check.md).
RUNTIME_OUTPUTS = ("bench/results/gpu/",)
# Dotted names in backticks that are not module paths.
NOT_MODULES = {"moecomm.engine_alias": "the alias's logger (engines/alias)"}
PACKAGES = ("python/moecomm", "serving/moecomm_serving")


def expand(pattern: str) -> list[str]:
    """``a.{h,cc}`` -> ``a.h``, ``a.cc`` (one level of braces, which is all the docs use)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [pattern[: m.start()] + alt + pattern[m.end() :] for alt in m.group(1).split(",")]


def cited_paths() -> list[tuple[str, int, str]]:
    """(doc, line, path) for every repository path a doc cites."""
    out = []
    for doc in DOCS:
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                out.append((doc.name, i, m.group(1).rstrip(".,")))
            for m in LINK.finditer(line):
                target = m.group(1)
                if "://" in target or target.startswith("mailto:"):
                    continue
                rel = (doc.parent / target).resolve().relative_to(ROOT)
                out.append((doc.name, i, str(rel)))
    return out


def exists(path: str) -> bool:
    return any(
        (ROOT / p).exists()
        if not any(c in p for c in "*?[")
        else glob.glob(str(ROOT / p), recursive=True)
        for p in expand(path)
    )


def tracked(prefix: str) -> set[str]:
    out = subprocess.run(
        ["git", "ls-files", "--", prefix], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


def test_every_cited_path_exists():
    missing = []
    for doc, line, path in cited_paths():
        if path in EXTERNAL or path.startswith(RUNTIME_OUTPUTS):
            continue
        if not exists(path):
            missing.append(f"{doc}:{line}: {path}")
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_the_exceptions_are_still_cited_and_still_not_ours():
    cited = {path for _, _, path in cited_paths()}
    stale = [p for p in EXTERNAL if p not in cited or (ROOT / p).exists()]
    assert not stale, f"EXTERNAL entries no longer cited, or now in this tree: {stale}"


def _module_file(parts: list[str]) -> tuple[Path, list[str]] | None:
    """The source file of the longest module prefix of `parts`, and the names after it."""
    top = {"moecomm": ROOT / "python", "moecomm_serving": ROOT / "serving"}[parts[0]]
    for n in range(len(parts), 0, -1):
        base = top.joinpath(*parts[:n])
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if candidate.is_file():
                return candidate, parts[n:]
    return None


# Native modules built from bindings/: their names are checked against the binding sources.
NATIVE = {"_C": "bindings", "_cuda": "bindings/cuda", "_nvshmem": "bindings/nvshmem"}


def _defines(source: str, name: str) -> bool:
    return bool(
        re.search(
            rf"^\s*(?:def|class|async def)\s+{name}\b|^\s*{name}\s*[:=]|\bimport\b[^\n]*\b{name}\b"
            rf"|^\s+{name},?$|\"{name}\"",
            source,
            re.M,
        )
    )


def test_every_cited_module_path_exists():
    bad = []
    for doc in DOCS:
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            for m in MODULE.finditer(line):
                if m.group(1) in NOT_MODULES:
                    continue
                parts = m.group(1).split(".")
                if len(parts) > 1 and parts[1] in NATIVE:
                    sources = "".join(p.read_text() for p in (ROOT / NATIVE[parts[1]]).glob("*.cc"))
                    if len(parts) > 2 and f'"{parts[2]}"' not in sources:
                        bad.append(f"{doc.name}:{i}: {m.group(1)} (not bound)")
                    continue
                found = _module_file(parts)
                if found is None:
                    bad.append(f"{doc.name}:{i}: {m.group(1)} (no such module)")
                    continue
                path, rest = found
                if rest and not _defines(path.read_text(), rest[0]):
                    bad.append(f"{doc.name}:{i}: {m.group(1)} ({rest[0]} not in {path.name})")
    assert not bad, "cited module paths that do not resolve:\n" + "\n".join(bad)


def test_every_cited_result_file_is_committed():
    committed = tracked("bench/results")
    cited = {
        (doc, line, path)
        for doc, line, path in cited_paths()
        if path.startswith("bench/results/") and not path.startswith(RUNTIME_OUTPUTS)
    }
    loose = sorted(
        f"{d}:{ln}: {p}"
        for d, ln, p in cited
        if not all(
            q in committed or any(c.startswith(q.rstrip("/") + "/") for c in committed)
            for q in expand(p)
        )
    )
    assert not loose, "result files the docs cite that git does not track:\n" + "\n".join(loose)


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README has no '## {title}' section"
    return m.group(1)


def test_every_benchmark_paragraph_names_a_committed_result():
    """Each paragraph of "Benchmarks" that opens with a bold title states figures: it names the
    committed result file they come from."""
    committed = tracked("bench/results")
    section = _section(README.read_text(), "Benchmarks")
    paragraphs = [p for p in re.split(r"\n\s*\n", section) if p.startswith("**")]
    assert paragraphs, "no benchmark paragraph found"
    bad = []
    for p in paragraphs:
        title = p.split("**")[1]
        results = re.findall(r"bench/results/[\w./-]+\.json", p)
        if not results:
            bad.append(f"{title}: names no bench/results/*.json")
        bad += [f"{title}: {r} is not committed" for r in results if r not in committed]
    assert not bad, "\n".join(bad)


def top_level_entries(package: str) -> set[str]:
    """``x.py`` for every module and ``x/`` for every package directly in `package`."""
    root = ROOT / package
    mods = {p.name for p in root.glob("*.py")}
    pkgs = {f"{p.parent.name}/" for p in root.glob("*/__init__.py")}
    return mods | pkgs


def layout_names(package: str) -> set[str]:
    """The names in the first column of the README table under ``### `package` ``."""
    text = _section(README.read_text(), "Layout")
    m = re.search(rf"^### `{re.escape(package)}/?`\n(.*?)(?=^### |\Z)", text, re.M | re.S)
    assert m, f"README's Layout has no '### `{package}`' table"
    names = set()
    for line in m.group(1).splitlines():
        cells = line.split("|")
        if len(cells) > 2 and not set(cells[1].strip()) <= set("-: "):
            names |= set(re.findall(r"`([^`]+)`", cells[1]))
    return names


def test_the_layout_tables_match_the_packages():
    problems = []
    for package in PACKAGES:
        have, listed = top_level_entries(package), layout_names(package)
        if have - listed:
            problems.append(f"{package}: not in the README's layout: {sorted(have - listed)}")
        if listed - have:
            problems.append(
                f"{package}: in the layout but not in the tree: {sorted(listed - have)}"
            )
    assert not problems, "\n".join(problems)


def test_the_path_scan_handles_patterns_and_exceptions():
    """The checks above can fail: patterns expand, a missing path is missing."""
    assert expand("csrc/kernels/cuda/quant.{h,cu}") == [
        "csrc/kernels/cuda/quant.h",
        "csrc/kernels/cuda/quant.cu",
    ]
    assert exists("csrc/kernels/cuda/quant.{h,cu}") and exists("tests/**/*.cu")
    assert not exists("csrc/no_such_folder/") and not exists("tests/no_such_*.py")
    found = [m.group(1) for m in PATH.finditer("see `docs/model.md`, tests/x.py; Makefile.")]
    assert found == ["docs/model.md", "tests/x.py", "Makefile"]
    assert list(itertools.islice(MODULE.finditer("`moecomm.ops.quant`"), 1))


CITATION = re.compile(r"\b(docs/[\w.-]+\.md|DESIGN\.md)\b(?:,?\s+\"([^\"]+)\")?")


def cited_sections() -> list[tuple[str, int, str, str | None]]:
    """(file, line, doc, section) for every doc page the code cites, with the section it names."""
    out = []
    for folder in ("python", "serving", "tests", "bench", "tools", "engines", "csrc", "bindings"):
        for path in sorted((ROOT / folder).rglob("*")):
            if (
                path.suffix not in (".py", ".h", ".cc", ".cu", ".cuh", ".sh")
                or "build" in path.parts
            ):
                continue
            if path == Path(__file__).resolve():
                continue  # names examples
            text = path.read_text()
            # A citation may wrap: join each line with the next.
            lines = text.splitlines()
            for i, line in enumerate(lines, 1):
                joined = line + " " + (lines[i].lstrip(" #/*") if i < len(lines) else "")
                for m in CITATION.finditer(joined):
                    if m.start() < len(line):
                        out.append((str(path.relative_to(ROOT)), i, m.group(1), m.group(2)))
    return out


def test_the_notes_the_code_cites_exist():
    """Code that cites a design note names a page of docs/ (and a section of it that exists: a
    heading that starts with the words cited, or a bold lead)."""
    bad = []
    for where, line, doc, section in cited_sections():
        if doc in EXTERNAL:
            continue
        page = ROOT / doc
        if not page.is_file():
            bad.append(f"{where}:{line}: {doc} does not exist")
            continue
        if section:
            text = page.read_text()
            heading = re.search(rf"^#+ {re.escape(section)}", text, re.M)
            lead = re.search(rf"\*\*{re.escape(section)}\.?\*\*", text)
            if not (heading or lead):
                bad.append(f'{where}:{line}: {doc} has no section "{section}"')
    assert not bad, "\n".join(bad)

"""docs/env.md is the one table of every ``MOECOMM_*`` variable, and the tree agrees with it.

Scanned: every file git tracks or would track (``git ls-files -co --exclude-standard``) under the
folders below, plus the Makefile and pyproject.toml; CMakeLists.txt for its cache options only
(its other ``MOECOMM_*`` names are CMake's own variables: source lists, ``MOECOMM_CUDA_ENABLED``).
A name ending in ``_`` is a prefix (``startswith("MOECOMM_NVSHMEM_")``), not a variable.

Checked both ways: every name in the code has a row; every row is used in the code. Every name
README.md or docs/ mentions has a row. Each row's "read where" files exist and name the variable.
Each variable is read (``os.environ.get``/``[...]``/``in``, ``os.getenv``) in at most one module
of python/ and serving/ together — the first file of its row — and in at most one module of
tests/; bench/, tools/ and engines/ set variables for the processes they start (bench/soak/soak.py
also saves and restores one), so they are left out of that rule.
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "env.md"
SCANNED_DIRS = ("python", "serving", "tools", "bench", "tests", "engines", "csrc", "bindings")
SCANNED_FILES = ("Makefile", "pyproject.toml")
# Committed benchmark output quotes the environment it ran in; it is not code.
SKIPPED_DIRS = ("bench/results/",)
# This file names made-up variables to test its own scan.
SELF = "tests/tools/test_env_table.py"
NAME = re.compile(r"\bMOECOMM_[A-Z0-9_]*[A-Z0-9]\b")
CMAKE_OPTION = re.compile(r"set\((MOECOMM_[A-Z0-9_]+)\b[^)]*\bCACHE\b")
ROW = re.compile(r"^\|\s*`(MOECOMM_[A-Z0-9_]+)`\s*\|([^|]*)\|")
# Areas inside which one module reads each variable (see the module docstring).
ONE_READER_AREAS = {"python+serving": ("python/", "serving/"), "tests": ("tests/",)}


def tree_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "--", *SCANNED_DIRS, *SCANNED_FILES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    files = []
    for rel in sorted(set(out.split())):
        if rel.startswith(SKIPPED_DIRS) or rel == SELF or not (ROOT / rel).is_file():
            continue  # a file deleted in the work tree is still listed until committed
        files.append(ROOT / rel)
    return files


def read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (UnicodeDecodeError, OSError):
        return None  # images, archives


def names_in_code() -> dict[str, set[str]]:
    """{variable: files that name it}."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in tree_files():
        text = read_text(path)
        if text is None:
            continue
        for name in NAME.findall(text):
            found[name].add(str(path.relative_to(ROOT)))
    cmake = (ROOT / "CMakeLists.txt").read_text()
    for name in CMAKE_OPTION.findall(cmake):
        found[name].add("CMakeLists.txt")
    return found


def table_rows() -> dict[str, str]:
    """{variable: its "read where" cell}, in the order of the table."""
    rows: dict[str, str] = {}
    for line in TABLE.read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} has two rows in docs/env.md"
            rows[m.group(1)] = m.group(2)
    return rows


def read_where_files(cell: str) -> list[str]:
    return [t for t in re.findall(r"`([^`]+)`", cell) if "/" in t or (ROOT / t).is_file()]


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _env_constants(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """{constant name: the variables it holds} over every module: ``TOKEN_ENV = "MOECOMM_..."``."""
    consts: dict[str, set[str]] = defaultdict(set)
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                value = node.value.value
                if isinstance(value, str) and NAME.fullmatch(value):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            consts[target.id].add(value)
    return consts


def _variables(arg: ast.AST, consts: dict[str, set[str]]) -> set[str]:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and NAME.fullmatch(arg.value):
        return {arg.value}
    key = arg.id if isinstance(arg, ast.Name) else getattr(arg, "attr", None)
    return set(consts.get(key, ())) if key else set()


def reads(tree: ast.Module, consts: dict[str, set[str]]) -> set[str]:
    """The MOECOMM_* variables a module reads from the environment."""
    got: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            env_get = isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value)
            getenv = (isinstance(f, ast.Attribute) and f.attr == "getenv") or (
                isinstance(f, ast.Name) and f.id == "getenv"
            )
            if env_get or getenv:
                got |= _variables(node.args[0], consts)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if _is_environ(node.value):
                got |= _variables(node.slice, consts)
        elif (
            isinstance(node, ast.Compare)
            and isinstance(node.ops[0], ast.In | ast.NotIn)
            and _is_environ(node.comparators[0])
        ):
            got |= _variables(node.left, consts)
    return got


def python_readers() -> dict[str, dict[str, set[str]]]:
    """{area: {variable: modules of that area that read it}}."""
    trees = {}
    for path in tree_files():
        if path.suffix == ".py":
            trees[str(path.relative_to(ROOT))] = ast.parse(path.read_text(), str(path))
    consts = _env_constants(trees)
    readers: dict[str, dict[str, set[str]]] = {a: defaultdict(set) for a in ONE_READER_AREAS}
    for rel, tree in trees.items():
        for area, prefixes in ONE_READER_AREAS.items():
            if rel.startswith(prefixes):
                for var in reads(tree, consts):
                    readers[area][var].add(rel)
    return readers


def test_every_variable_in_the_code_has_a_row():
    missing = sorted(set(names_in_code()) - set(table_rows()))
    where = {n: sorted(names_in_code()[n]) for n in missing}
    assert not missing, f"MOECOMM_* variables missing from docs/env.md: {where}"


def test_every_row_is_used_in_the_code():
    unused = sorted(set(table_rows()) - set(names_in_code()))
    assert not unused, f"docs/env.md rows that no code uses: {unused}"


def test_the_docs_name_only_variables_of_the_table():
    rows = table_rows()
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    unknown = {f"{p.relative_to(ROOT)}: {n}" for p in docs for n in NAME.findall(p.read_text())} - {
        f"{p.relative_to(ROOT)}: {n}" for p in docs for n in rows
    }
    assert not unknown, f"variables the docs name that docs/env.md does not: {sorted(unknown)}"


def test_each_row_names_files_that_exist_and_name_the_variable():
    bad = []
    for name, cell in table_rows().items():
        files = read_where_files(cell)
        if not files:
            bad.append(f"{name}: no file in 'read where'")
        for rel in files:
            path = ROOT / rel
            if not path.is_file():
                bad.append(f"{name}: {rel} does not exist")
            elif name not in path.read_text():
                bad.append(f"{name}: {rel} does not name it")
    assert not bad, "\n".join(bad)


def test_each_variable_is_read_in_one_module_and_the_table_says_which():
    rows = table_rows()
    problems = []
    for area, by_var in python_readers().items():
        for var, modules in sorted(by_var.items()):
            if len(modules) > 1:
                problems.append(f"{var} is read in {len(modules)} modules of {area}: {modules}")
            elif area == "python+serving":
                first = (read_where_files(rows.get(var, "")) or ["(no row)"])[0]
                if first not in modules:
                    problems.append(f"{var} is read in {modules}; docs/env.md says {first}")
    assert not problems, "\n".join(problems)


def test_the_reader_scan_sees_each_kind_of_read():
    """The checks above can fail: the AST scan finds literal names, constants (imported ones
    too), subscripts and ``in`` tests, and ignores writes."""
    src = (
        "import os\nV = 'MOECOMM_A'\n"
        "os.environ.get('MOECOMM_B')\nos.getenv(V)\nos.environ['MOECOMM_C']\n"
        "'MOECOMM_D' in os.environ\nos.environ['MOECOMM_E'] = '1'\nos.environ.pop('MOECOMM_F')\n"
        "x = mod.OTHER_ENV\nos.environ.get(mod.OTHER_ENV)\n"
    )
    tree = ast.parse(src)
    consts = _env_constants({"m": tree, "n": ast.parse("OTHER_ENV = 'MOECOMM_G'")})
    assert reads(tree, consts) == {"MOECOMM_A", "MOECOMM_B", "MOECOMM_C", "MOECOMM_D", "MOECOMM_G"}

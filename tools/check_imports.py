#!/usr/bin/env python3
"""Fails on an import circle among the project's modules, on an import from a lower layer to a
higher one, and on private names crossing modules.

The graph has one node per module of ``python/`` and ``serving/`` (packages, dotted names) and of
``bench/`` and ``tools/`` (script folders: their modules import each other by bare name, the
folder being on ``sys.path``). Every import statement is an edge, wherever it stands: an import
inside a function (a lazy import) runs as surely as one at the top, so a lazy import back still
closes a circle, and so does an import under ``if TYPE_CHECKING:``: it never runs, but the two
modules still depend on each other (reported "type only"; such an import is not an upward
arrow, since no code of the higher layer runs). Not counted:

- the implicit import of parent packages: ``import pkg.sub`` runs ``pkg/__init__`` first, but
  that alone does not make ``pkg/__init__ -> pkg.sub -> pkg`` a circle. ``from pkg import name``
  is an edge to ``pkg`` (its ``__init__``) only when ``name`` is not a submodule;
- modules outside the tree (the standard library, torch) and compiled ones (``moecomm._C``): a
  name that ``pkg/__init__`` does not bind and no source file provides is taken for one;
- ``importlib.import_module`` and other dynamic imports (their target is a runtime string).

Each strongly connected component of two or more modules is printed with the edges inside it
(file:line of every import statement that makes them). Inside the packages listed in
``PRIVATE_CHECKED``, a name with a leading underscore imported from another module
(``from m import _x``, or ``m._x`` on an imported module) is reported too: a module's private
names are its own.

Layers (``LAYERS``, bottom first): a module belongs to the layer whose package is the longest
prefix of its name, and an import from a module to a module of a higher layer is an upward
arrow, reported with its file:line, lazy imports included (a lazy import runs too). The library
(``moecomm``) is the bottom layer, so it never imports the serving layer; inside
``moecomm_serving`` each package is a layer (docs: README "Layout"). Modules outside every layer
(``moecomm_serving/__init__``, scripts) are not checked. Exit status 1 when anything is
reported, 0 otherwise; standard library only.

Usage: ``python tools/check_imports.py [--root DIR]`` (default: this checkout).
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Folders holding packages (dotted module names below them) and folders of scripts (bare names).
PACKAGE_DIRS = ("python", "serving")
SCRIPT_DIRS = ("bench", "tools")
# Packages whose modules must not import each other's private names. ops/ was cleared of them
# with its import circle; wire/ was built without them.
PRIVATE_CHECKED = ("moecomm.ops", "moecomm.wire")
# Layers, bottom first: a module may import its own layer's modules and lower layers' only. The
# serving layer's order is its dependency order: plain data (types), the KV cache the model
# writes into (kv), the model, the engine that runs it, the OpenAI API over the engine, the
# prefill/decode split over the API, and the command that builds all of them (cli).
LAYERS = (
    "moecomm",
    "moecomm_serving.types",
    "moecomm_serving.kv",
    "moecomm_serving.model",
    "moecomm_serving.engine",
    "moecomm_serving.api",
    "moecomm_serving.disagg",
    "moecomm_serving.cli",
)


@dataclass
class Module:
    name: str  # dotted for packages; "bench/common" style for scripts
    path: Path
    is_package: bool  # an __init__.py
    script_dir: str | None  # the script folder it lives in, or None in a package
    tree: ast.Module | None = None
    bound: set[str] = field(default_factory=set)  # top-level names the module binds
    has_getattr: bool = False  # a module __getattr__ (names bound lazily)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    lazy: bool  # inside a function
    typed: bool = False  # under `if TYPE_CHECKING:`: never runs, still a dependency


@dataclass(frozen=True)
class PrivateUse:
    src: str
    dst: str
    name: str
    line: int


def _discover(root: Path) -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for top in PACKAGE_DIRS:
        base = root / top
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base)
            if any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
                continue
            parts = list(rel.with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            if parts:
                mods[".".join(parts)] = Module(".".join(parts), path, is_pkg, None)
    for top in SCRIPT_DIRS:
        base = root / top
        if base.is_dir():
            for path in sorted(base.glob("*.py")):
                name = f"{top}/{path.stem}"
                mods[name] = Module(name, path, False, top)
    for m in mods.values():
        m.tree = ast.parse(m.path.read_text(encoding="utf-8"), filename=str(m.path))
        m.bound, m.has_getattr = _top_level_names(m.tree)
    return mods


def _top_level_names(tree: ast.Module) -> tuple[set[str], bool]:
    """Names bound at module level (defs, classes, assignments, imports), also under if/try."""
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for a in node.names:
                names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for part in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, part, []))
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)
    return names, "__getattr__" in names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module):
    """(node, lazy, typed) for every import statement; typed: under `if TYPE_CHECKING:`."""
    out = []

    def visit(node: ast.AST, lazy: bool, typed: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, lazy, True)
            for child in node.orelse:
                visit(child, lazy, typed)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append((node, lazy, typed))
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner, typed)

    visit(tree, False, False)
    return out


class Graph:
    def __init__(self, root: Path):
        self.mods = _discover(root)
        self.edges: list[Edge] = []
        self.private: list[PrivateUse] = []
        for m in self.mods.values():
            self._scan(m)

    # -- resolution ------------------------------------------------------------------------------

    def _lookup(self, dotted: str, here: Module) -> str | None:
        """The node of an absolute module name as ``here`` would import it, or None if outside."""
        if here.script_dir is not None:
            first = dotted.split(".")[0]
            local = f"{here.script_dir}/{first}"
            if local in self.mods:  # the script folder comes first on sys.path
                return local if dotted == first else None
        return dotted if dotted in self.mods else None

    def _package_of(self, m: Module) -> str:
        if m.is_package:
            return m.name
        return m.name.rpartition(".")[0] if m.script_dir is None else ""

    def _absolute(self, node: ast.ImportFrom, m: Module) -> str | None:
        if not node.level:
            return node.module
        pkg = self._package_of(m).split(".") if self._package_of(m) else []
        if node.level - 1 > len(pkg):
            return None  # beyond the top package: an error at run time, not an edge
        base = pkg[: len(pkg) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def _from_targets(self, node: ast.ImportFrom, m: Module):
        """(target node, imported name or None for a submodule, local name) for each name of a
        from-import."""
        base = self._absolute(node, m)
        if base is None:
            return
        base_node = self._lookup(base, m) if base else None
        for alias in node.names:
            sub = self._lookup(f"{base}.{alias.name}", m) if base else None
            if sub is not None:
                yield sub, None, alias.asname or alias.name  # an edge to it, not to the package
            elif base_node is not None:
                target = self.mods[base_node]
                # A name a package neither binds nor provides lazily is a submodule outside the
                # source tree (a compiled extension): no edge to the package's __init__. A plain
                # module has no submodules: the name is its own (or an error at run time).
                bound = alias.name in target.bound or target.has_getattr
                if not target.is_package or alias.name == "*" or bound:
                    yield base_node, alias.name, alias.asname or alias.name

    def _add(self, edge: Edge) -> None:
        """One edge per import statement, however many names it imports."""
        if not self.edges or self.edges[-1] != edge:
            self.edges.append(edge)

    # -- scanning --------------------------------------------------------------------------------

    def _private_checked(self, *names: str) -> bool:
        return all(any(n == p or n.startswith(p + ".") for p in PRIVATE_CHECKED) for n in names)

    def _scan(self, m: Module) -> None:
        aliases: dict[str, str] = {}  # local name -> module node, for the m._x check
        for node, lazy, typed in _imports(m.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    # "import a.b.c" needs a.b.c; a and a.b come first only as its parents. A
                    # name not in the tree is outside it or compiled (import moecomm._C).
                    target = self._lookup(alias.name, m)
                    if target is not None and target != m.name:
                        self._add(Edge(m.name, target, node.lineno, lazy, typed))
                        if alias.asname:
                            aliases[alias.asname] = target
                continue
            for target, name, local in self._from_targets(node, m):
                if target == m.name:
                    continue
                self._add(Edge(m.name, target, node.lineno, lazy, typed))
                if name is None:
                    aliases[local] = target
                elif _private(name) and self._private_checked(m.name, target):
                    self.private.append(PrivateUse(m.name, target, name, node.lineno))
        for node in ast.walk(m.tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _private(node.attr)
            ):
                target = aliases[node.value.id]
                sub = self._lookup(f"{target}.{node.attr}", m)
                if sub is None and self._private_checked(m.name, target):
                    self.private.append(PrivateUse(m.name, target, node.attr, node.lineno))

    # -- circles ---------------------------------------------------------------------------------

    def circles(self) -> list[list[str]]:
        """Strongly connected components of two or more modules (Tarjan, iterative)."""
        succ: dict[str, list[str]] = {n: [] for n in self.mods}
        for e in self.edges:
            if e.dst not in succ[e.src]:
                succ[e.src].append(e.dst)
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        sccs = []
        for start in sorted(self.mods):
            if start in index:
                continue
            work = [(start, 0)]
            while work:
                v, i = work.pop()
                if i == 0:
                    index[v] = low[v] = len(index)
                    stack.append(v)
                    on_stack.add(v)
                if i < len(succ[v]):
                    work.append((v, i + 1))
                    w = succ[v][i]
                    if w not in index:
                        work.append((w, 0))
                    elif w in on_stack:
                        low[v] = min(low[v], index[w])
                    continue
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        sccs.append(sorted(comp))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
        return sorted(sccs)


def layer_of(module: str, layers: tuple[str, ...] = LAYERS) -> int | None:
    """The index in `layers` of the layer `module` belongs to (longest package prefix), or
    None outside every layer."""
    best = None
    for i, pkg in enumerate(layers):
        if (module == pkg or module.startswith(pkg + ".")) and (
            best is None or len(pkg) > len(layers[best])
        ):
            best = i
    return best


def upward(g: Graph, layers: tuple[str, ...] = LAYERS) -> list[Edge]:
    """The imports from a lower layer to a higher one."""
    out = []
    for e in g.edges:
        src, dst = layer_of(e.src, layers), layer_of(e.dst, layers)
        if src is not None and dst is not None and dst > src and not e.typed:
            out.append(e)
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def report(root: Path, out=sys.stdout) -> int:
    """Prints every circle and private-name use; returns how many problems there are."""
    g = Graph(root)
    problems = 0
    for n, comp in enumerate(g.circles(), 1):
        problems += 1
        members = set(comp)
        print(f"import circle {n} ({len(comp)} modules): {', '.join(comp)}", file=out)
        for e in sorted(g.edges, key=lambda e: (e.src, e.line)):
            if e.src in members and e.dst in members:
                rel = g.mods[e.src].path.relative_to(root)
                how = " (lazy, inside a function)" if e.lazy else ""
                how += " (type only)" if e.typed else ""
                print(f"  {rel}:{e.line}: {e.src} -> {e.dst}{how}", file=out)
    for e in sorted(upward(g), key=lambda e: (e.src, e.line)):
        problems += 1
        rel = g.mods[e.src].path.relative_to(root)
        how = " (lazy, inside a function)" if e.lazy else ""
        up = f"{LAYERS[layer_of(e.src)]} below {LAYERS[layer_of(e.dst)]}"
        print(f"upward import: {rel}:{e.line}: {e.src} -> {e.dst}{how} ({up})", file=out)
    for p in sorted(g.private, key=lambda p: (p.src, p.line)):
        problems += 1
        rel = g.mods[p.src].path.relative_to(root)
        print(f"private name: {rel}:{p.line}: {p.src} uses {p.dst}.{p.name}", file=out)
    if problems == 0:
        print(
            f"check_imports: {len(g.mods)} modules, {len(g.edges)} imports, no circle, "
            f"no upward import across {len(LAYERS)} layers",
            file=out,
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = ap.parse_args(argv)
    return 1 if report(args.root.resolve()) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The architecture rules of docs/architecture.md, checked on the source (no JAX needed)."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxlight"

#: The fit core: the files docs/architecture.md calls the core.
CORE = sorted([*(PACKAGE / "_fit").glob("*.py"), *(PACKAGE / "checkpoint").glob("*.py"),
               PACKAGE / "step" / "_step.py", PACKAGE / "state" / "_state.py",
               PACKAGE / "module" / "_module.py", *(PACKAGE / "metrics").glob("*.py"),
               PACKAGE / "callbacks" / "_base.py"])
MAX_CORE_LINES = 400
#: Every other file of the package but the recipes.
MAX_LINES = 450
#: The only modules at the package's root (docs/architecture.md, 'The layers').
ROOT_MODULES = {"__init__.py", "_errors.py", "_version.py"}
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: pathlib.Path, modules) -> list[tuple[str, int, bool]]:
    """(imported jaxlight module, line, inside a function) for every import in `path`."""
    tree = ast.parse(path.read_text())
    local = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
             for n in ast.walk(f)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        elif (isinstance(node, ast.Constant) and node.value in modules
              and path.name == "__init__.py"):
            targets = [node.value]  # a lazy name's module (a PEP 562 table) is an import too
        else:
            continue
        found += [(t, node.lineno, id(node) in local and not isinstance(node, ast.Constant))
                  for t in targets if t in modules and t != name]
    return found


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_jaxlight_modules():
    modules = _modules()
    # Every import counts, function-local ones too: a circle hidden in a function is a circle.
    graph = {m: [t for t, _, _ in _imports(m, p, modules)] for m, p in modules.items()}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]


def _says_why(lines: list[str], lineno: int) -> bool:
    """A comment on the import's line, or above its block of imports (a `try:` line counts)."""
    if "#" in lines[lineno - 1]:
        return True
    above = lineno - 2
    while above >= 0 and lines[above].strip().startswith(("import ", "from ")):
        if "#" in lines[above]:
            return True
        above -= 1
    text = lines[above].strip() if above >= 0 else ""
    return text.startswith("#") or (text.startswith("try:") and "#" in text)


def test_no_function_local_import_of_jaxlight_and_every_local_import_says_why():
    modules = _modules()
    offenders = []
    for name, path in modules.items():
        lines = path.read_text().splitlines()
        for target, line, local in _imports(name, path, modules):
            if local:
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {target} locally")
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom) and not _says_why(lines,
                                                                                  node.lineno):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: a local import "
                                     "without a comment saying why")
    assert offenders == []


def layers() -> dict[str, int]:
    """docs/architecture.md's layer table: dotted node name -> layer (1 = bottom)."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("| layer | folder | owns |"):]
    found = {}
    for row in table.splitlines()[2:]:
        if not row.startswith("|"):
            break
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[1]):
            node = ".".join(["jaxlight", *name.removesuffix("/").removesuffix(".py").split("/")])
            found[node] = int(cells[0])
    return found


def _node(module: str, nodes) -> str:
    """The layer node a module belongs to: its package's `__init__` where that has a layer of its
    own (a facade re-exporting from higher layers), else the longest listed folder holding it."""
    if f"{module}.__init__" in nodes:
        return f"{module}.__init__"
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in nodes:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} is in no layer of docs/architecture.md")


def against_the_layers(graph: dict[str, list[str]], layer: dict[str, int]) -> list[str]:
    """`a -> b` for every import from a lower layer up to a higher (or an equal, other) one."""
    bad = []
    for a, targets in graph.items():
        for b in targets:
            na, nb = _node(a, layer), _node(b, layer)
            if na != nb and layer[nb] >= layer[na]:
                bad.append(f"{a} (layer {layer[na]}) imports {b} (layer {layer[nb]})")
    return sorted(set(bad))


def test_imports_run_only_down_the_documented_layers():
    modules = _modules()
    layer = layers()
    assert len(layer) >= 20, layer  # the table was found and read
    graph = {m: [t for t, _, _ in _imports(m, p, modules)] for m, p in modules.items()}
    assert against_the_layers(graph, layer) == []


def test_the_layer_check_finds_an_import_up():
    layer = {"jaxlight._errors": 1, "jaxlight.state": 2, "jaxlight.step": 3}
    graph = {"jaxlight.state._state": ["jaxlight.step._step", "jaxlight._errors"],
             "jaxlight.step._step": ["jaxlight.state._state"]}
    assert against_the_layers(graph, layer) == [
        "jaxlight.state._state (layer 2) imports jaxlight.step._step (layer 3)"]


def test_every_folder_is_a_documented_layer_with_a_docstring():
    layer = layers()
    folders = {"jaxlight." + ".".join(p.parent.relative_to(PACKAGE).parts)
               for p in PACKAGE.glob("*/__init__.py")}
    assert folders - set(layer) == set()  # a new folder gets its row in the table
    folders |= {"jaxlight." + ".".join(p.parent.relative_to(PACKAGE).parts)
                for p in PACKAGE.rglob("*/__init__.py")}
    facades = {n for n in layer if n.endswith(".__init__")}
    assert set(layer) - folders - facades - {"jaxlight._errors", "jaxlight._version"} == set()
    undocumented = [str(p.relative_to(ROOT)) for p in PACKAGE.glob("*/__init__.py")
                    if not ast.get_docstring(ast.parse(p.read_text()))]
    assert undocumented == []


def test_the_root_holds_only_the_documented_modules():
    assert {p.name for p in PACKAGE.glob("*.py")} == ROOT_MODULES


def test_no_file_outside_the_recipes_is_long():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if "recipes" not in p.relative_to(PACKAGE).parts
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_core_files_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in CORE}
    assert len(sizes) >= 20, sizes  # the list above still names the core
    assert {p: n for p, n in sizes.items() if n > MAX_CORE_LINES} == {}


def _private_names(path: pathlib.Path, classes: set[str]) -> set[str]:
    """The underscored attributes and methods of `classes` (as `self._x` or `def _x`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for item in ast.walk(node):
                if (isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name)
                        and item.value.id == "self"):
                    names.add(item.attr)
                elif isinstance(item, ast.FunctionDef):
                    names.add(item.name)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_nothing_outside_the_core_uses_private_fit_attributes():
    # Fit's and Session's underscored names, and those Fit had before the core was split.
    names = (_private_names(PACKAGE / "_fit" / "_facade.py", {"Fit"})
             | _private_names(PACKAGE / "_fit" / "_session.py", {"Session"})
             | {"_module", "_spec", "_shardings", "_compiled", "_tx", "_state", "_global_step",
                "_epoch", "_batch_idx", "_stop_reason", "_val_data", "_val_every", "_limit",
                "_train_data", "_compile_train_step", "_choose_layout"})
    assert {"_session", "_setup", "_spec", "_shardings", "_compiled"} <= names
    # `anything._name` for those names, but not `self._name` (another class's own attribute).
    pattern = re.compile(r"\b(?!self\b|cls\b)[A-Za-z_]\w*\.(" + "|".join(sorted(names))
                         + r")\b")
    hits = []
    for folder in (PACKAGE, ROOT / "tests", ROOT / "benchmarks"):
        for path in folder.rglob("*.py"):
            if (PACKAGE / "_fit") in path.parents or path.name == "test_architecture.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = re.sub(r"\"[^\"]*\"|'[^']*'", '""', line.split("#")[0]).strip()
                if code.startswith(("import ", "from ")):
                    continue
                if pattern.search(code) or re.search(r"\bfit\._[a-zA-Z]", code):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert hits == []

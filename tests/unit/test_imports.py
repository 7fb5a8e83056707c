"""The package's import graph has no cycle: every module's imports of the package's own modules,
those at the top and those inside functions alike, read from the source (ast). A cycle held open
only by an import placed inside a function is still a cycle: the names it reaches for belong in a
module below both (names.py, settings.py, batch.py, checkpoint.py, ...)."""

import ast
import pathlib

import sglang_dsv4_ascend

PACKAGE = pathlib.Path(sglang_dsv4_ascend.__file__).parent
NAME = "sglang_dsv4_ascend"


def _modules() -> dict:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: pathlib.Path, modules: dict) -> set:
    """The package modules `module` imports anywhere in its source. `from X import Y` counts as an
    import of X.Y when that is a module, else of X; an import of one of the module's own parent
    packages is left out (Python has always run those first)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = {f"{target}.{a.name}" for a in node.names} & set(modules)
            found |= subs or {target}
    return {m for m in found if m in modules and m != module and not module.startswith(m + ".")}


def _cycle(graph: dict):
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert sum(map(len, graph.values())) > 100  # the walk sees the imports
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_walk_finds_a_cycle_held_open_inside_a_function(tmp_path):
    """The broken variant: two modules importing each other, one of them inside a function."""
    pkg = tmp_path / NAME
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    modules = {NAME: pkg / "__init__.py", f"{NAME}.a": pkg / "a.py", f"{NAME}.b": pkg / "b.py"}
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert _cycle(graph) == [f"{NAME}.a", f"{NAME}.b", f"{NAME}.a"]

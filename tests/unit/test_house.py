"""The house drawing of autogpu_jupyter (docs/design.md, "The house"), read from the source with
``ast``: every import (top-level, function-local and ``TYPE_CHECKING`` alike) is an arrow, no
arrow closes a circle, and none runs up the layers. Above core, every import of core goes
through its door: the façade ``autogpu_jupyter.core`` or the lease store port
``autogpu_jupyter.core.leasing`` (names in their ``__all__``), never a module inside (exceptions
named in :data:`DOOR_EXCEPTIONS`, each with why).

Run it as a script to print the drawing, the arrows between layers and the lazy imports::

    .venv/bin/python tests/unit/test_house.py
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "autogpu_jupyter"

#: The layers, lowest first; a module may import its own layer and the ones below.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("autogpu_jupyter._version", "autogpu_jupyter._renamed", "autogpu_jupyter.errors",
              "autogpu_jupyter.config")),
    ("core.procfs, core.devices, core.units", (
        "autogpu_jupyter.core.procfs", "autogpu_jupyter.core.devices",
        "autogpu_jupyter.core.units", "autogpu_jupyter.core.text",
        "autogpu_jupyter.core.words",
    )),
    ("core.leasing (the lease store port)", ("autogpu_jupyter.core.leasing",)),
    ("core", ("autogpu_jupyter.core",)),
    ("api, metrics", ("autogpu_jupyter.api", "autogpu_jupyter.metrics")),
    ("front ends", (
        "autogpu_jupyter.magics", "autogpu_jupyter.widgets", "autogpu_jupyter.server",
        "autogpu_jupyter.provisioner", "autogpu_jupyter.cli", "autogpu_jupyter.kernelspec",
        "autogpu_jupyter.broker", "autogpu_jupyter.brokerd",
    )),
    ("the package (its lazy facade)", ("autogpu_jupyter",)),
)


@functools.cache
def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer_of(module: str) -> int:
    """The lowest-placed layer whose prefix names ``module`` (the longest prefix wins)."""
    best = (-1, -1)
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                best = max(best, (len(prefix), rank))
    assert best[1] >= 0, f"{module} is in no layer of the house: add it to LAYERS"
    return best[1]


@functools.cache
def arrows() -> dict[tuple[str, str], str]:
    """(importer, imported) -> how: ``top``, ``lazy`` (function-local) or ``typing``."""
    mods = modules()
    out: dict[tuple[str, str], str] = {}

    def target(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]

        def visit(node: ast.AST, how: str, mod: str = mod, package: str = package) -> None:
            for child in ast.iter_child_nodes(node):
                kind = how
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    kind = "lazy"
                elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    kind = "typing"
                names: list[str] = []
                if isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        up = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join([*up, base] if base else up)
                    # `from pkg import sub` names the submodule, not the package around it
                    names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                             for a in child.names]
                for name in names:
                    dest = target(name)
                    if dest is not None and dest != mod:
                        out.setdefault((mod, dest), kind)
                visit(child, kind)

        visit(ast.parse(path.read_text()), "top")
    return out


def circles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted({a for a, _ in edges} | {b for _, b in edges}):
        if v not in index:
            connect(v)
    return found


#: The doors into core a module above core may import names from.
DOORS = ("autogpu_jupyter.core", "autogpu_jupyter.core.leasing")

#: Modules above core that may still reach inside it, each with why (a module, or a package and
#: everything in it).
DOOR_EXCEPTIONS: dict[str, str] = {
    # The broker is the lease store's trusted side: like the stores inside core.leasing, it
    # runs the one admission over the records it writes, and its rooms read the backends and
    # the devices' MIG layout the way core.decision does.
    "autogpu_jupyter.broker": "the lease store's trusted side (the daemon's wiring)",
    "autogpu_jupyter.brokerd": "the lease store's trusted side (its rooms)",
}


@functools.cache
def door_names(door: str) -> frozenset[str]:
    """The names in ``door``'s ``__all__``, read from its source."""
    tree = ast.parse(modules()[door].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "__all__":
                return frozenset(ast.literal_eval(node.value))
    raise AssertionError(f"{door} has no __all__")


def door_breaches(mod: str, source: str) -> list[str]:
    """The imports of core in ``source`` (of module ``mod``) that pass by the doors."""
    package = mod if modules().get(mod, Path()).name == "__init__.py" else mod.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{mod}:{node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("autogpu_jupyter.core")
                      and a.name not in DOORS]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            if not (base == "autogpu_jupyter.core" or base.startswith("autogpu_jupyter.core.")):
                continue
            for a in node.names:
                if base not in DOORS or a.name not in door_names(base):
                    found.append(f"{mod}:{node.lineno}: from {base} import {a.name}")
    return found


def above_core(mod: str) -> bool:
    return layer_of(mod) > layer_of("autogpu_jupyter.core")


def excepted(mod: str) -> bool:
    return any(mod == e or mod.startswith(e + ".") for e in DOOR_EXCEPTIONS)


def test_every_module_has_a_place_in_the_house() -> None:
    for mod in modules():
        layer_of(mod)


def test_no_import_circle_in_autogpu_jupyter() -> None:
    assert circles(set(arrows())) == []


def test_no_arrow_runs_up_the_layers() -> None:
    up = [
        f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]}), {how}"
        for (a, b), how in sorted(arrows().items())
        if layer_of(b) > layer_of(a)
    ]
    assert up == []


def test_the_checks_see_circles_and_up_arrows() -> None:
    assert circles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [["a", "b", "c"]]
    assert layer_of("autogpu_jupyter.core.leasing.records") == 2
    assert layer_of("autogpu_jupyter.core.decision") == 3
    assert layer_of("autogpu_jupyter") == len(LAYERS) - 1
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("elsewhere")
    seen = arrows()
    assert seen[("autogpu_jupyter.core.picker", "autogpu_jupyter.core.decision")] == "top"
    assert seen[("autogpu_jupyter.api", "autogpu_jupyter.core.sampler")] == "lazy"
    assert seen[("autogpu_jupyter.core.moves", "autogpu_jupyter.core.devices")] == "typing"


def test_front_ends_enter_core_by_its_door() -> None:
    breaches = [
        line
        for mod, path in modules().items()
        if above_core(mod) and not excepted(mod)
        for line in door_breaches(mod, path.read_text())
    ]
    assert breaches == []


def test_every_exception_to_the_door_still_needs_it() -> None:
    stale = [
        e for e in DOOR_EXCEPTIONS
        if not any(door_breaches(m, p.read_text()) for m, p in modules().items()
                   if m == e or m.startswith(e + "."))
    ]
    assert stale == []


def test_the_door_check_sees_a_deep_import() -> None:
    mod = "autogpu_jupyter.cli"
    assert door_breaches(mod, "from autogpu_jupyter.core.picker import pick\n") == [
        f"{mod}:1: from autogpu_jupyter.core.picker import pick"]
    assert door_breaches(mod, "def f():\n    import autogpu_jupyter.core.units\n") == [
        f"{mod}:2: import autogpu_jupyter.core.units"]
    assert door_breaches(mod, "from autogpu_jupyter.core import no_such_name\n") == [
        f"{mod}:1: from autogpu_jupyter.core import no_such_name"]
    assert door_breaches("autogpu_jupyter.server.state", "from ..core.units import x\n") == [
        "autogpu_jupyter.server.state:1: from autogpu_jupyter.core.units import x"]
    assert door_breaches(mod, "from autogpu_jupyter.core import pick, options\n"
                              "from autogpu_jupyter.core.leasing import store_for\n") == []
    assert above_core("autogpu_jupyter.magics") and not above_core("autogpu_jupyter.core.picker")


def test_every_name_of_the_door_loads_and_the_door_alone_loads_nothing() -> None:
    import autogpu_jupyter.core as core

    for name in core.__all__:
        assert getattr(core, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = core.nothing_here
    probe = ("import sys, autogpu_jupyter.core\n"
             "print(sorted(m for m in sys.modules if m.startswith('autogpu_jupyter.core.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=str(PACKAGE.parent))
    assert out.stdout.strip() == "[]"


def test_every_name_of_the_door_is_typed_and_loaded_from_the_module_it_names() -> None:
    """mypy reads the façade's ``TYPE_CHECKING`` imports; its ``__getattr__`` reads ``_LAZY``.
    A name in one and not the other would be typed ``Any`` or not load: both list ``__all__``,
    from the same module and attribute."""
    tree = ast.parse(modules()["autogpu_jupyter.core"].read_text())
    typed: dict[str, tuple[str, str | None]] = {}
    lazy: dict[str, tuple[str, str | None]] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module is not None
                for a in imp.names:
                    sub = imp.module.removeprefix("autogpu_jupyter.core").lstrip(".")
                    typed[a.asname or a.name] = (sub, a.name) if sub else (a.name, None)
        elif isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "_LAZY":
            assert node.value is not None
            lazy = ast.literal_eval(node.value)
    assert typed == lazy
    assert set(lazy) == door_names("autogpu_jupyter.core")


#: The modules that may name the broker client, each with why.
BROKER_CLIENT_NAMED_BY = {
    "autogpu_jupyter.core.leasing": "the port's package: names each store lazily, for the tests",
    "autogpu_jupyter.core.leasing.factory": "chooses the store the settings select",
    "autogpu_jupyter.core.leasing.admin": "the broker's own abilities (status, tickets, revoke)",
    "autogpu_jupyter.broker": "the daemon speaks the client's wire format (its socket path)",
    "autogpu_jupyter.brokerd.tenants": "a tenant's socket is the client's default socket path",
}


def test_only_the_factory_and_the_admin_module_name_the_broker_client() -> None:
    client = "autogpu_jupyter.core.leasing.brokerclient"
    naming = sorted(a for (a, b) in arrows() if b == client)
    assert [m for m in naming if m not in BROKER_CLIENT_NAMED_BY] == []
    assert sorted(BROKER_CLIENT_NAMED_BY) == naming  # no stale entry: each names it today


def main() -> int:
    """Print the house: each layer's modules, the arrows between layers, the lazy imports."""
    edges = arrows()
    by_layer: dict[int, list[str]] = defaultdict(list)
    for mod in modules():
        by_layer[layer_of(mod)].append(mod.removeprefix("autogpu_jupyter."))
    for rank in reversed(range(len(LAYERS))):
        print(f"{LAYERS[rank][0]}:\n    " + ", ".join(sorted(by_layer[rank])))
    between: dict[tuple[int, int], int] = defaultdict(int)
    for a, b in edges:
        between[(layer_of(a), layer_of(b))] += 1
    print("\narrows between layers (from -> to: count):")
    for (la, lb), n in sorted(between.items(), reverse=True):
        if la != lb:
            print(f"    {LAYERS[la][0]} -> {LAYERS[lb][0]}: {n}")
    lazy = sorted(f"{a} -> {b}" for (a, b), how in edges.items() if how == "lazy")
    print(f"\nlazy (function-local) imports within the package: {len(lazy)}")
    for line in lazy:
        print(f"    {line}")
    print(f"\ncircles: {circles(set(edges)) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

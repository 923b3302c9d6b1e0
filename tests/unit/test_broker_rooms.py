"""The broker's rooms stay rooms (issue 39): ``broker.py`` keeps the config, ``main()`` and the
wiring in at most 400 lines; no class of the broker is over 450 lines and no module of
``brokerd/`` over 500; the lease book imports no asyncio (its methods run with no event loop).
Read from the source files, as a reviewer would count them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "autogpu_jupyter"
BROKER = PACKAGE / "broker.py"
ROOMS = sorted((PACKAGE / "brokerd").glob("*.py"))


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_broker_py_keeps_only_config_main_and_wiring() -> None:
    assert _lines(BROKER) <= 400


@pytest.mark.parametrize("path", ROOMS, ids=lambda p: p.name)
def test_no_room_is_over_500_lines(path: Path) -> None:
    assert _lines(path) <= 500


@pytest.mark.parametrize("path", [BROKER, *ROOMS], ids=lambda p: p.name)
def test_no_class_of_the_broker_is_over_450_lines(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    sizes = {node.name: (node.end_lineno or node.lineno) - node.lineno + 1
             for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    assert {name: n for name, n in sizes.items() if n > 450} == {}


def test_the_lease_book_imports_no_asyncio() -> None:
    tree = ast.parse((PACKAGE / "brokerd" / "book.py").read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] == "asyncio"}

"""The README's sample outputs are what the commands print: run them again and compare (lease
ids aside, a new one each run). ``scripts/readme_samples.py --write`` updates the pages."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_samples",
                                                  ROOT / "scripts" / "readme_samples.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fresh() -> dict[str, str]:
    return _generator().samples()


@pytest.mark.parametrize("page", ["README.md", "docs/usage.md"])
def test_the_samples_a_page_shows_are_what_the_commands_print(
    page: str, fresh: dict[str, str]
) -> None:
    gen = _generator()
    shown = gen.blocks((ROOT / page).read_text())
    assert shown, f"{page} shows no generated sample"
    for name, text in shown.items():
        assert gen.normalized(text) == gen.normalized(fresh[name]), (
            f"{page}'s sample {name!r} is out of date: run scripts/readme_samples.py --write"
        )


def test_the_readme_shows_both_samples(fresh: dict[str, str]) -> None:
    shown = _generator().blocks((ROOT / "README.md").read_text())
    assert set(shown) == {"pick", "list"} == set(fresh)
    # the lease id is shown whole, as the pick prints it
    assert _generator().LEASE_ID.search(shown["pick"])

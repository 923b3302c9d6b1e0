"""The configuration reference in docs/configuration.md: every configurable trait, generated.

    .venv/bin/python scripts/config_reference.py           # print the generated tables
    .venv/bin/python scripts/config_reference.py --write   # update docs/configuration.md

The tables sit between the ``<!-- generated: ... -->`` markers of docs/configuration.md; the
prose around them is written by hand. ``tests/unit/test_docs.py`` fails when a trait is added,
removed or changed without the page following.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"
sys.path.insert(0, str(ROOT))

#: Defaults computed when the trait is read, in words.
DYNAMIC_DEFAULTS = {
    ("AutoGPU", "registry_dir"): "`$AUTOGPU_REGISTRY_DIR`, else `/var/tmp/autogpu`",
    ("AutoGPUServer", "registry_dir"): "`c.AutoGPU.registry_dir`",
}
#: Environment variables a default is read from that the default's code does not name itself.
EXTRA_ENV = {("AutoGPU", "registry_dir"): "AUTOGPU_REGISTRY_DIR"}
_ENV_CALL = re.compile(r"_(?:bool_|int_)?env\(\s*\"(\w+)\"")


def _env_var(cls: type, name: str) -> str | None:
    extra = EXTRA_ENV.get((cls.__name__, name))
    if extra:
        return extra
    generator = getattr(cls, "_trait_default_generators", {}).get(name)
    generator = getattr(generator, "func", generator)  # traitlets' DefaultHandler wraps it
    if generator is None:
        return None
    try:
        source = inspect.getsource(generator)
    except (OSError, TypeError):
        return None
    found = _ENV_CALL.search(source)
    return f"AUTOGPU_{found.group(1)}" if found else None


def _default(cls: type, name: str, trait: Any) -> str:
    words = DYNAMIC_DEFAULTS.get((cls.__name__, name))
    if words is not None:
        return words
    value = trait.default_value
    if value == "":
        return "(empty)"
    return f"`{value!r}`" if not isinstance(value, str) else f'`"{value}"`'


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table(cls: type) -> str:
    """One Markdown table: trait, default, environment variable, what it does."""
    rows = [
        "| trait | default | env var | what it does |",
        "|---|---|---|---|",
    ]
    for name, trait in sorted(cls.class_traits(config=True).items()):
        env = _env_var(cls, name)
        rows.append(
            f"| `c.{cls.__name__}.{name}` | {_default(cls, name, trait)} | "
            f"{f'`{env}`' if env else ''} | {_cell(trait.help or '')} |"
        )
    return "\n".join(rows)


def sections() -> dict[str, str]:
    """The generated sections of the page, by marker name."""
    from autogpu_jupyter.config import AutoGPU
    from autogpu_jupyter.server.state import AutoGPUServer

    return {"AutoGPU": table(AutoGPU), "AutoGPUServer": table(AutoGPUServer)}


def render(page: str) -> str:
    """``page`` with every generated section replaced by its current text."""
    for name, text in sections().items():
        pattern = re.compile(
            rf"(<!-- generated: {name} -->\n).*?(\n<!-- end generated: {name} -->)", re.S
        )
        if not pattern.search(page):
            raise SystemExit(f"docs/configuration.md has no generated section {name!r}")
        page = pattern.sub(lambda m, t=text: m.group(1) + t + m.group(2), page)
    return page


def main(argv: list[str]) -> int:
    if "--write" in argv:
        PAGE.write_text(render(PAGE.read_text()))
        print(f"updated {PAGE.relative_to(ROOT)}")
        return 0
    for name, text in sections().items():
        print(f"## {name}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

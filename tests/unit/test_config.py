"""autogpu_jupyter.config: the env-seeded settings are made once and made again when the
environment they read changes (issue 26); the shell's settings win over them."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from autogpu_jupyter import config
from autogpu_jupyter.config import ENV_NAMES, AutoGPU, default_settings, set_default_settings


class RecordingEnviron(dict[str, str]):
    """A copy of the environment that records every name read from it."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    set_default_settings(None)
    config._env_settings = None
    yield
    config._env_settings = None


def test_every_variable_the_defaults_read_is_one_that_renews_the_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = RecordingEnviron(dict(os.environ))
    monkeypatch.setattr(os, "environ", env)
    settings = AutoGPU()
    for name in settings.trait_names():
        getattr(settings, name)
    assert env.read  # the defaults do read the environment
    assert env.read <= set(ENV_NAMES)


def test_the_env_settings_are_made_once_and_again_when_a_variable_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AUTOGPU_MIN_FREE", raising=False)
    monkeypatch.delenv("AUTOGPU_REGISTRY_DIR", raising=False)
    first = default_settings()
    assert default_settings() is first
    assert first.min_free == ""
    monkeypatch.setenv("AUTOGPU_MIN_FREE", "10G")
    second = default_settings()
    assert second is not first and second.min_free == "10G"
    assert default_settings() is second
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", "/somewhere/else")
    assert default_settings().registry_dir == "/somewhere/else"
    monkeypatch.delenv("AUTOGPU_MIN_FREE")
    assert default_settings().min_free == ""
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    assert default_settings() is default_settings()


def test_the_shell_s_settings_win_and_are_read_live(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOGPU_MIN_FREE", "10G")
    env_settings = default_settings()
    shell = AutoGPU()
    set_default_settings(shell)
    try:
        assert default_settings() is shell
        shell.min_free = "20G"  # what %config AutoGPU.min_free = "20G" does
        assert default_settings().min_free == "20G"
    finally:
        set_default_settings(None)
    assert default_settings() is env_settings


@pytest.mark.parametrize(("value", "exclusive", "use_leases"), [
    ("true", True, True), ("Yes", True, True), (" ON ", True, True), ("1", True, True),
    ("false", False, False), ("No", False, False), ("OFF", False, False), ("0", False, False),
    ("maybe", False, True), ("", False, True),  # not a switch: each setting's own default
])
def test_switches_from_the_environment_in_any_case(
    monkeypatch: pytest.MonkeyPatch, value: str, exclusive: bool, use_leases: bool
) -> None:
    """AUTOGPU_EXCLUSIVE (default off) and AUTOGPU_USE_LEASES (default on) read the same words,
    in any case. Caught (mutation run, issue 22): the value upper-cased before the lower-case
    words were compared (every switch then fell back), "false" missing from the off words."""
    monkeypatch.setenv("AUTOGPU_EXCLUSIVE", value)
    monkeypatch.setenv("AUTOGPU_USE_LEASES", value)
    settings = AutoGPU()
    assert (settings.exclusive, settings.use_leases) == (exclusive, use_leases)


@pytest.mark.parametrize("value", [None, ""])
def test_the_registry_defaults_to_var_tmp_autogpu(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    """No (or an empty) AUTOGPU_REGISTRY_DIR: the host-wide /var/tmp/autogpu, the directory the
    admin docs create. Caught (mutation run, issue 22): the path upper-cased."""
    if value is None:
        monkeypatch.delenv("AUTOGPU_REGISTRY_DIR", raising=False)
    else:
        monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", value)
    assert config.default_registry_dir() == "/var/tmp/autogpu"
    assert AutoGPU().registry_dir == "/var/tmp/autogpu"


def test_visible_ids_defaults_to_uuid_and_reads_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from autogpu_jupyter.config import AutoGPU

    monkeypatch.delenv("AUTOGPU_VISIBLE_IDS", raising=False)
    assert AutoGPU().visible_ids == "uuid"
    monkeypatch.setenv("AUTOGPU_VISIBLE_IDS", "index")
    assert AutoGPU().visible_ids == "index"
    assert "Ray 2.8-2.9" in AutoGPU.class_traits()["visible_ids"].help

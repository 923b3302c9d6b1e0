"""``autogpu kernelspec install | list | remove`` through the real CLI entry point."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter import cli as cli_mod
from autogpu_jupyter.cli import main
from tests.jupyterpaths import keep_kernelspecs_in


@pytest.fixture
def prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "user-data"))
    keep_kernelspecs_in(tmp_path, monkeypatch)
    return tmp_path


def test_install_writes_the_provisioner_and_options(
    prefix: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["kernelspec", "install", "--prefix", str(prefix), "--min-free", "10G",
                 "--max-util", "50", "--count", "2", "--exclusive", "--wait", "10m",
                 "--on-no-device", "fail"])
    out = capsys.readouterr().out
    assert code == 0
    dest = prefix / "share/jupyter/kernels/python3-autogpu"
    assert out.splitlines() == [
        f"installed kernelspec 'python3-autogpu' (Python 3 (autogpu)) in {dest}",
        "pick options: min_free=10G, max_util=50, count=2, exclusive=True, wait=10m, "
        "on_no_device=fail",
    ]
    spec = json.loads((dest / "kernel.json").read_text())
    assert spec == {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                 "--ext=autogpu_jupyter"],
        "display_name": "Python 3 (autogpu)",
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {
            "debugger": True,
            "kernel_provisioner": {
                "provisioner_name": "autogpu-provisioner",
                "config": {"min_free": "10G", "max_util": "50", "count": 2, "exclusive": True,
                           "wait": "10m", "on_no_device": "fail"},
            },
        },
    }
    # ipykernel's three logos (the launcher shows one); caught: a logo name altered
    assert sorted(p.name for p in dest.iterdir()) == [
        "kernel.json", "logo-32x32.png", "logo-64x64.png", "logo-svg.svg"]


def test_user_install_list_and_remove(prefix: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kernelspec", "install", "--user", "--name", "gpu-big", "--display-name",
                 "Python 3 (big GPU)", "--min-free", "40G", "--no-extension"]) == 0
    capsys.readouterr()
    dest = prefix / "user-data/kernels/gpu-big"
    spec = json.loads((dest / "kernel.json").read_text())
    assert spec["argv"][-1] == "{connection_file}"
    # Only what this test installed: `make lab` puts "Python 3 (autogpu)" into this
    # environment's own prefix (sys.prefix), which Jupyter always searches too.
    ours = str(prefix)
    assert main(["kernelspec", "list", "--json"]) == 0
    listed = [s for s in json.loads(capsys.readouterr().out) if s["resource_dir"].startswith(ours)]
    assert listed == [{"name": "gpu-big", "display_name": "Python 3 (big GPU)",
                       "resource_dir": str(dest), "options": {"min_free": "40G"}}]
    assert main(["kernelspec", "list"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ours in ln]
    assert line.split() == ["gpu-big", "Python", "3", "(big", "GPU)", "min_free=40G", str(dest)]
    assert main(["kernelspec", "remove", "gpu-big"]) == 0
    assert capsys.readouterr().out == f"removed kernelspec 'gpu-big' ({dest})\n"
    assert not dest.exists()
    assert main(["kernelspec", "list"]) == 0
    out = capsys.readouterr().out
    assert ours not in out
    if os.path.isdir(os.path.join(sys.prefix, "share", "jupyter", "kernels", "python3-autogpu")):
        assert out.startswith("python3-autogpu ")  # make lab's, in this environment
    else:
        assert out == "no autogpu kernelspecs installed (autogpu kernelspec install --user)\n"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # The one options boundary names the flag the user typed (it named the JSON key).
        (["--min-free", "ten"], "autogpu: invalid size 'ten': not understood"),
        (["--max-util", "150"], "autogpu: invalid --max-util '150': must be 0-100"),
        (["--count", "two"], "invalid --count 'two': expected a whole number >= 1, e.g. 2"),
        (["--wait", "soon"], "autogpu: invalid duration 'soon': expected seconds"),
        (["--name", "bad name"], "autogpu: invalid kernelspec name 'bad name': expected "
         "letters, digits, '.', '_' or '-', e.g. python3-autogpu\n"),
    ],
)
def test_bad_install_options_exit_2_with_one_message(
    prefix: Path, capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    code = main(["kernelspec", "install", "--prefix", str(prefix), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("autogpu: ")
    assert expected in err
    assert "Traceback" not in err
    assert not (prefix / "share/jupyter/kernels/python3-autogpu").exists()


def test_remove_refuses_unknown_and_foreign_kernelspecs(
    prefix: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = prefix / "share/jupyter/kernels/plain"
    other.mkdir(parents=True)
    (other / "kernel.json").write_text(json.dumps(
        {"argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
         "display_name": "Plain", "language": "python"}))
    assert main(["kernelspec", "remove", "nope"]) == 2
    make_labs = os.path.isdir(os.path.join(sys.prefix, "share/jupyter/kernels/python3-autogpu"))
    installed = "python3-autogpu" if make_labs else "none installed"  # make lab's, see above
    assert capsys.readouterr().err == (
        f"autogpu: no kernelspec named 'nope' (autogpu kernelspecs: {installed})\n"
    )
    assert main(["kernelspec", "remove", "plain"]) == 2
    assert capsys.readouterr().err == (
        "autogpu: kernelspec 'plain' does not use the autogpu provisioner; remove it with "
        "`jupyter kernelspec remove plain`\n"
    )
    assert other.exists()


def test_a_kernelspec_of_another_provisioner_is_not_ours(
    prefix: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kernelspec naming another installed provisioner (jupyter_client's own) is neither
    listed nor removed. Caught: "ours" judged by having a provisioner at all."""
    other = prefix / "share/jupyter/kernels/remote"
    other.mkdir(parents=True)
    (other / "kernel.json").write_text(json.dumps(
        {"argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
         "display_name": "Remote", "language": "python",
         "metadata": {"kernel_provisioner": {"provisioner_name": "local-provisioner",
                                             "config": {}}}}))
    assert main(["kernelspec", "list", "--json"]) == 0
    assert "remote" not in [s["name"] for s in json.loads(capsys.readouterr().out)]
    assert main(["kernelspec", "remove", "remote"]) == 2
    assert capsys.readouterr().err.startswith(
        "autogpu: kernelspec 'remote' does not use the autogpu provisioner")
    assert other.exists()


def test_options_from_python_are_checked_and_unset_ones_left_out(prefix: Path) -> None:
    """``kernelspec.install`` from Python: an option left ``None`` is not written (the server's
    ``c.AutoGPU`` default applies); a bad ``on_no_device`` is refused by name. Caught: ``None``
    written into the kernelspec (read back as an explicit choice); the on_no_device check
    dropped."""
    from autogpu_jupyter import kernelspec
    from autogpu_jupyter.errors import UsageErrorBase

    spec = kernelspec.spec_dict(options={"min_free": "10G", "max_util": None, "wait": None})
    assert spec["metadata"]["kernel_provisioner"]["config"] == {"min_free": "10G"}
    with pytest.raises(UsageErrorBase) as info:
        kernelspec.install("odd", options={"on_no_device": "maybe"}, prefix=str(prefix))
    assert str(info.value) == (
        "invalid on_no_device 'maybe': expected \"cpu\" (start without a GPU) or \"fail\"")
    assert not (prefix / "share/jupyter/kernels/odd").exists()


def test_the_kernelspec_help_lists_its_actions(capsys: pytest.CaptureFixture[str]) -> None:
    """Caught (mutation run, issue 22): an action's help line dropped."""
    assert main(["kernelspec"]) == 2
    out = capsys.readouterr().out
    assert "    install   install an autogpu kernelspec" in out.splitlines()


def test_install_runs_the_kernel_with_the_python_named(
    prefix: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--python EXE`` is the kernel's interpreter (argv[0] of kernel.json). Caught
    (mutation run, issue 22): the flag dropped on its way to install (this Python written)."""
    exe = "/opt/conda/envs/train/bin/python"
    assert main(["kernelspec", "install", "--prefix", str(prefix), "--python", exe]) == 0
    capsys.readouterr()
    spec = json.loads((prefix / "share/jupyter/kernels/python3-autogpu/kernel.json").read_text())
    assert spec["argv"][:3] == [exe, "-m", "ipykernel_launcher"]


def test_list_says_defaults_for_a_kernelspec_without_options(
    prefix: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kernelspec with no pick options is listed as using the defaults. Caught (mutation
    run, issue 22): that word altered."""
    assert main(["kernelspec", "install", "--user", "--name", "gpu-plain"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "pick options: the server's defaults (c.AutoGPU)")
    assert main(["kernelspec", "list"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if str(prefix) in ln]
    dest = prefix / "user-data/kernels/gpu-plain"
    assert line.split() == ["gpu-plain", "Python", "3", "(autogpu)", "defaults", str(dest)]


def test_list_joins_a_kernelspecs_options_and_json_is_indented(
    prefix: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``autogpu kernelspec list``: a kernelspec's pick options as one comma-separated column;
    ``--json``: the same list, indented by two spaces as every --json of the CLI. Caught
    (mutation run, issue 22, seed 54): the options' separator altered; the JSON on one line."""
    assert main(["kernelspec", "install", "--user", "--name", "gpu-two", "--min-free", "10G",
                 "--max-util", "50"]) == 0
    capsys.readouterr()
    assert main(["kernelspec", "list"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if str(prefix) in ln]
    dest = prefix / "user-data/kernels/gpu-two"
    assert line.split() == ["gpu-two", "Python", "3", "(autogpu)", "min_free=10G,",
                            "max_util=50", str(dest)]
    assert main(["kernelspec", "list", "--json"]) == 0
    out = capsys.readouterr().out
    assert out == json.dumps(json.loads(out), indent=2) + "\n"
    assert '\n  {\n    "name": "gpu-two",\n' in out


def test_options_from_python_are_checked_as_json(prefix: Path) -> None:
    """A kernelspec's options are JSON read by the provisioner: a byte count for min_free is
    refused (in JSON "10" is ambiguous; sizes are strings). Caught: the options checked in
    another style than JSON keys (the number written into the kernelspec)."""
    from autogpu_jupyter import kernelspec
    from autogpu_jupyter.errors import UsageErrorBase

    with pytest.raises(UsageErrorBase) as info:
        kernelspec.install("big", options={"min_free": 10 * 2**30}, prefix=str(prefix))
    assert str(info.value) == (
        "invalid min_free=10737418240: expected a string such as \"10G\"")
    assert not (prefix / "share/jupyter/kernels/big").exists()


def test_sys_prefix_installs_into_this_pythons_prefix(
    prefix: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--sys-prefix`` is a switch: the kernelspec goes to sys.prefix/share/jupyter/kernels
    (sys.prefix pointed into tmp here). Caught: --sys-prefix made an option taking a value."""
    env = prefix / "env"
    monkeypatch.setattr(sys, "prefix", str(env))
    assert main(["kernelspec", "install", "--sys-prefix", "--name", "gpu-env"]) == 0
    dest = env / "share/jupyter/kernels/gpu-env"
    assert capsys.readouterr().out.splitlines()[0] == (
        f"installed kernelspec 'gpu-env' (Python 3 (autogpu)) in {dest}")
    assert (dest / "kernel.json").exists()


def test_the_kernelspec_help_explains_it_and_its_flags(
    capsys: pytest.CaptureFixture[str]
) -> None:
    """What ``autogpu [kernelspec [install | remove]] --help`` says (line breaks and indents
    made single spaces). Caught (mutation run, issue 22): the description dropped or
    upper-cased, a command's, action's, argument's or flag's help dropped or altered, a
    placeholder lower-cased or dropped, --sys-prefix taking a value."""
    shown = {}
    for argv in ([], ["kernelspec"], ["kernelspec", "install"], ["kernelspec", "remove"]):
        with pytest.raises(SystemExit) as done:
            main([*argv, "--help"])
        assert done.value.code == 0
        shown[" ".join(argv)] = " ".join(capsys.readouterr().out.split())
    assert ('kernelspec install / list / remove the "Python 3 (autogpu)" kernelspec'
            in shown[""])
    assert shown["kernelspec"].startswith("usage: autogpu kernelspec [-h] ACTION ...")
    assert ("A kernelspec whose provisioner picks the GPU before the kernel starts; the lease "
            "lives exactly as long as the kernel process.") in shown["kernelspec"]
    assert "remove remove an autogpu kernelspec" in shown["kernelspec"]
    for line in [
        "--on-no-device {cpu,fail} nothing fits: start CPU-only with a note (cpu, default) or "
        "refuse to start (fail)",
        f"--sys-prefix install into this Python's prefix ({sys.prefix})",
        "--prefix DIR install into DIR/share/jupyter/kernels",
        f"--python EXE the Python that runs the kernel (default {sys.executable})",
        "--no-extension do not load the autogpu IPython extension (%gpu) in the kernel",
    ]:
        assert line in shown["kernelspec install"]
    assert "positional arguments: name the kernelspec name" in shown["kernelspec remove"]


# ---- the parser of autogpu kernelspec (kernelspec.add_cli) ----
# The namespace each action reads: the action recorded, its handler and every default of install,
# list and remove; in-process, the parser only, nothing installed. Found by the mutation run of
# issue 22.
#: What ``autogpu kernelspec ACTION`` reads when given nothing else (its defaults).
DEFAULTS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "install": ([], {
        "name": "python3-autogpu",
        "display_name": "Python 3 (autogpu)", "min_free": None, "max_util": None,
        "count": None, "exclusive": None, "wait": None, "model": None, "prefer": None,
        "devices": None, "on_no_device": None, "user": False, "sys_prefix": False, "prefix": None,
        "python": None, "no_extension": False}),
    "list": ([], {"json": False}),
    "remove": (["gpu-big"], {"name": "gpu-big"}),
}


@pytest.mark.parametrize("action", sorted(DEFAULTS))
def test_each_kernelspec_action_is_recorded_and_starts_from_its_defaults(action: str) -> None:
    """``autogpu kernelspec ACTION`` reads exactly these values: the action under
    ``kernelspec_command``, the action's handler, and its documented defaults (the name and
    display name of the kernelspec, every pick option unset, no --exclude, which a kernelspec
    does not take). Caught (issue 22): the action's destination dropped or renamed; --exclude
    no longer skipped (dropped or misspelled skip), so the install namespace gained it."""
    extra, expected = DEFAULTS[action]
    seen = vars(cli_mod.build_parser().parse_args(["kernelspec", action, *extra]))
    del seen["_subparsers"]
    # each action has a handler of its own (what it runs: the install, list and remove tests)
    assert callable(seen.pop("handler"))
    assert seen == {"command": "kernelspec", "kernelspec_command": action, **expected}


# ---- list, remove and the refusals of install, found by the mutation run of issue 22 ----
def _ours_elsewhere() -> list[str]:
    """The autogpu kernelspec ``make lab`` puts into this environment's own prefix (which
    Jupyter always searches), if it is there."""
    made = os.path.join(sys.prefix, "share", "jupyter", "kernels", "python3-autogpu")
    return ["python3-autogpu"] if os.path.isdir(made) else []


def test_kernelspec_list_goes_on_past_a_kernelspec_that_is_not_ours(
    prefix: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A kernelspec of another kind whose name sorts first is skipped, and the autogpu one after
    it still listed. Caught: the first foreign kernelspec ending the listing."""
    plain = prefix / "share/jupyter/kernels/a-plain"
    plain.mkdir(parents=True)
    (plain / "kernel.json").write_text(json.dumps(
        {"argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
         "display_name": "Plain", "language": "python"}))
    assert cli_mod.main(["kernelspec", "install", "--user", "--name", "b-gpu"]) == 0
    capsys.readouterr()
    assert cli_mod.main(["kernelspec", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in listed if s["resource_dir"].startswith(str(prefix))] == ["b-gpu"]


def test_removing_an_unknown_kernelspec_names_every_autogpu_one(
    prefix: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """``autogpu kernelspec remove NAME`` of no such kernelspec exits 2 naming the autogpu
    kernelspecs there are, comma separated. Caught: the names' separator altered; the name
    looked up under another key (a KeyError)."""
    for name in ("gpu-a", "gpu-b"):
        assert cli_mod.main(["kernelspec", "install", "--user", "--name", name]) == 0
    capsys.readouterr()
    assert cli_mod.main(["kernelspec", "remove", "nope"]) == 2
    ours = ", ".join(sorted(["gpu-a", "gpu-b", *_ours_elsewhere()]))
    assert capsys.readouterr().err == (
        f"autogpu: no kernelspec named 'nope' (autogpu kernelspecs: {ours})\n")


def test_removing_a_kernelspec_without_the_right_says_why_and_where(
    prefix: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """A kernelspec the user may not remove (another user's, the system's): exit 2 with one
    line naming it, the reason and the folder, no traceback (the refusal is Jupyter's, made
    here to happen as root too). Caught: the message replaced by None."""
    from jupyter_client.kernelspec import KernelSpecManager

    assert cli_mod.main(["kernelspec", "install", "--user", "--name", "gpu-a"]) == 0
    capsys.readouterr()
    dest = prefix / "user-data/kernels/gpu-a"

    def refuse(_self: Any, name: str) -> str:
        raise PermissionError(errno.EACCES, "Permission denied", str(dest / "kernel.json"))

    monkeypatch.setattr(KernelSpecManager, "remove_kernel_spec", refuse)
    assert cli_mod.main(["kernelspec", "remove", "gpu-a"]) == 2
    assert capsys.readouterr() == ("", (
        f"autogpu: cannot remove kernelspec 'gpu-a': Permission denied ({dest}/kernel.json)\n"))
    assert dest.is_dir()


def test_a_bad_count_for_a_kernelspec_is_named_by_its_flag(
    prefix: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """``autogpu kernelspec install --count 0``: exit 2, the message naming ``--count`` as the
    user typed it (not the kernelspec's JSON key), nothing installed. Caught: the options
    checked in another style than "flag" (None or an altered word: "invalid count 0")."""
    assert cli_mod.main(["kernelspec", "install", "--prefix", str(prefix), "--count", "0"]) == 2
    assert capsys.readouterr() == (
        "", "autogpu: invalid --count 0: expected a whole number >= 1, e.g. 2\n")
    assert not (prefix / "share/jupyter/kernels/python3-autogpu").exists()


def test_install_from_python_writes_an_indented_kernel_json_loading_the_extension(
    prefix: Path,
) -> None:
    """``kernelspec.install(NAME, prefix=...)`` (and ``spec_dict()``) from Python: the kernel
    loads the autogpu extension unless told not to, kernel.json is indented by one space
    (readable, as Jupyter writes its own), and a name with capitals is accepted (letters are
    either case). Caught: the extension off by default in install or in spec_dict; kernel.json
    on one line or indented by 2; the name check made lower-case only."""
    from autogpu_jupyter import kernelspec

    assert kernelspec.spec_dict()["argv"][-1] == "--ext=autogpu_jupyter"
    dest = Path(kernelspec.install("GPU-Big", prefix=str(prefix)))
    assert dest == prefix / "share/jupyter/kernels/gpu-big"
    text = (dest / "kernel.json").read_text(encoding="utf-8")
    spec = json.loads(text)
    assert spec["argv"][-1] == "--ext=autogpu_jupyter"
    assert text == json.dumps(spec, indent=1)


def test_install_without_ipykernel_to_hand_writes_the_spec_without_logos(
    prefix: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Installing from an environment where ipykernel cannot be found (the kernel's Python is
    another one, ``--python EXE``): the kernelspec is written all the same, without the logos
    ipykernel would have lent it. Caught: the "ipykernel found" test made "or" (an
    AttributeError on None)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ipykernel" else real(name, *a))
    assert cli_mod.main(["kernelspec", "install", "--prefix", str(prefix), "--name",
                         "gpu-bare"]) == 0
    dest = prefix / "share/jupyter/kernels/gpu-bare"
    assert capsys.readouterr().err == ""
    assert sorted(p.name for p in dest.iterdir()) == ["kernel.json"]


def test_installing_where_the_user_may_not_write_says_where_to_install_instead(
    prefix: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """An install into a folder the user may not write (the system's, without root): exit 2
    with one line naming the kernelspec, the reason and the folder, and the flags that install
    elsewhere (the refusal is Jupyter's, made here to happen as root too). Caught: the message
    replaced by None; its advice altered or upper-cased."""
    from jupyter_client.kernelspec import KernelSpecManager

    where = "/usr/local/share/jupyter/kernels/gpu-a"

    def refuse(_self: Any, _source: str, **_kw: Any) -> str:
        raise PermissionError(errno.EACCES, "Permission denied", where)

    monkeypatch.setattr(KernelSpecManager, "install_kernel_spec", refuse)
    assert cli_mod.main(["kernelspec", "install", "--name", "gpu-a"]) == 2
    assert capsys.readouterr() == ("", (
        f"autogpu: cannot install kernelspec 'gpu-a': Permission denied ({where}); use --user, "
        "--sys-prefix or --prefix DIR\n"))

"""scripts/bench_compare.py: the regression guard's comparison (issue 26). Figures only, no
timing: the benchmarks themselves are never run here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_compare.py"
_spec = importlib.util.spec_from_file_location("bench_compare", _PATH)
assert _spec is not None and _spec.loader is not None
bc = importlib.util.module_from_spec(_spec)
sys.modules["bench_compare"] = bc
_spec.loader.exec_module(bc)

DOC = """# Benchmarks

text before

<!-- bench-baseline -->
```json
{"pick_latency.api_vs_nvitop": 0.4, "cluster.p99_ms": 250, "amd.pick_amd_vs_nvidia": 1.5}
```

text after
"""


def test_a_figure_worse_by_more_than_the_tolerance_is_named_and_no_other() -> None:
    base = bc.read_baseline(DOC)
    assert base == {"pick_latency.api_vs_nvitop": 0.4, "cluster.p99_ms": 250.0,
                    "amd.pick_amd_vs_nvidia": 1.5}
    now = {"pick_latency.api_vs_nvitop": 0.49, "cluster.p99_ms": 301.0,
           "amd.pick_amd_vs_nvidia": 1.0, "broker_pick.broker_vs_directory": 9.0}
    result = bc.compare(base, now)
    assert [c.name for c in result.worsened] == ["cluster.p99_ms", "pick_latency.api_vs_nvitop"]
    assert result.new == ("broker_pick.broker_vs_directory",)
    assert result.missing == ()
    text = bc.report(result)
    assert text.splitlines()[-1] == (
        "worsened by more than 20%: cluster.p99_ms, pick_latency.api_vs_nvitop")
    assert "| broker_pick.broker_vs_directory | - | (new) | | |" in text


def test_exactly_the_tolerance_is_not_worse_and_better_never_is() -> None:
    result = bc.compare({"a": 1.0, "b": 2.0, "z": 0.0}, {"a": 1.2, "b": 0.1, "z": 0.0})
    assert result.worsened == ()
    assert bc.compare({"a": 1.0}, {"a": 1.21}).worsened[0].name == "a"
    assert bc.compare({"z": 0.0}, {"z": 0.001}).worsened[0].ratio == float("inf")
    assert bc.compare({"a": 1.0}, {"a": 1.4}, tolerance=0.5).worsened == ()
    missing = bc.compare({"a": 1.0, "gone": 3.0}, {"a": 1.0})
    assert missing.missing == ("gone",) and missing.worsened == ()


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("# nothing recorded\n", "no recorded run"),
        ("<!-- bench-baseline -->\n```json\n{oops\n```\n", "is not JSON"),
        ("<!-- bench-baseline -->\n```json\n[1, 2]\n```\n", "expected a JSON object"),
        ('<!-- bench-baseline -->\n```json\n{"a": "fast"}\n```\n', "'a' is 'fast'"),
        ('<!-- bench-baseline -->\n```json\n{"a": true}\n```\n', "'a' is True"),
        ('<!-- bench-baseline -->\n```json\n{"a": NaN}\n```\n', "'a' is nan"),
    ],
)
def test_a_recorded_run_that_cannot_be_read_says_why(doc: str, message: str) -> None:
    with pytest.raises(bc.BaselineError, match=message):
        bc.read_baseline(doc)


def test_recording_replaces_the_block_and_keeps_the_rest_of_the_page() -> None:
    text = bc.write_baseline(DOC, {"b": 2.0, "a": 1.0})
    assert bc.read_baseline(text) == {"a": 1.0, "b": 2.0}
    assert text.startswith("# Benchmarks\n\ntext before\n\n<!-- bench-baseline -->\n```json\n")
    assert text.endswith("```\n\ntext after\n")
    appended = bc.write_baseline("# none yet\n", {"a": 1.0})
    assert bc.read_baseline(appended) == {"a": 1.0}


def test_main_exits_1_on_a_worse_figure_2_on_unreadable_input_and_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    results = tmp_path / "latest.json"
    results.write_text(json.dumps({"pick_latency.api_vs_nvitop": 0.41, "cluster.p99_ms": 200}))
    assert bc.main(["--results", str(results), "--baseline", str(doc)]) == 0
    assert "amd.pick_amd_vs_nvidia | recorded | (not measured)" in capsys.readouterr().out
    results.write_text(json.dumps({"cluster.p99_ms": 400}))
    assert bc.main(["--results", str(results), "--baseline", str(doc), "--record"]) == 1
    out = capsys.readouterr().out
    assert "worsened by more than 20%: cluster.p99_ms" in out
    assert bc.read_baseline(doc.read_text())["cluster.p99_ms"] == 400.0
    assert bc.main(["--results", str(tmp_path / "none.json"), "--baseline", str(doc)]) == 2

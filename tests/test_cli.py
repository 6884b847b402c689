"""The command line as a user runs it: a subprocess (or ``main(argv)`` in process), exit codes and output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cgregistry import cli as cli_module
from cgregistry.demo import DemoResult
from cgregistry.plan import MODES

ROOT = Path(__file__).parent.parent
# This checkout's package, whatever an editable install points at.
ENV = {**os.environ, "CGREGISTRY_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cgregistry.cli", *args], capture_output=True, text=True, env=ENV, timeout=600)


@pytest.fixture(autouse=True)
def _no_plugin_autoload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CGREGISTRY_DISABLE_PLUGIN_AUTOLOAD", "1")


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``main(args)`` in process: (exit code, stdout, stderr), argparse's own exits included."""
    try:
        code = cli_module.main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_lists_keys_and_gaps() -> None:
    r = cli("plan", "--max-num-seqs", "8", "--max-num-tokens", "64", "--mode", "full_decode_only")
    assert r.returncode == 0, r.stderr
    assert "full       Batch(tokens=8, reqs=8, uniform)" in r.stdout
    assert "4 graphs" in r.stdout
    assert "uncovered (runs eagerly): mixed batches of 1..64 tokens, 0 LoRA" in r.stdout


def test_plan_json() -> None:
    r = cli("plan", "--max-num-seqs", "4", "--max-num-tokens", "16", "--mode", "piecewise", "--json")
    data = json.loads(r.stdout)
    assert [e["key"]["num_tokens"] for e in data["entries"]] == [8, 4, 2, 1]
    assert data["uncovered"] == [{"kind": "mixed", "num_active_loras": 0, "spec_depth": None, "min_tokens": 9, "max_tokens": 16}]


def test_plan_takes_a_strategy_pair_as_mode() -> None:
    r = cli("plan", "--max-num-seqs", "8", "--max-num-tokens", "64", "--mode", "none,breakable", "--json")
    assert r.returncode == 0, r.stderr
    assert {e["strategy"] for e in json.loads(r.stdout)["entries"]} == {"breakable"}
    bad = cli("plan", "--mode", "full,nope")
    assert bad.returncode == 2 and "strategy 'nope' is not registered" in bad.stderr


def test_plan_errors_exit_2_with_message() -> None:
    r = cli("plan", "--max-num-seqs", "8", "--max-num-tokens", "64", "--capture-sizes", "8,100")
    assert r.returncode == 2
    assert "cgregistry plan: error: max_capture_size=100 exceeds max_num_tokens=64" in r.stderr


def test_demo_checks_every_step_against_eager() -> None:
    r = cli("demo", "--backend", "cpu", "--steps", "40", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["steps"] == 40 and result["mismatches"] == 0
    assert result["hits"] + result["misses"] == 40 and result["hits"] > 0
    assert result["backend"] == "cpu"
    # the cpu backend emulates graphs: an eager/registry time ratio there is no speedup
    assert result["speedup"] is None and "cpu backend emulates graphs" in result["no_speedup_reason"]


def test_demo_prints_table_and_timing() -> None:
    r = cli("demo", "--backend", "cpu", "--steps", "20")
    assert r.returncode == 0, r.stderr
    assert "checked 20 steps against eager: 0 mismatches" in r.stdout
    assert "timing over the same 20 steps: eager" in r.stdout
    assert "timings: the cpu backend emulates graphs (it runs the step eagerly), so no speedup is reported" in r.stdout
    assert not re.search(r"\d\.\d+x\b", r.stdout), "no speedup ratio on cpu"
    assert "key" in r.stdout and "strategy" in r.stdout


def small_trace(tmp_path) -> str:  # noqa: ANN001
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(40):
        rows.append(f"2023-11-16 18:00:{i:02d}.0,{20 + 7 * (i % 5)},{3 + i % 4}")
    path = tmp_path / "trace.csv"
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_plan_on_trace_matches_in_process_evaluation(tmp_path) -> None:  # noqa: ANN001
    from cgregistry import CapturePlan
    from cgregistry.fitting import evaluate
    from cgregistry.workload import SchedulerConfig, read_trace, schedule

    trace = small_trace(tmp_path)
    r = cli("plan", "--trace", trace, "--max-num-seqs", "8", "--max-num-tokens", "64", "--fit", "6", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data["plans"]) == {"default", "fitted (6)"}
    requests = read_trace(trace)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    second = list(schedule(requests[20:], config))
    default = evaluate(CapturePlan.build(max_num_seqs=8, max_num_tokens=64), second)
    assert data["plans"]["default"]["padded_tokens"] == default.padded_tokens
    assert data["plans"]["default"]["steps"] == len(second)
    fitted = data["plans"]["fitted (6)"]
    assert fitted["graphs"] <= 6
    assert fitted["graph_steps"] == default.graph_steps
    assert "second half" in data["scope"]


def test_plan_on_trace_prints_side_by_side_and_plots(tmp_path) -> None:  # noqa: ANN001
    pytest = __import__("pytest")
    pytest.importorskip("matplotlib")
    png = tmp_path / "waste.png"
    r = cli("plan", "--trace", small_trace(tmp_path), "--max-num-seqs", "8", "--max-num-tokens", "64", "--fit", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert "default" in r.stdout and "fitted (" in r.stdout
    assert "padding (of graph tokens)" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_on_missing_trace_says_which_file(tmp_path) -> None:  # noqa: ANN001
    r = cli("plan", "--trace", str(tmp_path / "nope.csv"))
    assert r.returncode == 2
    assert "nope.csv" in r.stderr


def test_plugins_lists_builtins_and_installed_distributions() -> None:
    env = {k: v for k, v in os.environ.items() if k != "CGREGISTRY_DISABLE_PLUGIN_AUTOLOAD"}
    r = subprocess.run([sys.executable, "-m", "cgregistry.cli", "plugins", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    infos = {p["name"]: p for p in json.loads(r.stdout)}
    full = infos["cgregistry.strategies.full"]
    assert full["builtin"] and full["distribution"] == "cgregistry"
    assert full["hooks"] == ["cgregistry_register_strategies"] and full["provides"] == ["strategy full"]
    assert infos["cgregistry.backends.cpu"]["provides"] == ["backend cpu"]
    if "eager" in infos:  # the plugins/ packages, where installed (CI installs them)
        assert infos["eager"]["distribution"] == "cgregistry-eager" and infos["eager"]["provides"] == ["strategy eager"]
    table = subprocess.run([sys.executable, "-m", "cgregistry.cli", "plugins"], capture_output=True, text=True, env=env, timeout=300)
    assert "cgregistry (built-in)" in table.stdout and "cgregistry_register_backends" in table.stdout


def test_demo_snapshot_then_inspect(tmp_path) -> None:  # noqa: ANN001
    snap = tmp_path / "snap.json"
    r = cli("demo", "--backend", "cpu", "--steps", "30", "--snapshot", str(snap), "--json")
    assert r.returncode == 0, r.stderr
    demo = json.loads(r.stdout)
    r = cli("inspect", str(snap), "--json", "--used", "--sort", "replays", "--explain", "3,3,0,0,uniform")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    replays = [e["replays"] for e in data["entries"]]
    assert replays == sorted(replays, reverse=True) and all(n > 0 for n in replays)
    # the snapshot is taken after the timed pass, which replays the same steps as the checked pass
    assert sum(replays) == data["stats"]["hits"] == demo["hits"]
    assert data["stats"]["misses"] == demo["misses"]
    assert data["explain"]["match"]["key"]["num_tokens"] == 4
    text = cli("inspect", str(snap), "--kind", "uniform")
    assert text.returncode == 0, text.stderr
    table = text.stdout.split("entries on cpu")[0]
    keys = [line for line in table.splitlines() if line.startswith("Batch(")]
    assert keys and all("uniform" in line for line in keys)


def test_inspect_errors_exit_2(tmp_path) -> None:  # noqa: ANN001
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": 7}')
    r = cli("inspect", str(bad))
    assert r.returncode == 2 and "snapshot schema 7 is not supported" in r.stderr
    r = cli("inspect", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "missing.json" in r.stderr


def test_check_lists_unsafe_ops_with_lines() -> None:
    env = {**ENV, "PYTHONPATH": str(__import__("pathlib").Path(__file__).parent)}
    r = subprocess.run([sys.executable, "-m", "cgregistry.cli", "check", "check_targets:unsafe", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stderr
    found = json.loads(r.stdout)
    assert [f["op"].split(".")[1] for f in found] == ["item", "index"]
    assert all("check_targets.py:" in f["where"] for f in found)
    assert "n = int(x.sum().item())" in found[0]["where"]
    ok = subprocess.run([sys.executable, "-m", "cgregistry.cli", "check", "check_targets:safe"], capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0 and "no graph-unsafe ops found" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "cgregistry.cli", "check", "check_targets:needs_args"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "needs arguments ['x']" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "cgregistry.cli", "check", "no_such_module:f"], capture_output=True, text=True, env=env, timeout=300)
    assert missing.returncode == 2 and "cannot import module 'no_such_module'" in missing.stderr


# ---------------------------------------------------------------------------- demo


def demo_result(**changes: object) -> DemoResult:
    fields = dict(backend="cuda", steps=10, mismatches=0, max_abs_error=0.0, eager_seconds=2.0, graph_seconds=1.0, hits=10,
                  misses=0, padding_ratio=0.0, entries=4, capture_seconds=0.1, memory_bytes=0, table="")
    return DemoResult(**{**fields, **changes})


def test_speedup_only_where_graphs_served_steps_on_a_real_backend() -> None:
    assert demo_result().speedup == 2.0 and demo_result().no_speedup_reason is None
    cpu = demo_result(backend="cpu")
    assert cpu.speedup is None and "cpu backend emulates graphs" in cpu.no_speedup_reason
    no_graphs = demo_result(entries=0, hits=0, misses=10)
    assert no_graphs.speedup is None and "no graphs" in no_graphs.no_speedup_reason
    no_hits = demo_result(hits=0, misses=10)
    assert no_hits.speedup is None and "no step was served by a graph" in no_hits.no_speedup_reason


@pytest.mark.parametrize("mode", list(MODES))
def test_demo_runs_every_mode_the_cli_offers(capsys: pytest.CaptureFixture[str], mode: str) -> None:
    # Few steps keep it fast; the piecewise modes add a dynamo trace (about a second or two on CPU).
    code, out, err = run_main(capsys, "demo", "--backend", "cpu", "--steps", "8", "--mode", mode, "--all", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["steps"] == 8 and result["mismatches"] == 0
    assert result["speedup"] is None
    if mode == "none":
        assert result["entries"] == 0 and result["hits"] == 0
    else:
        assert result["entries"] > 0 and result["hits"] > 0
    assert ("piecewise" in result["table"]) == ("piecewise" in mode)  # --all: the table lists every entry

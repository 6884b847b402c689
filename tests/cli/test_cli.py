"""The command line as a user runs it: ``main(argv)`` in process (exit codes and output), and a subprocess where
the process boundary is the point (a closed pipe)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

import cgregistry as cg
from cgregistry.cli import commands as cli_module
from cgregistry.cli.demo import DemoResult
from cgregistry.plan import MODES

ROOT = Path(__file__).parents[2]
TESTS = Path(__file__).parents[1]
# This checkout's package, whatever an editable install points at.
ENV = {**os.environ, "CGREGISTRY_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``cgregistry ARGS`` run by ``main`` in this process, its exit code and output as a subprocess's would be
    (without paying a torch import per call)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_module.main(list(args))
        except SystemExit as exc:  # argparse: usage errors, --help, --version
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["cgregistry", *args], code, out.getvalue(), err.getvalue())


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


@pytest.fixture
def small_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo with a one-layer model: what these tests check (the command, its modes, its output) does not
    depend on the model's size, and the CPU-sized one costs seconds a run.  The CPU size runs in the slow set
    (test_the_readmes_demo_command_runs_as_a_user_runs_it)."""
    from cgregistry.demo_model import DemoConfig

    sized = DemoConfig.for_device
    small = attrs.evolve(sized("cpu"), layers=1, hidden=32, heads=2, ffn=64, vocab=128, context=8)
    monkeypatch.setattr(DemoConfig, "for_device", classmethod(lambda cls, device: small if torch.device(device).type == "cpu" else sized(device)))


def test_plan_lists_keys_and_gaps(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "plan", "--max-num-seqs", "8", "--max-num-tokens", "64", "--mode", "full_decode_only")
    assert code == 0, err
    assert "full       Batch(tokens=8, reqs=8, uniform)" in out
    assert "4 graphs" in out
    assert "uncovered (runs eagerly): mixed batches of 1..64 tokens, 0 LoRA" in out


def test_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "plan", "--max-num-seqs", "4", "--max-num-tokens", "16", "--mode", "piecewise", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert [e["key"]["num_tokens"] for e in data["entries"]] == [8, 4, 2, 1]
    assert data["uncovered"] == [
        {"key_class": "mixed", "num_active_loras": 0, "spec_depth": None, "min_tokens": 9, "max_tokens": 16, "reason": "no_key"}
    ]


def test_plan_takes_a_strategy_pair_as_mode(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "plan", "--max-num-seqs", "8", "--max-num-tokens", "64", "--mode", "none,breakable", "--json")
    assert code == 0, err
    assert {e["strategy"] for e in json.loads(out)["entries"]} == {"breakable"}
    code, _, err = run_main(capsys, "plan", "--mode", "full,nope")
    assert code == 2 and "strategy 'nope' is not registered" in err


def test_plan_errors_exit_2_with_message(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "plan", "--max-num-seqs", "8", "--max-num-tokens", "64", "--capture-sizes", "8,100")
    assert code == 2 and out == ""
    assert err == "cgregistry plan: error: --capture-sizes=8,100: the largest, 100, exceeds --max-num-tokens=64: no batch can be that large\n"


def test_plan_without_graphs_says_every_batch_runs_eagerly(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "plan", "--max-num-seqs", "4", "--max-num-tokens", "16", "--mode", "none")
    assert code == 0, err
    assert "0 graphs: every batch runs eagerly\n" in out and "0 graphs: \n" not in out
    assert "uncovered (runs eagerly): mixed batches of 1..16 tokens, 0 LoRA" in out


def test_plan_lists_the_uncovered_ranges_of_any_token_budget(capsys: pytest.CaptureFixture[str]) -> None:
    # The ranges are worked out from the keys' edges, not by matching every size: 10^11 tokens cost what 64 do.
    code, out, err = run_main(capsys, "plan", "--max-num-tokens", "100000000000", "--max-padding-ratio", "0.5")
    assert code == 0, err
    capped = ", over the padding cap: every covering key pads more (--max-padding-ratio=0.5)"
    assert [line for line in out.splitlines() if line.startswith("uncovered")] == [
        f"uncovered (runs eagerly): decode spec depth 0 batches of 5..5 tokens, 0 LoRA{capped}",  # an 8-token key pads 3
        f"uncovered (runs eagerly): decode spec depth 0 batches of 9..10 tokens, 0 LoRA{capped}",
        f"uncovered (runs eagerly): mixed batches of 5..5 tokens, 0 LoRA{capped}",
        f"uncovered (runs eagerly): mixed batches of 9..10 tokens, 0 LoRA{capped}",
        "uncovered (runs eagerly): mixed batches of 513..100000000000 tokens, 0 LoRA",
    ]


@pytest.mark.slow  # the full-sized demo (200 steps) in a fresh interpreter
def test_the_readmes_demo_command_runs_as_a_user_runs_it() -> None:
    r = subprocess.run([sys.executable, "-m", "cgregistry", "demo"], capture_output=True, text=True, env=ENV, timeout=900)
    assert r.returncode == 0, r.stderr
    assert "checked 200 steps against eager: 0 mismatches" in r.stdout, r.stdout
    assert "NumPy" not in r.stderr


def test_demo_checks_every_step_against_eager(capsys: pytest.CaptureFixture[str], small_demo: None) -> None:
    code, out, err = run_main(capsys, "demo", "--backend", "cpu", "--steps", "40", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["steps"] == 40 and result["mismatches"] == 0
    assert result["hits"] + result["misses"] == 40 and result["hits"] > 0
    assert result["backend"] == "cpu"
    # the cpu backend emulates graphs: an eager/registry time ratio there is no speedup
    assert result["speedup"] is None and "cpu backend emulates graphs" in result["no_speedup_reason"]


def test_demo_prints_table_and_timing(capsys: pytest.CaptureFixture[str], small_demo: None) -> None:
    code, out, err = run_main(capsys, "demo", "--backend", "cpu", "--steps", "20")
    assert code == 0, err
    assert "checked 20 steps against eager: 0 mismatches" in out
    assert "timing over the same 20 steps: eager" in out
    assert "timings: the cpu backend emulates graphs (it runs the step eagerly), so no speedup is reported" in out
    assert not re.search(r"\d\.\d+x\b", out), "no speedup ratio on cpu"
    assert "key" in out and "strategy" in out
    assert "preference: full, piecewise, breakable (the mode's decode strategy, then its mixed one)" in out


def small_trace(tmp_path) -> str:  # noqa: ANN001
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(40):
        rows.append(f"2023-11-16 18:00:{i:02d}.0,{20 + 7 * (i % 5)},{3 + i % 4}")
    path = tmp_path / "trace.csv"
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_plan_on_trace_matches_in_process_evaluation(tmp_path) -> None:  # noqa: ANN001
    from cgregistry import CapturePlan
    from cgregistry.plan.fit import evaluate
    from cgregistry.plan.workload import SchedulerConfig, read_trace, schedule

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
    assert data["settings"]["capture_sizes"] == [1, 2, 4, 8, 16] and data["settings"]["max_capture_size"] == 16
    assert data["scheduler"] == {
        "trace": trace, "requests": 40, "limit": None, "max_num_seqs": 8, "max_num_batched_tokens": 64,
        "spec_depth": 0, "step_base_ms": 10.0, "step_per_token_us": 20.0,
    }
    assert "entries" not in fitted, "keys only with --show-sizes"


def test_plan_on_trace_prints_side_by_side_and_plots(tmp_path) -> None:  # noqa: ANN001
    pytest = __import__("pytest")
    pytest.importorskip("matplotlib")
    png = tmp_path / "waste.png"
    r = cli("plan", "--trace", small_trace(tmp_path), "--max-num-seqs", "8", "--max-num-tokens", "64", "--fit", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert "default" in r.stdout and "fitted (" in r.stdout
    assert "padding (of graph tokens)" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert r.stdout.rstrip().endswith(f"wrote padding plot to {png}")


def test_plan_on_missing_trace_says_which_file(tmp_path) -> None:  # noqa: ANN001
    r = cli("plan", "--trace", str(tmp_path / "nope.csv"))
    assert r.returncode == 2
    assert "nope.csv" in r.stderr


def test_plugins_lists_builtins_and_installed_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CGREGISTRY_DISABLE_PLUGIN_AUTOLOAD")
    r = cli("plugins", "--json")
    assert r.returncode == 0, r.stderr
    infos = {p["name"]: p for p in json.loads(r.stdout)}
    full = infos["cgregistry.strategies.full"]
    assert full["builtin"] and full["distribution"] == "cgregistry"
    assert full["hooks"] == ["cgregistry_register_strategies"] and full["provides"] == ["strategy full"]
    assert infos["cgregistry.backends.cpu"]["provides"] == ["backend cpu"]
    if "eager" in infos:  # the plugins/ packages, where installed (CI installs them)
        assert infos["eager"]["distribution"] == "cgregistry-eager" and infos["eager"]["provides"] == ["strategy eager"]
    table = cli("plugins")
    assert "cgregistry (built-in)" in table.stdout and "cgregistry_register_backends" in table.stdout


def test_demo_snapshot_then_inspect(tmp_path: Path, small_demo: None) -> None:
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
    # mode full captures one graph per shape: decode batches are served by mixed keys
    text = cli("inspect", str(snap), "--form", "mixed")
    assert text.returncode == 0, text.stderr
    table = text.stdout.split("entries on cpu")[0]
    keys = [line for line in table.splitlines() if line.startswith("Batch(")]
    assert keys and not any("uniform" in line for line in keys)
    uniform = cli("inspect", str(snap), "--kind", "uniform")
    assert uniform.returncode == 0 and not [line for line in uniform.stdout.splitlines() if line.startswith("Batch(")]


def test_inspect_errors_exit_2(tmp_path) -> None:  # noqa: ANN001
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": 7}')
    r = cli("inspect", str(bad))
    assert r.returncode == 2 and "snapshot schema 7 is not supported" in r.stderr
    r = cli("inspect", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "missing.json" in r.stderr


@pytest.fixture
def check_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """``check`` imports the target into this process: the path and module it adds go again after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(TESTS)  # `check MODULE:FUNCTION` finds modules of the current directory, as from a shell
    yield
    for name in ("check_targets", "my_step", "my_model"):
        sys.modules.pop(name, None)


def test_check_lists_unsafe_ops_with_lines(check_imports: None) -> None:
    r = cli("check", "check_targets:unsafe", "--json")
    assert r.returncode == 1, r.stderr
    found = json.loads(r.stdout)
    assert [f["op"].split(".")[1] for f in found] == ["item", "index"]
    assert all("check_targets.py:" in f["where"] for f in found)
    assert "n = int(x.sum().item())" in found[0]["where"]
    ok = cli("check", "check_targets:safe")
    assert ok.returncode == 0 and "no graph-unsafe ops found" in ok.stdout
    bad = cli("check", "check_targets:needs_args")
    assert bad.returncode == 2 and "needs arguments ['x']" in bad.stderr
    missing = cli("check", "no_such_module:f")
    assert missing.returncode == 2 and "cannot import module 'no_such_module'" in missing.stderr


def test_check_takes_a_file_path(check_imports: None, tmp_path: Path) -> None:
    r = cli("check", f"{TESTS / 'check_targets.py'}:unsafe", "--json")
    assert r.returncode == 1, r.stderr
    assert [f["op"].split(".")[1] for f in json.loads(r.stdout)] == ["item", "index"]
    step = tmp_path / "my_step.py"  # a file that imports its sibling, as it would run with `python my_step.py`
    (tmp_path / "my_model.py").write_text("import torch\n\ndef forward(x):\n    return x * 2\n")
    step.write_text("import torch\nfrom my_model import forward\n\ndef run():\n    forward(torch.ones(3))\n")
    ok = cli("check", f"{step}:run")
    assert ok.returncode == 0 and f"{step}:run: no graph-unsafe ops found" in ok.stdout
    for target, message in [
        (f"{tmp_path / 'nope.py'}:run", f"no file '{tmp_path / 'nope.py'}': expected MODULE:FUNCTION or FILE.py:FUNCTION"),
        (f"{step}:walk", f"file '{step}' has no function 'walk'"),
        (str(step), f"expected MODULE:FUNCTION or FILE.py:FUNCTION, got '{step}'"),
    ]:
        bad = cli("check", target)
        assert bad.returncode == 2 and bad.stderr == f"cgregistry check: error: {message}\n", bad.stderr


def test_inspect_refuses_a_strategy_the_snapshot_never_had_and_says_when_filters_leave_nothing(tmp_path: Path) -> None:
    reg = cg.GraphRegistry(lambda batch, x: x * 2, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu")
    reg.capture([(cg.BatchDescriptor(8), "full"), (cg.BatchDescriptor(4), "full")])
    snap = tmp_path / "snap.json"
    snap.write_text(json.dumps(reg.snapshot()))
    typo = cli("inspect", str(snap), "--strategy", "ful")
    assert typo.returncode == 2 and typo.stdout == ""
    assert typo.stderr == "cgregistry inspect: error: --strategy=ful: the snapshot has no strategy of that name; it knows breakable, full, piecewise\n"
    empty = cli("inspect", str(snap), "--strategy", "breakable", "--used")
    assert empty.returncode == 0, empty.stderr
    assert "no entry matches --strategy=breakable --used; the snapshot holds 2 entries" in empty.stdout
    listed = cli("inspect", str(snap), "--strategy", "full")
    assert "no entry matches" not in listed.stdout and listed.stdout.count("Batch(tokens=") == 2


def test_version_names_cgregistry_torch_and_python() -> None:
    r = cli("--version")
    assert r.returncode == 0 and r.stdout == f"cgregistry {cg.__version__} (torch {torch.__version__}, Python {platform.python_version()})\n"


def test_a_closed_output_pipe_ends_the_command_quietly() -> None:
    """``cgregistry plan --json | head -1``: the reader leaves early; no traceback, no "Broken pipe" error, exit 141."""
    big = ["plan", "--max-num-seqs", "4096", "--max-num-tokens", "65536", "--max-capture-size", "65536", "--json"]  # > a pipe's buffer
    proc = subprocess.Popen([sys.executable, "-m", "cgregistry", *big], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    assert proc.stdout.readline() == b"{\n"
    proc.stdout.close()  # what `head -1` does after its line
    assert proc.wait(timeout=300) == cli_module.EXIT_PIPE_CLOSED == 141
    assert proc.stderr.read() == b""
    proc.stderr.close()


def test_a_closed_pipe_in_process_returns_141_without_a_message(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert cli_module.main(["plan", "--max-num-seqs", "4", "--max-num-tokens", "16"]) == 141
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------- help and defaults


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    return cli_module.parsers()[1]


def test_every_option_has_help_and_shows_its_default() -> None:
    for name, parser in command_parsers().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{flag} has no help"
            if action.option_strings and action.default is not False:  # on/off flags are off unless given
                shown = cli_module.HelpFormatter(name)._get_help_string(action)
                assert "default:" in shown, f"{flag} does not show its default"
        text = parser.format_help()
        assert "None" not in text and "False" not in text, f"{name} --help shows a Python default"


def test_plan_and_demo_each_say_their_default_mode_and_why() -> None:
    plan = " ".join(command_parsers()["plan"].format_help().split())
    demo = " ".join(command_parsers()["demo"].format_help().split())
    assert "(default: full_and_breakable, what CapturePlan.build uses when no mode is given" in plan
    assert "(default: full, because the demo model is graph-safe end to end" in demo
    assert "`plan` defaults to full_and_breakable" in demo


# ---------------------------------------------------------------------------- plan: settings used


def test_plan_prints_the_settings_it_used(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "plan", "--max-num-seqs", "4", "--max-num-tokens", "16", "--max-loras", "2")
    assert code == 0, err
    header = out.split("\n\n")[0].splitlines()
    assert header[0] == "settings:"
    assert "  --mode             full_and_breakable: decode keys full, mixed keys breakable (any request count)  (default)" in header
    assert "  --capture-sizes    1,2,4,8 (4 sizes)  (default)" in header
    assert "  --max-capture-size 8  (default)" in header
    assert "  --lora-counts      0,1,2  (default)" in header
    assert "  --max-loras        2" in header


def test_plan_json_has_the_resolved_settings(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "plan", "--max-num-seqs", "4", "--max-num-tokens", "16", "--mode", "full,breakable",
                              "--spec-depths", "0,1", "--json")
    assert code == 0, err
    settings = json.loads(out)["settings"]
    assert settings == {
        "max_num_seqs": 4, "max_num_tokens": 16, "mode": ["full", "breakable"], "decode_strategy": "full",
        "mixed_strategy": "breakable", "mixed_relaxed": True, "capture_sizes": [1, 2, 4, 8, 16], "max_capture_size": 16,
        "spec_depths": [0, 1], "widest_decode": {"0": 4, "1": 4}, "lora_counts": [0], "max_loras": None,
        "separate_decode": False, "size_multiple": 1, "ubatch_threshold": None, "uniform_keys": "separate: full uniform keys, breakable mixed keys",
        "decode_reqs": {"0": [1, 2, 4], "1": [1, 2, 4]}, "mixed_sizes": [1, 2, 4, 8, 16], "unsupported": {}, "strategy_unsupported": {},
        "downgrades": [],
    }


# ---------------------------------------------------------------------------- plan: options that need another


@pytest.mark.parametrize(("args", "message"), [
    (["--plot", "x.png"], "--plot needs --trace FILE"),
    (["--limit", "5"], "--limit needs --trace FILE"),
    (["--spec-depth", "1"], "--spec-depth needs --trace FILE"),
    (["--step-base-ms", "5"], "--step-base-ms needs --trace FILE"),
    (["--step-per-token-us", "1"], "--step-per-token-us needs --trace FILE"),
    (["--fit"], "--fit needs --trace FILE"),
    (["--fit", "4", "--limit", "9"], "--limit, --fit need --trace FILE"),
    (["--show-sizes"], "--show-sizes needs --trace FILE and --fit"),
    (["--trace", "bundled", "--show-sizes"], "--show-sizes needs --fit"),
])
def test_an_option_that_does_nothing_alone_is_an_error(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code, out, err = run_main(capsys, "plan", "--max-num-seqs", "4", "--max-num-tokens", "16", *args)
    assert code == 2 and out == ""
    assert f"cgregistry plan: error: {message}" in err
    assert err.startswith("usage: cgregistry plan")


def test_plot_path_goes_in_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "waste.png"
    code, out, err = run_main(capsys, "plan", "--trace", small_trace(tmp_path), "--max-num-seqs", "8", "--max-num-tokens", "64",
                              "--fit", "6", "--show-sizes", "--plot", str(png), "--json")
    assert code == 0, err
    data = json.loads(out)  # stays valid JSON: nothing else on stdout
    assert data["plot"] == str(png) and png.exists()
    assert all(plan["entries"] for plan in data["plans"].values()), "--show-sizes lists each plan's keys in JSON"


# ---------------------------------------------------------------------------- plan: errors name the flags


@pytest.mark.parametrize(("args", "message"), [
    (["--capture-sizes", "1,2,3,700", "--max-num-tokens", "512"],
     "--capture-sizes=1,2,3,700: the largest, 700, exceeds --max-num-tokens=512: no batch can be that large"),
    (["--max-capture-size", "700", "--max-num-tokens", "512"], "--max-capture-size=700 exceeds --max-num-tokens=512"),
    (["--capture-sizes", "8,100", "--max-capture-size", "64"],
     "--capture-sizes=8,100: 100 exceed --max-capture-size=64; raise --max-capture-size or drop those sizes"),
    (["--capture-sizes", "0,4"], "--capture-sizes must hold ints >= 1, got 0"),
    (["--max-capture-size", "0"], "--max-capture-size must be a positive int, got 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be a positive int, got 0"),
    (["--max-num-tokens", "-5"], "--max-num-tokens must be a positive int, got -5"),
    (["--lora-counts", "0,1", "--max-loras", "4"], "--lora-counts=0,1 do not reach --max-loras=4"),
    (["--lora-counts", "0,8", "--max-loras", "4"], "--lora-counts=0,8 go beyond --max-loras=4"),
    (["--lora-counts", "-1"], "--lora-counts must hold ints >= 0, got -1"),
    (["--max-loras", "0"], "--max-loras must be a positive int, got 0"),
    (["--spec-depths", "0,9", "--max-num-seqs", "4", "--max-num-tokens", "8"],
     "depth 9 of --spec-depths needs 10 tokens per request but --max-num-tokens=8"),
    (["--spec-depths", "-1"], "--spec-depths must hold ints >= 0, got -1"),
    (["--mode", "full,nope"], "--mode=full,nope: strategy 'nope' is not registered"),
])
def test_plan_errors_name_the_flag_and_value(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code, out, err = run_main(capsys, "plan", *args)
    assert code == 2 and out == ""
    assert err.startswith("cgregistry plan: error: ") and message in err
    internal = [name for name in cli_module.SETTING_FLAGS if name in err] + (["mode ("] if "mode (" in err else [])
    assert internal == [], f"internal setting names in {err!r}"
    assert "Traceback" not in err


@pytest.mark.parametrize(("args", "message"), [
    (["--mode", "bogus"], "argument --mode: unknown mode 'bogus'"),
    (["--capture-sizes", ","], "argument --capture-sizes: expected comma-separated integers, got ','"),
    (["--trace", "bundled", "--limit", "0"], "argument --limit: expected an integer >= 1, got 0"),
    (["--trace", "bundled", "--fit", "0"], "argument --fit: expected an integer >= 1, got 0"),
    (["--trace", "bundled", "--spec-depth", "-1"], "argument --spec-depth: expected an integer >= 0, got -1"),
    (["--trace", "bundled", "--step-base-ms", "-1"], "argument --step-base-ms: expected a finite number >= 0, got -1"),
    (["--trace", "bundled", "--step-per-token-us", "x"], "argument --step-per-token-us: expected a number >= 0, got 'x'"),
])
def test_bad_flag_values_are_refused_while_parsing(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code, out, err = run_main(capsys, "plan", *args)
    assert code == 2 and out == "" and message in err


def test_fit_budget_error_names_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(capsys, "plan", "--trace", small_trace(tmp_path), "--max-num-seqs", "8", "--max-num-tokens", "64", "--fit", "1")
    assert code == 2
    assert "cgregistry plan: error: --fit=1 cannot hold one graph per key family" in err


# ---------------------------------------------------------------------------- inspect --explain


@pytest.mark.parametrize(("explain", "message"), [
    ("3,3,0,0,unifrom", "uniform (field 5 of tokens,reqs[,loras[,depth[,uniform]]]) must be one of "
                        "uniform, true, yes, 1, mixed, false, no, 0; got 'unifrom'"),
    ("3,x", "reqs (field 2 of tokens,reqs[,loras[,depth[,uniform]]]) must be an integer or 'any', got 'x'"),
    ("3,3,one", "loras (field 3 of tokens,reqs[,loras[,depth[,uniform]]]) must be an integer, got 'one'"),
    ("1,2,3,4,5,6", "(1 to 5 fields), got '1,2,3,4,5,6' (6 fields)"),
    ("0,1", "'0,1': tokens must be positive, got 0"),
    ("3,any,0,0,uniform", "uniform needs reqs"),
])
def test_explain_refuses_a_bad_field_naming_it(capsys: pytest.CaptureFixture[str], explain: str, message: str) -> None:
    # --explain is checked while parsing, before the snapshot is read
    code, out, err = run_main(capsys, "inspect", "never-read.json", "--explain", explain)
    assert code == 2 and out == ""
    assert "argument --explain: " in err and message in err


def test_explain_reads_every_uniform_word() -> None:
    from cgregistry import BatchDescriptor as B

    assert cli_module.parse_descriptor("3,3,0,0,Uniform") == B(3, 3, 0, 0, True)
    assert cli_module.parse_descriptor("3,3,0,0,mixed") == B(3, 3, 0, 0, False)
    assert cli_module.parse_descriptor("4,any") == B(4)
    assert cli_module.parse_descriptor("6,3,1,1,yes") == B.decode(3, 1, 1)


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


@pytest.mark.parametrize("mode", [
    pytest.param(m, marks=[pytest.mark.filterwarnings("ignore:.*with no graph captured or planned:RuntimeWarning")] if m == "none" else [])
    for m in MODES
])
def test_demo_runs_every_mode_the_cli_offers(capsys: pytest.CaptureFixture[str], mode: str, small_demo: None) -> None:
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


def test_demo_errors_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(capsys, "demo", "--backend", "gpu")
    assert code == 2 and "cgregistry demo: error: --backend=gpu: not registered; available:" in err
    code, _, err = run_main(capsys, "demo", "--mode", "full,nope")
    assert code == 2 and "cgregistry demo: error: --mode=full,nope: strategy 'nope' is not registered" in err
    code, _, err = run_main(capsys, "demo", "--steps", "0")
    assert code == 2 and "argument --steps: expected an integer >= 1, got 0" in err


class OwnGraphs:
    """A plugin strategy of exact-request keys, as a vendor's would be: one full graph per key."""

    name = "own"
    relaxes_num_reqs = False

    def capture(self, body, backend, pool):  # noqa: ANN001, ANN201
        return backend.capture(body, pool)


class OwnPlugin:
    @cg.plugin.hookimpl
    def cgregistry_register_strategies(self, register) -> None:  # noqa: ANN001
        register(OwnGraphs())


def test_demo_puts_the_modes_decode_strategy_first_unless_told_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, small_demo: None,
) -> None:
    """``--mode own,full``: a plugin strategy is not in the library's default preference, so it ranks last, the full
    mixed keys would serve every decode batch and its decode keys never replay; the demo prefers the mode's decode strategy."""
    import cgregistry.cli.demo

    monkeypatch.setattr(cgregistry.cli.demo, "Plugins", lambda: cg.Plugins(cg.plugin.make_plugin_manager([OwnPlugin()], autoload=False)))
    served = {}
    for name, extra in (("default", []), ("given", ["--preference", "full,own"])):
        snap = tmp_path / f"{name}.json"
        code, out, err = run_main(capsys, "demo", "--backend", "cpu", "--steps", "12", "--mode", "own,full", "--snapshot", str(snap), *extra)
        assert code == 0, err
        served[name] = cg.load_snapshot(snap).stats.by_strategy
    assert "preference: full, own (given)" in out
    assert served["default"]["own"] > 0 and served["given"]["own"] == 0
    assert served["given"]["full"] == served["default"]["full"] + served["default"]["own"]  # the same steps, by other keys
    code, _, err = run_main(capsys, "demo", "--preference", "full,nope")
    assert code == 2 and "cgregistry demo: error: --preference=full,nope: strategy 'nope' is not registered; available:" in err


def test_mode_preference_puts_decode_then_mixed_strategy_first() -> None:
    from cgregistry.plan import mode_preference

    assert mode_preference("full_and_piecewise") == ("full", "piecewise", "breakable")
    assert mode_preference(("timed", "breakable")) == ("timed", "breakable", "full", "piecewise")
    assert mode_preference((None, "timed")) == ("timed", "full", "piecewise", "breakable")
    assert mode_preference("none") == ("full", "piecewise", "breakable")


# ---------------------------------------------------------------------------- install


def test_numpy_is_a_dependency() -> None:
    # torch's CPU wheel does not depend on numpy and warns "Failed to initialize NumPy" on import without it.
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"numpy\b", d) for d in deps)


def test_plan_shows_how_uniform_batches_get_graphs_and_counts_per_class(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "plan", "--max-num-seqs", "256", "--mode", "full")
    assert code == 0, err
    assert "  --separate-decode  no  (default)" in out
    assert "  uniform keys       shared: one full graph per token count" in out
    assert "51 graphs: 51 full/mixed/lora0" in out
    code, out, err = run_main(capsys, "plan", "--max-num-seqs", "256", "--mode", "full", "--separate-decode")
    assert "  --separate-decode  yes" in out and "86 graphs: 51 full/mixed/lora0, 35 full/uniform-d0/lora0" in out
    code, out, err = run_main(capsys, "plan", "--max-num-seqs", "100", "--mode", "piecewise", "--spec-depths", "4", "--json")
    data = json.loads(out)
    assert data["graphs_by_class"] == {"piecewise/mixed/lora0": 58}
    assert data["settings"]["mixed_sizes"][:4] == [1, 2, 4, 5]
    code, out, err = run_main(capsys, "plan", "--max-num-seqs", "18", "--size-multiple", "4", "--mode", "full")
    assert code == 2 and "--size-multiple=4: uniform keys of spec depth 0" in err and "--max-num-seqs=18" in err
    code, out, err = run_main(capsys, "plan", "--max-num-seqs", "16", "--size-multiple", "4", "--mode", "full")
    assert code == 0 and "  --size-multiple    4" in out

"""The command line as a user runs it: a subprocess, exit codes and output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ENV = {**os.environ, "CGREGISTRY_DISABLE_PLUGIN_AUTOLOAD": "1"}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cgregistry.cli", *args], capture_output=True, text=True, env=ENV, timeout=600)


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


def test_demo_prints_table_and_timing() -> None:
    r = cli("demo", "--backend", "cpu", "--steps", "20")
    assert r.returncode == 0, r.stderr
    assert "checked 20 steps against eager: 0 mismatches" in r.stdout
    assert "timing over the same 20 steps: eager" in r.stdout
    assert "key" in r.stdout and "strategy" in r.stdout

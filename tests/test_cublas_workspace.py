"""Graphs keep working when something else clears cuBLAS's workspaces (reduce-overhead does, on every warm-up).

Each scenario runs in a child process: a graph that replays into freed memory can fault and end the process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def run_worker(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "CGREGISTRY_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run([sys.executable, "-m", "tests.cublas_workspace_worker", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.cuda
@pytest.mark.parametrize("scenario", ["cleared", "breakable", "reduce-overhead"])
def test_replay_survives_cleared_cublas_workspaces(scenario: str) -> None:
    result = run_worker(scenario)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "0 wrong replays, 0 filler tensors overwritten" in result.stdout

"""Every file in examples/ runs and exits cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


# Slow: the hf_ examples serve a Hugging Face model through every mode (tests/cli/test_hf_*.py cover them in the default
# run); piecewise.py and spec_decode.py take 3 s each (tests/strategies and the speculative-key tests cover what they show).
SLOW = {"hf_llama.py", "hf_spec_decode.py", "piecewise.py", "spec_decode.py"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=[pytest.mark.slow] if p.name in SLOW else []) for p in EXAMPLES],
                         ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    if path.name.startswith("hf_"):
        pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")
    env = {**os.environ, "CGREGISTRY_DISABLE_PLUGIN_AUTOLOAD": "1"}
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip(), "an example prints what it shows"


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"quickstart.py", "trace_replay.py"}

"""Every python code block in README.md and docs/*.md runs (blocks of one file share a namespace)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_code_blocks_run(page: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A real module, as a script would have: torch.compile looks the blocks' globals up by module name.
    module = types.ModuleType(f"docs_{page.stem.replace('-', '_')}")
    sys.modules[module.__name__] = module
    try:
        for i, block in enumerate(BLOCK.findall(page.read_text())):
            code = compile(block, f"{page.name}[block {i}]", "exec")
            exec(code, module.__dict__)  # noqa: S102 - the docs are ours
    finally:
        del sys.modules[module.__name__]


def test_docs_exist() -> None:
    names = {p.name for p in PAGES}
    assert {
        "README.md", "concepts.md", "integration.md", "cpu-emulator.md", "performance.md", "strategies.md",
        "inspection.md", "troubleshooting.md", "hooks.md", "writing-plugins.md", "plans-and-workloads.md",
        "reliability.md", "distributed.md", "architecture.md", "background.md",
    } <= names


def test_docs_links_resolve() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+\.md)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"

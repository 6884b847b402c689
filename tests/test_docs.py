"""Every python code block in README.md and docs/*.md runs, and prints what the page shows it printing.

Each block runs on its own, as a reader pastes it, except on the pages that build one example
step by step (``SEQUENTIAL``, each saying so at its top): their blocks run in order in one namespace.

Printed output: a block that prints is followed on its page by a ```text block holding what it prints (only blank
lines between the two). The two are compared as doctest compares, with ELLIPSIS (``...`` stands for any text: a
timing, an address, a registry's numbered name) and NORMALIZE_WHITESPACE (a run of spaces or newlines equals any
other, so a table's columns may be wider or narrower than shown). A block that prints with no such block after it
fails, and so does an output block after a block that prints nothing. Comments in a block say what a value means;
the ```text block says what it is.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
# Pages whose blocks continue one another (one registry or plan through the page).
SEQUENTIAL = {"inspection.md", "minimal-engine.md", "plans-and-workloads.md", "writing-plugins.md", "adaptive.md", "lifecycle.md"}
SEQUENTIAL_NOTE = "The blocks of this page run in order, as one session"
OUTPUT_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def python_blocks(text: str) -> list[tuple[str, str | None]]:
    """Each python block of a page, with the output the ```text block right after it shows (None: no such block)."""
    fences = list(FENCE.finditer(text))
    blocks = []
    for this, after in zip(fences, [*fences[1:], None]):
        if this.group(1) != "python":
            continue
        shown = None
        if after is not None and after.group(1) == "text" and not text[this.end():after.start()].strip():
            shown = after.group(2)
        blocks.append((this.group(2), shown))
    return blocks


def check_output(page: Path, i: int, block: str, shown: str | None, printed: str) -> None:
    """What block ``i`` printed is what the page shows after it (see the module docstring)."""
    where = f"{page.name}[block {i}]"
    if shown is None:
        if printed:
            pytest.fail(f"{where} prints, but no ```text block right after it shows what:\n{printed}")
        return
    checker = doctest.OutputChecker()
    if not checker.check_output(shown, printed, OUTPUT_FLAGS):
        pytest.fail(f"{where} prints other than its ```text block shows:\n"
                    + checker.output_difference(doctest.Example("", shown), printed, OUTPUT_FLAGS))


def run_blocks(page: Path, blocks: list[tuple[int, str, str | None]]) -> None:
    """Run ``blocks`` (index, code, output shown) in order in one fresh module (a real module, as a script has:
    torch.compile looks the blocks' globals up by module name), checking what each prints."""
    module = types.ModuleType(f"docs_{page.stem.replace('-', '_')}")
    sys.modules[module.__name__] = module
    try:
        for i, block, shown in blocks:
            code = compile(block, f"{page.name}[block {i}]", "exec")
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(code, module.__dict__)  # noqa: S102 - the docs are ours
            check_output(page, i, block, shown, printed.getvalue())
    finally:
        del sys.modules[module.__name__]


# Pages whose blocks take seconds (torch.compile, a plugin's whole plan): in the slow set, which CI runs too.
SLOW_PAGES = {"integration.md", "writing-plugins.md"}

# Warnings a page's blocks raise on purpose (the page says so), by page.
EXPECTED_WARNINGS = {
    "reliability.md": "ignore:.*with no graph captured or planned:RuntimeWarning",  # a run after clear()
}


@pytest.mark.parametrize("page", [
    pytest.param(p, marks=([pytest.mark.filterwarnings(EXPECTED_WARNINGS[p.name])] if p.name in EXPECTED_WARNINGS else [])
                 + ([pytest.mark.slow] if p.name in SLOW_PAGES else []))
    for p in PAGES
], ids=[p.name for p in PAGES])
def test_code_blocks_run_and_print_what_the_page_shows(page: Path) -> None:
    blocks = [(i, block, shown) for i, (block, shown) in enumerate(python_blocks(page.read_text()))]
    if page.name in SEQUENTIAL:
        run_blocks(page, blocks)
    else:
        for block in blocks:  # each on its own: a reader copies one block, not the page
            run_blocks(page, [block])


def test_sequential_pages_say_so() -> None:
    for name in SEQUENTIAL:
        text = " ".join((ROOT / "docs" / name).read_text().split())
        assert SEQUENTIAL_NOTE in text, f"{name} does not say its blocks run in order"


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


def test_the_readmes_test_command_is_what_ci_runs_then_the_slow_set() -> None:
    """README, .ci/run and pyproject agree: the README's command is the default run (no slow set), CI runs it and
    then ``python -m pytest -m slow``."""
    tomllib = pytest.importorskip("tomllib")
    readme = (ROOT / "README.md").read_text()
    install, test = re.search(r"```bash\npip install (-e '\.\[test\]'[^\n]*) && (python -m pytest)\n```", readme).groups()
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    ci = [line for line in ci if line]
    assert f"python -m pip install -q {install}" in ci
    assert ci.index(test) < ci.index("python -m pytest -m slow"), "CI runs the README's command, then the slow set"
    assert "`python -m pytest -m slow`" in readme
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "-m 'not slow'" in options["addopts"] and any(m.startswith("slow:") for m in options["markers"])

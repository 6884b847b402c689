"""Graphs per mode: cgregistry's default plan against vLLM's model runners V1 and V2 at the same settings.

The table in docs/plans-and-workloads.md is this module's output (``python -m tests.vllm_graph_table``
prints it; tests/plans/test_vllm.py checks the page holds it).  vLLM's counts come from
``tests/vllm_reference.py`` (LoRA with vLLM's defaults: graphs for 0 and ``max_loras + 1`` adapters).
"""

from __future__ import annotations

from cgregistry import CapturePlan
from tests.vllm_reference import MODE_OF, V1Dispatcher, V2Manager, VllmSettings

# (max_num_seqs, max_num_batched_tokens, spec depth k, max_loras)
CONFIGS: list[tuple[int, int, int, int | None]] = [
    *((256, 8192, k, None) for k in range(5)),
    (64, 2048, 0, 4),
    (64, 2048, 2, 4),
]
MODES = ["full", "piecewise", "full_decode_only", "full_and_piecewise"]


def counts(mode: str, n: int, budget: int, k: int, loras: int | None) -> tuple[int, int, int]:
    """Graphs captured by cgregistry's default plan, vLLM V1 and vLLM V2 for one mode and config."""
    plan = CapturePlan.build(max_num_seqs=n, max_num_tokens=budget, mode=mode, spec_depths=(k,), max_loras=loras)
    v = VllmSettings(MODE_OF[mode], n, budget, k, max_loras=loras)
    return len(plan), V1Dispatcher(v).graphs(), V2Manager(v).graphs()


def table() -> str:
    """The markdown table: one row per config, one column per mode, each cell ``cgregistry / V1 / V2``."""
    head = ["| max_num_seqs / tokens | k | LoRA | " + " | ".join(f"`{m}`" for m in MODES) + " |",
            "|---|---|---|" + "---|" * len(MODES)]
    rows = []
    for n, budget, k, loras in CONFIGS:
        cells = [" / ".join(map(str, counts(mode, n, budget, k, loras))) for mode in MODES]
        rows.append(f"| {n} / {budget} | {k} | {loras or '-'} | " + " | ".join(cells) + " |")
    return "\n".join([*head, *rows])


if __name__ == "__main__":
    print(table())

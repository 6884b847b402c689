"""LoRA specialisation: one graph per active-adapter count, each batch served by the smallest count that fits.

The batched adapter layer loops over the active adapter slots, so the loop count
is frozen into each graph: graphs are captured for 0, 1, 2 and 4 active adapters
(``max_loras=4``), a batch with 3 uses the 4-slot graph, and a batch without
adapters uses the no-LoRA graph.  Every output is checked against eager.
"""

import torch

import cgregistry as cg

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
hidden, rank, max_loras, max_tokens = 64, 8, 4, 64
g = torch.Generator().manual_seed(0)
base = (torch.randn(hidden, hidden, generator=g) / hidden**0.5).to(device)
lora_a = (torch.randn(max_loras, hidden, rank, generator=g) / hidden**0.5).to(device)  # adapters loaded into slots
lora_b = (torch.randn(max_loras, rank, hidden, generator=g) / rank**0.5).to(device)


def step(batch: cg.BatchDescriptor, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Base projection plus each active adapter on the tokens mapped to its slot (-1: no adapter)."""
    out = x @ base
    for s in range(batch.num_active_loras):  # frozen per graph: the reason for per-count keys
        mask = (slot == s).unsqueeze(-1).to(x.dtype)
        out = out + mask * ((x @ lora_a[s]) @ lora_b[s])
    return out


reg = cg.GraphRegistry(step, {"x": cg.StaticInput((max_tokens, hidden), torch.float32), "slot": cg.StaticInput((max_tokens,), torch.long, fill=-1)})
plan = cg.CapturePlan.build(max_num_seqs=16, max_num_tokens=max_tokens, mode="full", max_loras=max_loras)
with torch.inference_mode():
    reg.capture(plan)
print("LoRA counts captured:", sorted({e.key.num_active_loras for e in reg.entries()}))

with torch.inference_mode():
    for tokens, reqs, active in [(5, 5, 0), (9, 4, 1), (12, 6, 2), (7, 3, 3), (30, 10, 4), (16, 16, 3)]:
        batch = cg.BatchDescriptor(tokens, reqs, num_active_loras=active, uniform=tokens == reqs)
        x = torch.randn(tokens, hidden, generator=g).to(device)
        slot = torch.randint(-1, active, (tokens,), generator=g).to(device) if active else torch.full((tokens,), -1, device=device)
        out = reg.run(batch, x=x, slot=slot)
        torch.testing.assert_close(out, step(batch, x, slot), rtol=1e-4, atol=1e-4)
        match = reg.match(batch)
        print(f"{tokens:2} tokens, {active} active adapters -> graph for {match.key.num_active_loras} (key {match.key})")

print(f"all outputs equal eager; {reg.stats().hits} hits, {reg.stats().misses} misses")

"""Put a GraphRegistry between a scheduler and a model: capture once, run every step through it."""

import torch

import cgregistry as cg

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # backend="auto" makes the same choice
hidden, max_tokens, max_seqs = 64, 128, 32
weight = torch.randn(hidden, hidden, device=device)
embed = torch.randn(1000, hidden, device=device)
num_slots = 256
scratch_slot = num_slots - 1  # a KV cell no request owns: padded rows, and capture, write only here
kv_cache = torch.zeros(num_slots, hidden, device=device)


def step(batch: cg.BatchDescriptor, input_ids: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """The engine's forward; sees the padded key and static buffers sized for it.

    It writes engine state, like a real step: capture runs it too, on buffers reset to their fills.
    """
    h = embed[input_ids] @ weight
    kv_cache.index_copy_(0, slot_mapping, h)
    return torch.tanh(h)


inputs = {
    "input_ids": cg.StaticInput((max_tokens,), torch.long, fill=0),  # integer inputs say their padding value
    "slot_mapping": cg.StaticInput((max_tokens,), torch.long, fill=scratch_slot),
    "seq_lens": cg.StaticInput((max_seqs,), torch.int32, axis="reqs", fill=1),
}
reg = cg.GraphRegistry(step, inputs, backend="auto")
assert reg.device.type == device.type
reg.capture(cg.CapturePlan.build(max_num_seqs=max_seqs, max_num_tokens=max_tokens, mode="full"))

for num_reqs in (3, 17, 32):  # the scheduler's decode batches
    batch = cg.BatchDescriptor.decode(num_reqs)
    ids = torch.randint(0, 1000, (num_reqs,), device=reg.device)
    slots = torch.randperm(scratch_slot, device=reg.device)[:num_reqs]  # each request's own cache cell
    lens = torch.randint(1, 100, (num_reqs,), dtype=torch.int32, device=reg.device)
    out = reg.run(batch, input_ids=ids, slot_mapping=slots, seq_lens=lens)
    written = kv_cache[slots].clone()
    assert torch.allclose(out, step(batch, ids, slots, lens), atol=1e-4)
    assert torch.allclose(written, kv_cache[slots], atol=1e-4), "the graph wrote the cache rows eager writes"
    print(batch, "->", reg.match(batch).key, tuple(out.shape))

print(reg.explain(cg.BatchDescriptor.decode(17)))
print(reg.stats())

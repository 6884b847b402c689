"""Piecewise: trace a model once with torch.compile, split it at its attention, graph each piece per size.

The attention reads host-side lengths (a Python list from the engine), so it cannot live in a
graph: a full graph would freeze the lengths it saw at capture.  It is a custom op, named as the
splitting op; the pieces around it are captured for every size of the plan from one dynamic
trace, and the attention runs eagerly between them with the live batch's lengths.
"""

import torch
from torch import nn

import cgregistry as cg

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
hidden, ctx, max_tokens, max_seqs = 32, 16, 64, 16


@torch.library.custom_op("cgregistry_example::ragged_attention", mutates_args=("out",))
def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """Row r attends to the first lens[r] cached positions; lens is a host list from run(context=...)."""
    batch = cg.current_batch()
    lens = batch.payload["lens"] if batch is not None and batch.payload is not None else []
    for r in range(q.shape[0]):
        n = lens[r] if r < len(lens) else ctx  # padded rows: any valid length
        out[r].copy_((k[r, :n] @ q[r]).softmax(0) @ v[r, :n])


@ragged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    return None


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        self.register_buffer("k_cache", torch.randn(max_tokens, ctx, hidden))
        self.register_buffer("v_cache", torch.randn(max_tokens, ctx, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.tanh(self.proj(x))
        attn = torch.empty_like(q)
        t = q.shape[0]
        torch.ops.cgregistry_example.ragged_attention(q, self.k_cache[:t], self.v_cache[:t], attn)
        return x + self.mlp(attn)


model = Model().to(device).eval()
reg = cg.GraphRegistry(lambda batch, x: compiled(x), {"x": cg.StaticInput((max_tokens, hidden), torch.float32)})
compiled = reg.compile(model, splitting_ops=["cgregistry_example::ragged_attention"])
plan = cg.CapturePlan.build(max_num_seqs=max_seqs, max_num_tokens=max_tokens, mode="piecewise")
reg.capture(plan, context={"lens": [ctx] * max_tokens})
print(f"{len(reg)} graphs from {len(compiled.compiler.traces)} trace; pieces per entry: {compiled.compiler.pieces}")

g = torch.Generator().manual_seed(0)
with torch.inference_mode():
    for tokens, reqs in ((5, 2), (9, 9), (24, 11)):
        batch = cg.BatchDescriptor(tokens, reqs, uniform=tokens == reqs)
        x = torch.randn(tokens, hidden, generator=g).to(device)
        lens = torch.randint(1, ctx + 1, (tokens,), generator=g).tolist()
        out = reg.run(batch, x=x, context={"lens": lens})
        with cg.eager_batch(batch, {"lens": lens}):
            want = model(x)
        match = reg.match(batch)
        assert match.strategy == "piecewise" and torch.allclose(out, want, atol=1e-4), "piecewise reads the live lengths"
        print(f"{batch} -> {match.key} [{match.strategy}], matches eager")
print(reg.table())

"""Dynamic speculative decoding: a draft-and-verify loop whose depth changes with the batch size.

The target model's registry holds one uniform graph per (request count, depth):
at 8 tokens there are keys for 8 x 1, 4 x 2 and 2 x 4.  The drafter (query
length 1) has its own registry.  Every output is checked against eager.
"""

import torch

import cgregistry as cg
from cgregistry.demo_model import DemoConfig, DemoDecoder, demo_inputs
from cgregistry.plan.workload import SchedulerConfig

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dtype = torch.float32
target_cfg = DemoConfig(layers=2, hidden=64, heads=4, ffn=128, vocab=256, max_num_seqs=16, max_num_tokens=64, context=16, dtype=dtype)
draft_cfg = DemoConfig(layers=1, hidden=32, heads=2, ffn=64, vocab=256, max_num_seqs=16, max_num_tokens=16, context=16, dtype=dtype)
scheduler = SchedulerConfig(max_num_seqs=16, spec_schedule={4: 3, 16: 1})  # deep speculation only for small batches
schedule = {4: (0, 1, 3), 16: (0, 1)}  # graphs for the depths each batch size can use (0: no drafts accepted)

target = DemoDecoder(target_cfg, device, seed=1)
drafter = DemoDecoder(draft_cfg, device, seed=2)
verify = cg.GraphRegistry(target, demo_inputs(target_cfg), backend="auto")
draft = cg.GraphRegistry(drafter, demo_inputs(draft_cfg), backend="auto")
with torch.inference_mode():
    verify.capture(cg.CapturePlan.build(max_num_seqs=16, max_num_tokens=64, mode="full_decode_only", spec_depths=schedule))
    draft.capture(cg.CapturePlan.build(max_num_seqs=16, max_num_tokens=16, mode="full_decode_only"))
at8 = sorted(f"{d.num_reqs}x{1 + d.spec_depth}" for d in (e.key for e in verify.entries()) if d.num_tokens == 8)
print("verify graphs at 8 tokens:", ", ".join(at8))


def checked(reg: cg.GraphRegistry, model: DemoDecoder, batch: cg.BatchDescriptor, **inputs: torch.Tensor) -> torch.Tensor:
    got = reg.run(batch, **inputs).clone()
    torch.testing.assert_close(got, model(batch, **inputs), rtol=1e-4, atol=1e-4)
    return got


gen = torch.Generator().manual_seed(0)
accepted = proposed = 0
with torch.inference_mode():
    for num_reqs in (2, 3, 7, 12, 4, 1, 16):
        depth = scheduler.depth_for(num_reqs)
        lens = torch.randint(1, 17, (num_reqs,), generator=gen).to(device)
        last = torch.randint(0, 256, (num_reqs,), generator=gen).to(device)
        proposals = [last]
        for _ in range(depth):  # the drafter proposes one token per request per step
            logits = checked(draft, drafter, cg.BatchDescriptor.decode(num_reqs), input_ids=proposals[-1], req_idx=torch.arange(num_reqs, device=device), seq_lens=lens)
            proposals.append(logits.argmax(-1))
        batch = cg.BatchDescriptor.decode(num_reqs, spec_depth=depth)  # verify 1 + depth tokens per request
        ids = torch.stack(proposals, dim=1).reshape(-1)
        req_idx = torch.arange(num_reqs, device=device).repeat_interleave(1 + depth)
        logits = checked(verify, target, batch, input_ids=ids, req_idx=req_idx, seq_lens=lens)
        if depth:
            agree = logits.view(num_reqs, 1 + depth, -1)[:, :-1].argmax(-1) == torch.stack(proposals[1:], dim=1)
            accepted += int(agree.cumprod(dim=1).sum())
            proposed += num_reqs * depth
        print(f"{num_reqs:2} requests, depth {depth}: verified by {verify.match(batch).key}")

print(f"all outputs equal eager; {accepted}/{proposed} draft tokens accepted (random weights)")
print(f"verify registry: {verify.stats().hits} hits, {verify.stats().misses} misses; draft registry: {draft.stats().hits} hits")

"""How well does a capture plan serve real traffic?  Replay the bundled Azure trace through a scheduler."""

from collections import Counter

import cgregistry as cg
from cgregistry.plan.workload import SchedulerConfig, read_trace, schedule

config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)
steps = list(schedule(read_trace(limit=3000), config))
plan = cg.CapturePlan.build(max_num_seqs=256, max_num_tokens=8192, mode="full")
matcher = cg.Matcher((e.descriptor, e.strategy) for e in plan)

served = padded = real = 0
misses: Counter[str] = Counter()
for batch in steps:
    match = matcher.match(batch)
    if match is None:
        misses["uniform" if batch.uniform else "mixed"] += 1
        continue
    served += 1
    real += batch.num_tokens
    padded += match.padding.tokens

print(f"{len(steps)} steps, {len(plan)} graphs: {served / len(steps):.1%} served by graphs, misses {dict(misses)}")
print(f"padding: {padded / (real + padded):.1%} of tokens computed by graphs")

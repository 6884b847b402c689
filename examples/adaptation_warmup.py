"""Adaptation while the traffic is still warming up: padding over the first steps of the bundled trace.

A server's first thousands of steps are not its steady traffic: on the bundled Azure trace (256
sequences, 8192-token budget) batches hold 3 requests on average over the first 2000 steps, then
10 to 20.  A refit fits the plan to the steps seen so far, so a refit during the warm-up gives a plan
of small keys, and each larger batch pads up to the keys every plan keeps (the widest decode batch,
the max capture size) until the next refits catch up.  This replays the adaptation policy
(``cgregistry.plan.adapt.replay``) over those steps for a few settings and prints the padding of each
window of steps; ``--plot PNG`` draws it (docs/img/adaptation-warmup.png).

    python examples/adaptation_warmup.py
    python examples/adaptation_warmup.py --plot docs/img/adaptation-warmup.png
"""

from __future__ import annotations

import argparse
from collections import Counter

import cgregistry as cg
from cgregistry.plan.adapt import Adaptation, replay
from cgregistry.plan.fit import evaluate
from cgregistry.plan.workload import SchedulerConfig, read_trace, schedule

ENGINE = cg.PlanSettings(max_num_seqs=256, max_num_tokens=8192)
SCHEDULER = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)


def trace_steps(count: int) -> list[cg.BatchDescriptor]:
    """The first ``count`` scheduler steps of the bundled trace."""
    return list(schedule(read_trace(limit=2000), SCHEDULER, max_steps=count))


def per_real_token(scores: list) -> list[float]:
    return [s.padded_tokens / s.real_tokens if s.real_tokens else 0.0 for s in scores]


def curves(steps: list[cg.BatchDescriptor], window: int) -> dict[str, list[float]]:
    """Padded tokens per real token of each window, for each setting."""
    default = [(e.descriptor, e.strategy) for e in cg.CapturePlan.build(ENGINE)]
    windows = [Counter(steps[i:i + window]) for i in range(0, len(steps), window)]
    out = {"default ladder (86 graphs), no adaptation": per_real_token([evaluate(cg.CapturePlan.build(ENGINE), w) for w in windows])}
    settings = {
        "8 graphs, refit every 500 steps from step 500": Adaptation(max_graphs=8, settings=ENGINE, every_steps=500, min_steps=500),
        "86 graphs, refit every 500 steps from step 500": Adaptation(max_graphs=86, settings=ENGINE, every_steps=500, min_steps=500),
        "8 graphs, refit every 500 steps from step 5000": Adaptation(max_graphs=8, settings=ENGINE, every_steps=500, min_steps=5000),
    }
    for name, adaptation in settings.items():  # each starts from the default ladder, as a registry captures it
        out[name] = replay(steps, adaptation, default, window=window).padding_per_real_token()
    out["8 graphs fitted to each window itself (hindsight)"] = per_real_token(
        [evaluate(cg.CapturePlan.fit(w, 8, ENGINE), w) for w in windows]
    )
    return out


def plot(data: dict[str, list[float]], window: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    styles = {"default": dict(color="0.6", linewidth=3), "hindsight": dict(color="tab:purple", linestyle=":")}
    for name, values in data.items():
        style = next((v for k, v in styles.items() if k in name), {})
        edges = [i * window for i in range(len(values) + 1)]
        ax.stairs([100 * v for v in values], edges, label=name, baseline=None, **style)
    ax.set_yscale("symlog", linthresh=10)
    ax.set_xlim(0, len(next(iter(data.values()))) * window)
    ax.set_xlabel(f"scheduler step of the bundled trace (windows of {window} steps)")
    ax.set_ylabel("padded tokens, % of real tokens")
    ax.set_title("Adaptation during the warm-up (256 sequences, 8192-token budget)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000, help="trace steps replayed (default: 10000)")
    parser.add_argument("--window", type=int, default=500, help="steps per window (default: 500)")
    parser.add_argument("--plot", default=None, metavar="PNG", help="also draw the curves to PNG (needs matplotlib)")
    args = parser.parse_args()
    for name, value in (("--steps", args.steps), ("--window", args.window)):
        if value < 1:
            parser.error(f"argument {name}: expected an integer >= 1, got {value}")
    data = curves(trace_steps(args.steps), args.window)
    print("padded tokens per 100 real tokens, by window of", args.window, "steps")
    for i, name in enumerate(data):
        print(f"  [{i}] {name}")
    print("  step  " + "".join(f"{f'[{i}]':>7}" for i in range(len(data))))
    for w, row in enumerate(zip(*data.values())):
        print(f"{(w + 1) * args.window:6}  " + "".join(f"{100 * v:7.0f}" for v in row))
    if args.plot:
        plot(data, args.window, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()

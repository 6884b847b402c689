"""The ``cgregistry`` command: ``demo`` (the main job), ``plan`` (keys, gaps, trace fit) and ``plugins``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import attrs

from cgregistry.plan import MODES, CapturePlan
from cgregistry.text import text_table

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from cgregistry.demo import run_demo

    log = (lambda line: None) if args.json else print
    result = run_demo(backend=args.backend, steps=args.steps, mode=args.mode, seed=args.seed, log=log, all_entries=args.all)
    if args.json:
        data = attrs.asdict(result)
        data["speedup"] = result.speedup
        print(json.dumps(data, indent=2))
    if result.mismatches:
        print(f"error: {result.mismatches} of {result.steps} steps differ from eager", file=sys.stderr)
        return 1
    return 0


def _plan(args: argparse.Namespace) -> int:
    settings = {
        "max_num_seqs": args.max_num_seqs, "max_num_tokens": args.max_num_tokens, "mode": args.mode,
        "max_capture_size": args.max_capture_size, "spec_depths": args.spec_depths,
        "lora_counts": args.lora_counts, "max_loras": args.max_loras,
    }
    plan = CapturePlan.build(capture_sizes=args.capture_sizes, **settings)
    if args.trace is not None:
        return _plan_on_trace(args, plan, settings)
    gaps = plan.uncovered()
    if args.json:
        print(json.dumps({
            "entries": [{"key": attrs.asdict(e.descriptor), "strategy": e.strategy} for e in plan],
            "uncovered": [attrs.asdict(g) for g in gaps],
        }, indent=2))
        return 0
    for e in plan:
        print(f"{e.strategy:10} {e.descriptor}")
    print(f"{len(plan)} graphs")
    for g in gaps:
        depth = "" if g.spec_depth is None else f" spec depth {g.spec_depth}"
        print(f"uncovered (runs eagerly): {g.kind}{depth} batches of {g.min_tokens}..{g.max_tokens} tokens, {g.num_active_loras} LoRA")
    return 0


def _plan_on_trace(args: argparse.Namespace, plan: CapturePlan, settings: dict) -> int:
    from cgregistry.fitting import evaluate
    from cgregistry.workload import SchedulerConfig, read_trace, schedule

    requests = read_trace(None if args.trace == "bundled" else args.trace, limit=args.limit)
    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_tokens, spec_depth=args.spec_depth,
        step_base_s=args.step_base_ms / 1e3, step_per_token_s=args.step_per_token_us / 1e6,
    )
    plans = {"default": plan}
    if args.fit is not None:
        # Fit on the first half of the requests, judge both plans on the second half.
        half = len(requests) // 2
        fit_on, judge_on = list(schedule(requests[:half], config)), list(schedule(requests[half:], config))
        budget = args.fit or len(plan)
        plans[f"fitted ({budget})"] = CapturePlan.fit(fit_on, budget, **settings)
        scope = f"plans judged on the second half of the trace ({len(requests) - half} requests, {len(judge_on)} steps); fitted on the first half"
    else:
        judge_on = list(schedule(requests, config))
        scope = f"{len(requests)} requests, {len(judge_on)} steps"
    reports = {name: evaluate(p, judge_on) for name, p in plans.items()}
    if args.plot:
        _plot(reports, args.plot)
    if args.json:
        print(json.dumps({"scope": scope, "plans": {
            name: {**{k: v for k, v in attrs.asdict(r).items() if k != "by_tokens"},
                   "hit_rate": r.hit_rate, "padding_ratio": r.padding_ratio,
                   "by_tokens": {str(t): list(v) for t, v in r.by_tokens.items()}}
            for name, r in reports.items()}}, indent=2))
        return 0
    print(scope)
    names = list(reports)
    rows = [("", *names)]
    rows.append(("graphs", *(str(r.graphs) for r in reports.values())))
    rows.append(("largest key (tokens)", *(str(r.largest_key_tokens) for r in reports.values())))
    rows.append(("steps served by graphs", *(f"{r.graph_steps} ({r.hit_rate:.1%})" for r in reports.values())))
    rows.append(("eager fallbacks", *(str(r.eager_steps) for r in reports.values())))
    rows.append(("padded tokens", *(str(r.padded_tokens) for r in reports.values())))
    rows.append(("padding (of graph tokens)", *(f"{r.padding_ratio:.2%}" for r in reports.values())))
    for line in text_table(rows):
        print(line)
    if args.fit is not None and args.show_sizes:
        for e in plans[names[-1]]:
            print(f"{e.strategy:10} {e.descriptor}")
    return 0


def _plot(reports: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'cgregistry[plot]'") from None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, report in reports.items():
        tokens = list(report.by_tokens)
        ax.step(tokens, [report.by_tokens[t][1] for t in tokens], where="mid", label=f"{name}: {report.padding_ratio:.2%} padding")
    ax.set_xlabel("actual tokens per step")
    ax.set_ylabel("padded tokens (sum over steps)")
    ax.set_yscale("symlog")
    ax.set_title("Padding waste by token count")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plugins(args: argparse.Namespace) -> int:
    from cgregistry.plugins import Plugins

    plugins = Plugins()
    infos = plugins.describe()
    provides: dict[str, list[str]] = {}
    for kind, origin in (("strategy", plugins.strategy_origin), ("backend", plugins.backend_origin)):
        for item, plugin_name in origin.items():
            provides.setdefault(plugin_name, []).append(f"{kind} {item}")
    if args.json:
        print(json.dumps([{**attrs.asdict(i), "provides": provides.get(i.name, [])} for i in infos], indent=2))
        return 0
    rows = [("plugin", "distribution", "version", "provides", "hooks")]
    for i in infos:
        dist = (i.distribution or "-") + (" (built-in)" if i.builtin else "")
        rows.append((i.name, dist, i.version or "-", ", ".join(provides.get(i.name, [])) or "-", ", ".join(i.hooks)))
    for line in text_table(rows):
        print(line)
    return 0


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cgregistry", description="CUDA graphs for batched inference engines.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="capture the demo model, replay trace-derived batches, check against eager")
    demo.add_argument("--backend", default="auto", help="auto (cuda when available, else cpu), cuda or cpu")
    demo.add_argument("--steps", type=int, default=200, help="scheduler steps taken from the bundled trace")
    demo.add_argument("--mode", default="full", choices=sorted(MODES), help="capture mode of the plan")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--all", action="store_true", help="list every entry, not only those that served the run")
    demo.add_argument("--json", action="store_true", help="print the result as JSON")
    demo.set_defaults(func=_demo)

    plan = sub.add_parser(
        "plan",
        help="list a plan's keys and uncovered batches, or judge it (and a fitted one) on a request trace",
    )
    plan.add_argument("--max-num-seqs", type=int, default=256)
    plan.add_argument("--max-num-tokens", type=int, default=8192, help="also the scheduler's token budget")
    plan.add_argument("--mode", default="full_and_piecewise", choices=sorted(MODES))
    plan.add_argument("--capture-sizes", type=_ints, default=None)
    plan.add_argument("--max-capture-size", type=int, default=None)
    plan.add_argument("--spec-depths", type=_ints, default=[0])
    plan.add_argument("--lora-counts", type=_ints, default=None)
    plan.add_argument("--max-loras", type=int, default=None)
    plan.add_argument("--trace", default=None, metavar="FILE", help="Azure-format request trace, or 'bundled'")
    plan.add_argument("--limit", type=int, default=None, help="read only the first N requests of the trace")
    plan.add_argument("--spec-depth", type=int, default=0, help="scheduler: speculative tokens per decode request")
    plan.add_argument("--step-base-ms", type=float, default=10.0, help="scheduler: fixed time of one step")
    plan.add_argument("--step-per-token-us", type=float, default=20.0, help="scheduler: time per scheduled token")
    plan.add_argument("--fit", type=int, nargs="?", const=0, default=None, metavar="N",
                      help="also fit a plan of at most N graphs (default: as many as the default plan) "
                           "on the first half of the trace; both are judged on the second half")
    plan.add_argument("--show-sizes", action="store_true", help="with --fit: list the fitted plan's keys")
    plan.add_argument("--plot", default=None, metavar="PNG", help="write padding waste by token count (needs matplotlib)")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=_plan)

    plugins = sub.add_parser("plugins", help="list installed plugins: distribution, version, what they provide, hooks")
    plugins.add_argument("--json", action="store_true")
    plugins.set_defaults(func=_plugins)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, TypeError, KeyError, RuntimeError, OSError) as exc:
        print(f"cgregistry {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

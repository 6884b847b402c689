"""The ``cgregistry`` command: ``demo``, ``plan``, ``inspect``, ``check`` and ``plugins``; ``--json`` on each.

Exit codes: 0 success, 1 the job found a problem (demo mismatches, unsafe ops), 2 bad input (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import attrs

from cgregistry.descriptor import BatchDescriptor
from cgregistry.plan import MODES, CapturePlan
from cgregistry.text import text_table

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from cgregistry.demo import run_demo

    log = (lambda line: None) if args.json else print
    result = run_demo(backend=args.backend, steps=args.steps, mode=args.mode, seed=args.seed, log=log, all_entries=args.all, snapshot=args.snapshot)
    if args.json:
        data = attrs.asdict(result)
        data["speedup"] = result.speedup
        data["no_speedup_reason"] = result.no_speedup_reason
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


def _inspect(args: argparse.Namespace) -> int:
    from cgregistry.inspection import load_snapshot

    snap = load_snapshot(args.snapshot)
    uniform = {"uniform": True, "mixed": False, None: None}[args.kind]
    filters = {
        "strategy": args.strategy, "uniform": uniform, "spec_depth": args.spec_depth,
        "num_active_loras": args.loras, "used": True if args.used else None, "sort": args.sort,
    }
    entries = snap.filtered(**filters)
    explanation = snap.explain(_descriptor(args.explain)) if args.explain else None
    if args.json:
        data = {"name": snap.name, "backend": snap.backend, "created": snap.created,
                "entries": [e for e in snap.to_dict()["entries"] if _picked(e, entries)],
                "stats": snap.to_dict()["stats"], "pending": len(snap.pending)}
        if explanation is not None:
            data["explain"] = explanation.to_dict()
        print(json.dumps(data, indent=2))
        return 0
    print(f"snapshot of {snap.name!r} ({snap.backend}, {snap.device}) taken {snap.created}")
    print(snap.table(**filters))
    s = snap.stats
    if s.by_class:
        rows = [("key class", "entries", "replays", "graph tokens", "padded tokens")]
        rows += [(label, str(c.entries), str(c.replays), str(c.graph_tokens), str(c.padded_tokens)) for label, c in s.by_class.items()]
        print()
        for line in text_table(rows):
            print(line)
    print(f"misses: {dict(s.misses_by_kind)}; pending lazy keys: {len(snap.pending)}; failed entries: {len(snap.failures)}")
    if explanation is not None:
        print()
        print(explanation)
    return 0


def _picked(entry: dict, chosen: list) -> bool:
    return any(attrs.asdict(e.key) == entry["key"] and e.strategy == entry["strategy"] for e in chosen)


def _descriptor(text: str) -> BatchDescriptor:
    """'tokens,reqs[,loras[,depth[,uniform]]]' -> BatchDescriptor (reqs may be 'any')."""
    parts = [p.strip() for p in text.split(",")]
    if not 1 <= len(parts) <= 5:
        raise ValueError(f"--explain takes tokens,reqs[,loras[,depth[,uniform]]], got {text!r}")
    try:
        tokens = int(parts[0])
        reqs = None if len(parts) < 2 or parts[1] in ("", "any") else int(parts[1])
        loras = int(parts[2]) if len(parts) > 2 else 0
        depth = int(parts[3]) if len(parts) > 3 else 0
    except ValueError:
        raise ValueError(f"--explain takes integers: tokens,reqs[,loras[,depth[,uniform]]], got {text!r}") from None
    uniform = len(parts) > 4 and parts[4].lower() in ("1", "true", "uniform", "yes")
    return BatchDescriptor(tokens, reqs, loras, depth, uniform)


def _check(args: argparse.Namespace) -> int:
    import importlib
    import inspect
    import os

    from cgregistry.backends.cpu import find_graph_unsafe_ops

    module_name, _, func_name = args.target.partition(":")
    if not module_name or not func_name:
        raise ValueError(f"expected MODULE:FUNCTION, got {args.target!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r}: {exc}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"module {module_name!r} has no function {func_name!r}")
    required = [p.name for p in inspect.signature(func).parameters.values() if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise ValueError(
            f"{args.target} needs arguments {required}; check calls it with none: give it a function that "
            "builds a batch and its inputs and calls your step once"
        )
    found = find_graph_unsafe_ops(func)
    if args.json:
        print(json.dumps([{"op": f.op, "why": f.why, "where": f.where} for f in found], indent=2))
    elif found:
        for f in found:
            print(f"{f.where}\n    {f.op}: {f.why}")
        print(f"{len(found)} graph-unsafe op(s): a CUDA graph capture of this step would fail")
    else:
        print(f"{args.target}: no graph-unsafe ops found (host syncs, data-dependent shapes, host copies)")
    return 1 if found else 0


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


_MODE_HELP = f"one of {', '.join(MODES)}, or DECODE,MIXED naming any registered strategies ('none' for neither)"


def _mode(text: str) -> str | tuple[str | None, str | None]:
    """A mode name, or 'decode,mixed' strategy names ('none': no keys of that kind)."""
    if "," not in text:
        if text not in MODES:
            raise argparse.ArgumentTypeError(f"unknown mode {text!r}; {_MODE_HELP}")
        return text
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"--mode {text!r}: expected DECODE,MIXED (two strategy names or 'none')")
    decode, mixed = (None if p == "none" else p for p in parts)
    return (decode, mixed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cgregistry", description="CUDA graphs for batched inference engines.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="capture the demo model, replay trace-derived batches, check against eager")
    demo.add_argument("--backend", default="auto", help="auto (cuda when available, else cpu), cuda or cpu")
    demo.add_argument("--steps", type=int, default=200, help="scheduler steps taken from the bundled trace")
    demo.add_argument("--mode", default="full", type=_mode, metavar="MODE", help=_MODE_HELP)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--all", action="store_true", help="list every entry, not only those that served the run")
    demo.add_argument("--json", action="store_true", help="print the result as JSON")
    demo.add_argument("--snapshot", default=None, metavar="PATH", help="write the registry's snapshot (JSON) for `cgregistry inspect`")
    demo.set_defaults(func=_demo)

    plan = sub.add_parser(
        "plan",
        help="list a plan's keys and uncovered batches, or judge it (and a fitted one) on a request trace",
    )
    plan.add_argument("--max-num-seqs", type=int, default=256)
    plan.add_argument("--max-num-tokens", type=int, default=8192, help="also the scheduler's token budget")
    plan.add_argument("--mode", default="full_and_piecewise", type=_mode, metavar="MODE", help=_MODE_HELP)
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

    inspect = sub.add_parser("inspect", help="tables of a registry snapshot (reg.snapshot() saved as JSON), filtered and sorted")
    inspect.add_argument("snapshot", metavar="SNAPSHOT.json")
    inspect.add_argument("--strategy", default=None)
    inspect.add_argument("--kind", choices=["uniform", "mixed"], default=None, help="uniform decode keys or mixed-batch keys")
    inspect.add_argument("--spec-depth", type=int, default=None)
    inspect.add_argument("--loras", type=int, default=None, help="active-LoRA count of the keys")
    inspect.add_argument("--used", action="store_true", help="only entries replayed at least once")
    inspect.add_argument("--sort", default="key", choices=["key", "replays", "padding", "memory", "capture", "recent"])
    inspect.add_argument("--explain", default=None, metavar="T,R[,L,D,U]", help="explain how a batch (tokens,reqs,loras,depth,uniform) would match")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(func=_inspect)

    check = sub.add_parser("check", help="run MODULE:FUNCTION under the cpu emulator and list every graph-unsafe op")
    check.add_argument("target", metavar="MODULE:FUNCTION", help="a function taking no arguments that runs your step once")
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=_check)

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

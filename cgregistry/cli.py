"""The ``cgregistry`` command: ``demo`` (the main job) and ``plan`` (what a plan captures and leaves out)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import attrs

from cgregistry.plan import MODES, CapturePlan

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
    plan = CapturePlan.build(
        max_num_seqs=args.max_num_seqs, max_num_tokens=args.max_num_tokens, mode=args.mode,
        capture_sizes=args.capture_sizes, max_capture_size=args.max_capture_size,
        spec_depths=args.spec_depths, lora_counts=args.lora_counts,
    )
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

    plan = sub.add_parser("plan", help="list the keys a plan captures and the batches it leaves uncovered")
    plan.add_argument("--max-num-seqs", type=int, default=256)
    plan.add_argument("--max-num-tokens", type=int, default=8192)
    plan.add_argument("--mode", default="full_and_piecewise", choices=sorted(MODES))
    plan.add_argument("--capture-sizes", type=_ints, default=None)
    plan.add_argument("--max-capture-size", type=int, default=None)
    plan.add_argument("--spec-depths", type=_ints, default=[0])
    plan.add_argument("--lora-counts", type=_ints, default=[0])
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        print(f"cgregistry {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

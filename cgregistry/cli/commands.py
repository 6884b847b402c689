"""The ``cgregistry`` command: ``demo``, ``plan``, ``inspect``, ``check`` and ``plugins``; ``--json`` on each.

Exit codes: 0 success, 1 the job found a problem (demo mismatches, unsafe ops), 2 bad input (message on stderr), 141
the output pipe closed early (``| head``), silently, as a Unix tool killed by SIGPIPE.  Every option's help shows its
default; an option that does nothing without another is refused; errors name the user's flags, never setting names.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.plan.build import MODES, CapturePlan, PlanSettings, mode_preference
from cgregistry.messages import text_table
from cgregistry.plan.workload import SchedulerConfig

__all__ = ["HelpFormatter", "build_parser", "main", "parse_descriptor", "parsers"]

# ---------------------------------------------------------------------------- help and flag names

_SCHEDULER = SchedulerConfig()  # the scheduler's defaults, shown in the help and used when a flag is not given
_PLAN_DEFAULT_MODE = attrs.fields(PlanSettings).mode.default

# PlanSettings (and CapturePlan.fit) field -> the ``plan`` flag that sets it.  ``mode`` is translated only
# where a message names the setting ("mode ('full', 'x'): ..."), never as a word of prose.
SETTING_FLAGS = {
    "max_num_seqs": "--max-num-seqs", "max_num_tokens": "--max-num-tokens", "capture_sizes": "--capture-sizes",
    "max_capture_size": "--max-capture-size", "spec_depths": "--spec-depths", "lora_counts": "--lora-counts",
    "max_loras": "--max-loras", "max_graphs": "--fit", "separate_decode": "--separate-decode",
    "size_multiple": "--size-multiple", "unsupported": "--unsupported", "ubatch_threshold": "--ubatch-threshold",
}

# ``plan`` options that act only on a trace (dest names); --show-sizes also needs --fit.
_TRACE_ONLY = ("limit", "spec_depth", "step_base_ms", "step_per_token_us", "fit", "plot", "show_sizes")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help states its default itself, or the default is None
    or a bare on/off flag's: those say in words what happens without them, never "None" or "False"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unstated = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default:" in text or unstated or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _flag(dest: str) -> str:
    """The long option of a dest name: ``step_base_ms`` -> ``--step-base-ms``."""
    return "--" + dest.replace("_", "-")


def _mode_text(mode: str | tuple[str | None, str | None]) -> str:
    """A mode as the user writes it: a name, or ``DECODE,MIXED`` with 'none' for no strategy."""
    if isinstance(mode, str):
        return mode
    return ",".join("none" if m is None else m for m in mode)


def _csv(values: Sequence[int]) -> str:
    """Integers as the user writes them on the command line: ``1,2,4``."""
    return ",".join(str(v) for v in values)


def _mode_flagged(message: str, args: argparse.Namespace) -> str:
    """``mode ('full', 'x'): ...`` (PlanSettings' wording) as ``--mode=full,x: ...``."""
    return re.sub(r"^mode \(.*?\): ", lambda m: f"--mode={_mode_text(args.mode)}: ", message)


def _demo_flagged(message: str, args: argparse.Namespace) -> str:
    """A demo error in the demo's flags: ``--mode=...``, ``--backend=...`` and ``--preference=...`` for the library's wording."""
    message = re.sub(r"^backend '([^']*)' (is )?", lambda m: f"--backend={m[1]}: ", message)
    message = re.sub(r"^preference \(.*?\): ", lambda m: f"--preference={','.join(args.preference or ())}: ", message)
    return _mode_flagged(message, args)


def _flagged(message: str, args: argparse.Namespace) -> str:
    """``message`` from CapturePlan.build / PlanSettings / CapturePlan.fit with setting names turned into ``plan`` flags
    (known messages with the value the user gave)."""
    sizes = "--capture-sizes" if args.capture_sizes is None else f"--capture-sizes={_csv(args.capture_sizes)}"

    def too_large(m: re.Match[str]) -> str:
        return f"--max-capture-size={m[1]} exceeds --max-num-tokens={m[2]}"

    def sizes_too_large(m: re.Match[str]) -> str:
        return f"{sizes}: the largest, {max(int(v) for v in m[1].split(', '))}, exceeds --max-num-tokens={m[2]}"

    rules: list[tuple[str, Callable[[re.Match[str]], str]]] = [
        (r"\bmax_capture_size=(\d+) exceeds max_num_tokens=(\d+)", too_large),
        (r"\bcapture_sizes \[([\d, ]+)\] exceed max_num_tokens=(\d+)", sizes_too_large),
        (r"\bcapture_sizes \[([^\]]*)\] exceed", lambda m: f"{sizes}: {m[1]} exceed"),
        (r"\blora_counts \[([^\]]*)\]", lambda m: f"--lora-counts={m[1].replace(' ', '')}"),
        (r"\bspec depth (\d+) needs", lambda m: f"depth {m[1]} of --spec-depths needs"),
        (r"\b(" + "|".join(SETTING_FLAGS) + r")\b", lambda m: SETTING_FLAGS[m[1]]),
    ]
    for pattern, replace in rules:
        message = re.sub(pattern, replace, message)
    return _mode_flagged(message, args)


# How each command's error messages are put in its own flags' terms.
_TRANSLATE: dict[str, Callable[[str, argparse.Namespace], str]] = {"plan": _flagged, "demo": _demo_flagged}


# ---------------------------------------------------------------------------- demo


def _demo(args: argparse.Namespace) -> int:
    """``demo``: run it, log or print JSON; 1 when a step differs from eager."""
    from cgregistry.cli.demo import run_demo

    log = (lambda line: None) if args.json else print
    result = run_demo(backend=args.backend, steps=args.steps, mode=args.mode, seed=args.seed, log=log, all_entries=args.all,
                      snapshot=args.snapshot, preference=args.preference, gpu_memory_utilization=args.gpu_memory_utilization)
    if args.json:
        data = {**attrs.asdict(result), "speedup": result.speedup, "no_speedup_reason": result.no_speedup_reason}
        print(json.dumps(data, indent=2))
    if result.mismatches:
        print(f"error: {result.mismatches} of {result.steps} steps differ from eager", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------- plan


def _plan_usage_error(args: argparse.Namespace) -> str | None:
    """Options given that do nothing without another (None when every option given has an effect)."""
    if args.trace is None:
        given = [_flag(d) for d in _TRACE_ONLY if getattr(args, d) is not None and getattr(args, d) is not False]
        if given:
            needs = " and --fit" if args.show_sizes and args.fit is None else ""
            return (f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --trace FILE{needs}: "
                    "without --trace, plan lists the plan's keys and judges nothing")
    elif args.show_sizes and args.fit is None:
        return "--show-sizes needs --fit: it lists the fitted plan's keys"
    return None


def _plan_settings(args: argparse.Namespace) -> PlanSettings:
    """The plan's settings from the flags; a flag not given leaves the setting at PlanSettings' default."""
    given = {
        "mode": args.mode, "capture_sizes": args.capture_sizes, "max_capture_size": args.max_capture_size,
        "spec_depths": args.spec_depths, "lora_counts": args.lora_counts, "max_loras": args.max_loras,
        "separate_decode": args.separate_decode or None, "size_multiple": args.size_multiple,
        "unsupported": args.unsupported, "ubatch_threshold": args.ubatch_threshold,
    }
    fields = {k: v for k, v in given.items() if v is not None}
    return PlanSettings(max_num_seqs=args.max_num_seqs, max_num_tokens=args.max_num_tokens, **fields)


def _settings_dict(s: PlanSettings) -> dict[str, Any]:
    """The resolved settings, by PlanSettings field name (what ``plan --json`` prints as "settings")."""
    return {
        "max_num_seqs": s.max_num_seqs, "max_num_tokens": s.max_num_tokens,
        "mode": s.mode if isinstance(s.mode, str) else list(s.mode),
        "decode_strategy": s.decode_strategy, "mixed_strategy": s.mixed_strategy, "mixed_relaxed": s.mixed_relaxed,
        "capture_sizes": list(s.used_capture_sizes), "max_capture_size": s.used_max_capture_size,
        "spec_depths": list(s.widest), "widest_decode": {str(d): n for d, n in s.widest.items()},
        "lora_counts": list(s.used_lora_counts), "max_loras": s.max_loras,
        "separate_decode": s.separate_decode, "size_multiple": s.size_multiple, "ubatch_threshold": s.ubatch_threshold,
        "uniform_keys": _uniform_keys(s),
        "decode_reqs": {str(d): list(r) for d, r in s.decode_reqs.items()}, "mixed_sizes": list(s.mixed_sizes),
        "unsupported": {name: sorted(classes) for name, classes in s.unsupported.items()},
        "strategy_unsupported": {name: sorted(classes) for name, classes in s.strategy_unsupported.items()},
        "downgrades": [{**attrs.asdict(d), "reason": str(d)} for d in s.downgrades],
    }


def _uniform_keys(s: PlanSettings) -> str:
    """How uniform decode batches get their graphs under these settings, in words."""
    if s.decode_strategy is None:
        if s.mixed_strategy is None:
            return "none: no graphs"
        return f"none: mixed {s.mixed_strategy} keys serve uniform batches (with the uniform widths among their sizes)"
    if s.folded:
        return (f"shared: one {s.decode_strategy} graph per token count; uniform widths up to --max-capture-size are mixed "
                "keys (give --separate-decode when the step branches on uniformity)")
    if s.decode_strategy == s.mixed_strategy:
        return f"separate: {s.decode_strategy} uniform keys beside mixed keys of the same widths (--separate-decode)"
    return f"separate: {s.decode_strategy} uniform keys, {s.mixed_strategy or 'no'} mixed keys"


def _settings_lines(s: PlanSettings, args: argparse.Namespace) -> list[str]:
    """The settings header of the text output: each flag, its resolved value, and whether it was derived."""

    def origin(dest: str) -> str:
        return "" if getattr(args, dest) is not None else "  (default)"

    mixed = s.mixed_strategy
    if mixed is not None:
        mixed += " (any request count)" if s.mixed_relaxed else " (request count min(tokens, max-num-seqs))"
    rows = [
        ("--max-num-seqs", str(s.max_num_seqs), ""),
        ("--max-num-tokens", str(s.max_num_tokens), ""),
        ("--mode", f"{_mode_text(s.mode)}: decode keys {s.decode_strategy or 'none'}, mixed keys {mixed or 'none'}", origin("mode")),
        ("--capture-sizes", f"{_csv(s.used_capture_sizes)} ({len(s.used_capture_sizes)} sizes)", origin("capture_sizes")),
        ("--max-capture-size", str(s.used_max_capture_size), origin("max_capture_size")),
        ("--spec-depths", _csv(s.widest), origin("spec_depths")),
        ("--lora-counts", _csv(s.used_lora_counts), origin("lora_counts")),
        ("--max-loras", "none (no LoRA)" if s.max_loras is None else str(s.max_loras), origin("max_loras")),
        ("--separate-decode", "yes" if s.separate_decode else "no", "" if args.separate_decode else "  (default)"),
        ("--size-multiple", str(s.size_multiple), origin("size_multiple")),
        ("--ubatch-threshold", "none (no micro-batches)" if s.ubatch_threshold is None else str(s.ubatch_threshold),
         origin("ubatch_threshold")),
        ("--unsupported", ", ".join(f"{n}:{c}" for n, cs in s.unsupported.items() for c in sorted(cs)) or "none", origin("unsupported")),
        ("uniform keys", _uniform_keys(s), ""),
    ]
    if s.strategy_unsupported:  # what the mode's strategies declare themselves (their unsupported_classes)
        own = ", ".join(f"{n}:{c}" for n, cs in s.strategy_unsupported.items() for c in sorted(cs))
        rows.insert(-1, ("strategy-declared", f"{own} (the strategies' own unsupported_classes)", ""))
    capped = _cap_text(args)
    rows.insert(-1, ("padding cap", capped or "none (--max-padding-tokens, --max-padding-ratio)", "" if capped else "  (default)"))
    rows += [("downgraded", str(d), "") for d in s.downgrades]
    widths = sorted(set(s.mixed_sizes) - set(s.used_capture_sizes))
    if widths and s.mixed_strategy is not None:
        rows.append(("mixed widths", f"+{len(widths)} beside --capture-sizes (uniform widths, sizes rounded up to whole requests): "
                                     f"{_csv(widths)}", ""))
    return ["settings:", *(f"  {flag:18} {value}{note}" for flag, value, note in rows)]


def _class_counts(plan: CapturePlan) -> dict[str, int]:
    """Graphs per key class (strategy, uniform spec depth or mixed, LoRA count), largest class first."""
    from cgregistry.inspection import key_class

    counts = Counter(key_class(e.descriptor, e.strategy) for e in plan)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _plan(args: argparse.Namespace) -> int:
    """``plan``: the settings used, then the keys and uncovered batches (or, with --trace, the reports)."""
    settings = _plan_settings(args)
    plan = CapturePlan.build(settings)
    if args.trace is not None:
        return _plan_on_trace(args, plan, settings)
    gaps = plan.uncovered(**_cap(args))
    if args.json:
        print(json.dumps({
            "settings": _settings_dict(settings),
            "padding_cap": _cap(args),
            "entries": _entries_json(plan),
            "graphs_by_class": _class_counts(plan),
            "uncovered": [attrs.asdict(g) for g in gaps],
        }, indent=2))
        return 0
    print("\n".join(_settings_lines(settings, args)))
    print()
    _print_keys(plan)
    counts = _class_counts(plan)
    print(f"{len(plan)} graphs: " + (", ".join(f"{n} {name}" for name, n in counts.items()) or "every batch runs eagerly"))
    for g in gaps:
        depth = "" if g.spec_depth is None else f" spec depth {g.spec_depth}"
        why = f", over the padding cap: every covering key pads more ({_cap_text(args)})" if g.reason == "padding_cap" else ""
        print(f"uncovered (runs eagerly): {g.key_class}{depth} batches of {g.min_tokens}..{g.max_tokens} tokens, {g.num_active_loras} LoRA{why}")
    return 0


def _entries_json(plan: CapturePlan) -> list[dict[str, Any]]:
    return [{"key": attrs.asdict(e.descriptor), "strategy": e.strategy} for e in plan]


def _print_keys(plan: CapturePlan) -> None:
    for e in plan:
        print(f"{e.strategy:10} {e.descriptor}")


def _cap(args: argparse.Namespace) -> dict[str, Any]:
    """The padding cap flags as ``uncovered`` and ``evaluate`` take them (None: no such cap)."""
    return {"max_padding_tokens": args.max_padding_tokens, "max_padding_ratio": args.max_padding_ratio}


def _cap_text(args: argparse.Namespace) -> str:
    """The padding cap flags given, as the user wrote them (empty: no cap)."""
    return ", ".join(f"{_flag(dest)}={value:g}" for dest, value in _cap(args).items() if value is not None)


def _scheduler(args: argparse.Namespace) -> SchedulerConfig:
    """The trace's scheduler: --max-num-seqs and --max-num-tokens, and the scheduler flags or their defaults."""
    base_ms = _SCHEDULER.step_base_s * 1e3 if args.step_base_ms is None else args.step_base_ms
    per_token_us = _SCHEDULER.step_per_token_s * 1e6 if args.step_per_token_us is None else args.step_per_token_us
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_tokens,
        spec_depth=_SCHEDULER.spec_depth if args.spec_depth is None else args.spec_depth,
        step_base_s=base_ms / 1e3, step_per_token_s=per_token_us / 1e6,
    )


def _scheduler_dict(config: SchedulerConfig, args: argparse.Namespace, requests: int) -> dict[str, Any]:
    """The scheduler the trace was replayed with (what ``plan --trace --json`` prints as "scheduler")."""
    return {
        "trace": args.trace, "requests": requests, "limit": args.limit,
        "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
        "spec_depth": config.spec_depth, "step_base_ms": config.step_base_s * 1e3, "step_per_token_us": config.step_per_token_s * 1e6,
    }


def _plan_on_trace(args: argparse.Namespace, plan: CapturePlan, settings: PlanSettings) -> int:
    """``plan --trace``: judge the plan (and with --fit a fitted one) on the trace's scheduled steps."""
    from cgregistry.plan.fit import evaluate
    from cgregistry.plan.workload import read_trace, schedule

    if args.plot:
        _pyplot()  # before the work: a missing matplotlib is reported at once
    requests = read_trace(None if args.trace == "bundled" else args.trace, limit=args.limit)
    config = _scheduler(args)
    plans = {"default": plan}
    if args.fit is not None:
        # Fit on the first half of the requests, judge both plans on the second half.
        half = len(requests) // 2
        fit_on, judge_on = list(schedule(requests[:half], config)), list(schedule(requests[half:], config))
        budget = args.fit or len(plan)
        plans[f"fitted ({budget})"] = CapturePlan.fit(fit_on, budget, settings)
        scope = f"plans judged on the second half of the trace ({len(requests) - half} requests, {len(judge_on)} steps); fitted on the first half"
    else:
        judge_on = list(schedule(requests, config))
        scope = f"{len(requests)} requests, {len(judge_on)} steps"
    # Served as a registry with the mode's preference serves them: its decode strategy first (what the fit assumes).
    reports = {name: evaluate(p, judge_on, mode_preference(settings.mode), **_cap(args)) for name, p in plans.items()}
    if args.plot:
        _plot(reports, args.plot)
    if args.json:
        _print_trace_json(args, settings, config, len(requests), scope, plans, reports)
        return 0
    print("\n".join(_settings_lines(settings, args)))
    print(f"scheduler: step {config.step_base_s * 1e3:g} ms + {config.step_per_token_s * 1e6:g} us per token, "
          f"spec depth {config.spec_depth}")
    print()
    print(scope)
    _print_reports(reports)
    if args.show_sizes:
        fitted = list(plans)[-1]
        print(f"\n{fitted} keys:")
        _print_keys(plans[fitted])
    if args.plot:
        print(f"wrote padding plot to {args.plot}")
    return 0


def _print_trace_json(
    args: argparse.Namespace, settings: PlanSettings, config: SchedulerConfig, requests: int, scope: str,
    plans: dict[str, CapturePlan], reports: dict[str, Any],
) -> None:
    """The ``plan --trace --json`` document: settings, scheduler, scope, one report per plan (and the plot's path)."""
    out: dict[str, Any] = {
        "settings": _settings_dict(settings), "padding_cap": _cap(args), "scheduler": _scheduler_dict(config, args, requests), "scope": scope,
        "plans": {},
    }
    for name, r in reports.items():
        report = {k: v for k, v in attrs.asdict(r).items() if k != "by_tokens"}
        report.update(hit_rate=r.hit_rate, padding_ratio=r.padding_ratio, by_tokens={str(t): list(v) for t, v in r.by_tokens.items()})
        if args.show_sizes:
            report["entries"] = _entries_json(plans[name])
        out["plans"][name] = report
    if args.plot:
        out["plot"] = args.plot
    print(json.dumps(out, indent=2))


# The rows of ``plan --trace``'s report table: label, and each plan's cell (a format of its report ``r``).
_REPORT_ROWS = (
    ("graphs", "{r.graphs}"), ("largest key (tokens)", "{r.largest_key_tokens}"),
    ("steps served by graphs", "{r.graph_steps} ({r.hit_rate:.1%})"), ("eager fallbacks", "{r.eager_steps}"),
    ("padded tokens", "{r.padded_tokens}"), ("padding (of graph tokens)", "{r.padding_ratio:.2%}"),
)


def _print_reports(reports: dict[str, Any]) -> None:
    """The plans' reports side by side."""
    rows = [("", *reports), *((label, *(cell.format(r=r) for r in reports.values())) for label, cell in _REPORT_ROWS)]
    print("\n".join(text_table(rows)))


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a RuntimeError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'cgregistry[plot]'") from None
    return plt


def _plot(reports: dict, path: str) -> None:
    """Padded tokens by actual token count, one line per plan, written to ``path``."""
    plt = _pyplot()
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


# ---------------------------------------------------------------------------- plugins


def _plugins(args: argparse.Namespace) -> int:
    from cgregistry.hooks.manager import Plugins

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
    print("\n".join(text_table(rows)))
    return 0


# ---------------------------------------------------------------------------- inspect


def _inspect(args: argparse.Namespace) -> int:
    from cgregistry.inspection import load_snapshot

    snap = load_snapshot(args.snapshot)
    _check_strategy(args.strategy, snap)
    uniform = {"uniform": True, "mixed": False, None: None}[args.form]
    filters = {
        "strategy": args.strategy, "uniform": uniform, "spec_depth": args.spec_depth,
        "num_active_loras": args.loras, "used": True if args.used else None, "sort": args.sort,
    }
    entries = snap.filtered(**filters)
    explanation = snap.explain(args.explain) if args.explain else None
    if args.json:
        whole, picked = snap.to_dict(), {(e.key, e.strategy) for e in entries}
        data = {"name": snap.name, "backend": snap.backend, "created": snap.created,
                "entries": [d for e, d in zip(snap.entries, whole["entries"]) if (e.key, e.strategy) in picked],
                "stats": whole["stats"], "pending": len(snap.pending)}
        if explanation is not None:
            data["explain"] = explanation.to_dict()
        print(json.dumps(data, indent=2))
        return 0
    print(f"snapshot of {snap.name!r} ({snap.backend}, {snap.device}) taken {snap.created}")
    print(snap.table(**filters))
    if not entries:
        held, given = len(snap.entries), _filter_text(args)
        print(f"no entry matches {given}; the snapshot holds {held} {'entry' if held == 1 else 'entries'}"
              if given else "the snapshot holds no entries")
    s = snap.stats
    if s.by_class:
        rows = [("key class", "entries", "replays", "graph tokens", "padded tokens")]
        rows += [(label, str(c.entries), str(c.replays), str(c.graph_tokens), str(c.padded_tokens)) for label, c in s.by_class.items()]
        print()
        print("\n".join(text_table(rows)))
    reasons = {k: v for k, v in s.misses_by_reason.items() if v}
    print(f"misses: {dict(s.misses_by_form)}, by reason {reasons or '{}'}; pending lazy keys: {len(snap.pending)}; "
          f"failed entries: {len(snap.failures)}")
    if explanation is not None:
        print()
        print(explanation)
    return 0


def _check_strategy(name: str | None, snap: Any) -> None:
    """Refuse ``--strategy`` naming a strategy the snapshot never mentions (a typo, most likely), listing those it does."""
    if name is None:
        return
    known = {e.strategy for e in snap.entries} | set(snap.preference) | {s for _, s in (*snap.pending, *snap.capturing)}
    if name not in known:
        raise ValueError(f"--strategy={name}: the snapshot has no strategy of that name; it knows {', '.join(sorted(known)) or 'none'}")


def _filter_text(args: argparse.Namespace) -> str:
    """The ``inspect`` filters given, as the user wrote them (empty: none)."""
    given = {"--strategy": args.strategy or None, "--form": args.form, "--spec-depth": args.spec_depth,
             "--loras": args.loras}
    return " ".join([f"{flag}={value}" for flag, value in given.items() if value is not None] + ["--used"] * args.used)


_EXPLAIN_FIELDS = ("tokens", "reqs", "loras", "depth", "uniform")
_EXPLAIN_FORM = "tokens,reqs[,loras[,depth[,uniform]]]"
_UNIFORM_WORDS = {"uniform": True, "true": True, "yes": True, "1": True, "mixed": False, "false": False, "no": False, "0": False}
_DESCRIPTOR_NAMES = {"BatchDescriptor.": "", "uniform BatchDescriptor": "a uniform batch", "num_tokens": "tokens",
                     "num_reqs": "reqs", "num_active_loras": "loras", "spec_depth": "depth", "uniform=True": "uniform"}


def _explain_int(text: str, field: str, position: int, whole: str) -> int:
    try:
        return int(text)
    except ValueError:
        extra = " or 'any'" if field == "reqs" else ""
        raise argparse.ArgumentTypeError(
            f"{whole!r}: {field} (field {position} of {_EXPLAIN_FORM}) must be an integer{extra}, got {text!r}"
        ) from None


def _explain_uniform(text: str, whole: str) -> bool:
    try:
        return _UNIFORM_WORDS[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"{whole!r}: uniform (field 5 of {_EXPLAIN_FORM}) must be one of {', '.join(_UNIFORM_WORDS)}; got {text!r}"
        ) from None


def parse_descriptor(text: str) -> BatchDescriptor:
    """``--explain``: 'tokens,reqs[,loras[,depth[,uniform]]]' -> BatchDescriptor (reqs may be 'any' or empty); a
    misspelled uniform word or a non-integer is an error naming the field."""
    parts = [p.strip() for p in text.split(",")]
    if not 1 <= len(parts) <= len(_EXPLAIN_FIELDS):
        raise argparse.ArgumentTypeError(f"expected {_EXPLAIN_FORM} (1 to 5 fields), got {text!r} ({len(parts)} fields)")
    tokens = _explain_int(parts[0], "tokens", 1, text)
    reqs = None if len(parts) < 2 or parts[1] in ("", "any") else _explain_int(parts[1], "reqs", 2, text)
    loras = _explain_int(parts[2], "loras", 3, text) if len(parts) > 2 else 0
    depth = _explain_int(parts[3], "depth", 4, text) if len(parts) > 3 else 0
    uniform = _explain_uniform(parts[4], text) if len(parts) > 4 else False
    try:
        return BatchDescriptor(tokens, reqs, loras, depth, uniform)
    except ValueError as exc:
        message = str(exc)
        for internal, name in _DESCRIPTOR_NAMES.items():
            message = message.replace(internal, name)
        raise argparse.ArgumentTypeError(f"{text!r}: {message}") from None


# ---------------------------------------------------------------------------- check


def _is_file(target: str) -> bool:
    """Whether the MODULE part of ``check``'s target is a path (``step.py``, ``dir/step``) rather than a module name."""
    import os

    return target.endswith(".py") or "/" in target or os.sep in target


def _load_target_module(name: str) -> Any:
    """``check``'s module: imported by name (the current directory searched first), or executed from a file path."""
    import importlib
    import importlib.util
    import os
    from pathlib import Path

    if not _is_file(name):
        sys.path.insert(0, os.getcwd())
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"cannot import module {name!r}: {exc}") from None
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"no file {name!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {name!r} as Python: expected a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))  # its own imports of sibling files work, as for `python FILE`
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[path.stem]  # as a failed import leaves nothing behind; the file's own error goes on
        raise
    return module


def _check(args: argparse.Namespace) -> int:
    import inspect

    from cgregistry.backends.cpu import find_graph_unsafe_ops

    module_name, _, func_name = args.target.rpartition(":")  # the last colon: a Windows path has one of its own
    if not module_name or not func_name:
        raise ValueError(f"expected MODULE:FUNCTION or FILE.py:FUNCTION, got {args.target!r}")
    module = _load_target_module(module_name)
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"{'file' if _is_file(module_name) else 'module'} {module_name!r} has no function {func_name!r}")
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


# ---------------------------------------------------------------------------- argument types


def _ints(text: str) -> list[int]:
    """Comma-separated integers, at least one."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r} (no integer)")
    return values


def _names(text: str) -> tuple[str, ...]:
    """Comma-separated names, at least one (``full,breakable``); whether each is registered is checked later."""
    names = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated strategy names, got {text!r}")
    return names


def _unsupported_flag(text: str) -> dict[str, list[str]]:
    """``STRATEGY:CLASS,...`` (``full:mixed,full:spec_decode``) as ``{strategy: [classes]}``; names are checked by PlanSettings."""
    out: dict[str, list[str]] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        strategy, sep, key_class = item.partition(":")
        if not sep or not strategy or not key_class:
            raise argparse.ArgumentTypeError(f"expected STRATEGY:CLASS,... (e.g. full:mixed), got {item!r} in {text!r}")
        out.setdefault(strategy, []).append(key_class)
    if not out:
        raise argparse.ArgumentTypeError(f"expected STRATEGY:CLASS,... (e.g. full:mixed), got {text!r}")
    return out


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def _non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


_MODE_HELP = f"one of {', '.join(MODES)}, or DECODE,MIXED naming any registered strategies ('none' for neither)"


def _mode(text: str) -> str | tuple[str | None, str | None]:
    """A mode name, or 'decode,mixed' strategy names ('none': no keys of that class)."""
    if "," not in text:
        if text not in MODES:
            raise argparse.ArgumentTypeError(f"unknown mode {text!r}; {_MODE_HELP}")
        return text
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected DECODE,MIXED (two strategy names or 'none')")
    decode, mixed = (None if p == "none" else p for p in parts)
    return (decode, mixed)


# ---------------------------------------------------------------------------- the parser


def _add_demo(sub: Any) -> argparse.ArgumentParser:
    demo = sub.add_parser(
        "demo", help="capture the demo model, replay trace-derived batches, check against eager",
        description="Capture the built-in demo decoder, replay batch shapes from the bundled trace through the "
                    "registry, check every output against eager, and time both.",
        formatter_class=HelpFormatter,
    )
    demo.add_argument("--backend", default="auto", help="auto (cuda when available, else cpu), cuda, cpu, or a plugin's backend")
    demo.add_argument("--steps", type=_at_least(1), default=200, help="scheduler steps taken from the bundled trace")
    demo.add_argument("--mode", default="full", type=_mode, metavar="MODE", help=(
        f"{_MODE_HELP} (default: full, because the demo model is graph-safe end to end, so a full graph per key "
        "is the fastest it can run; modes with piecewise keys compile the model first, seconds of tracing. "
        f"`plan` defaults to {_PLAN_DEFAULT_MODE}, the library's default for engines, whose attention "
        "usually cannot be in a graph)"))
    demo.add_argument("--preference", type=_names, default=None, metavar="STRATEGY,...",
                      help="the registry's strategy order, most preferred first (default: the mode's decode strategy, then "
                           "its mixed one, then full, piecewise, breakable; a plugin strategy left out ranks last, so its "
                           "decode keys would lose every decode batch to relaxed mixed keys)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the model's weights and of the batches' inputs")
    demo.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                      help="share of the device's memory the process may use: the plan is estimated first and fitted to "
                           "the trace under what is left if it would take more (cuda only; default: no limit)")
    demo.add_argument("--all", action="store_true", help="list every entry, not only those that served the run")
    demo.add_argument("--json", action="store_true", help="print the result as JSON instead of the log")
    demo.add_argument("--snapshot", default=None, metavar="PATH",
                      help="write the registry's snapshot (JSON) for `cgregistry inspect` (default: none written)")
    demo.set_defaults(func=_demo)
    return demo


def _add_plan(sub: Any) -> argparse.ArgumentParser:
    plan = sub.add_parser(
        "plan", help="list a plan's keys and uncovered batches, or judge it (and a fitted one) on a request trace",
        description="Build the capture plan of these engine settings and print the resolved settings, its keys and "
                    "the batches it leaves to eager; with --trace, judge it (and with --fit a fitted plan) on a "
                    "request trace instead.",
        formatter_class=HelpFormatter,
    )
    keys = plan.add_argument_group("plan settings (CapturePlan.build)")
    keys.add_argument("--max-num-seqs", type=int, default=256, metavar="N", help="largest number of requests in a batch")
    keys.add_argument("--max-num-tokens", type=int, default=8192, metavar="N", help="largest number of tokens in a batch; also the scheduler's token budget")
    keys.add_argument("--mode", default=None, type=_mode, metavar="MODE", help=(
        f"{_MODE_HELP} (default: {_PLAN_DEFAULT_MODE}, what CapturePlan.build uses when no mode is given: "
        "full graphs for uniform decode batches, graph segments around the eager attention for mixed ones, "
        "with no compile; full_and_piecewise for a model compiled with reg.compile)"))
    keys.add_argument("--capture-sizes", type=_ints, default=None, metavar="N,N,...",
                      help="token counts of the mixed-batch keys (default: the plan's own ladder 1, 2, 4, 8, 16, ... "
                           "every 8 to 256, then every 16, up to --max-capture-size)")
    keys.add_argument("--max-capture-size", type=int, default=None, metavar="N",
                      help="largest key, in tokens (default: the plan's own: the largest --capture-sizes value, else "
                           "min(2 x max-num-seqs x (1 + deepest spec depth), 512, max-num-tokens))")
    keys.add_argument("--spec-depths", type=_ints, default=None, metavar="D,D,...",
                      help="speculative depths of the uniform decode keys (default: the plan's own: 0, no speculation)")
    keys.add_argument("--lora-counts", type=_ints, default=None, metavar="K,K,...",
                      help="active-LoRA counts each key is captured for (default: the plan's own: 0, or with "
                           "--max-loras the ladder 0, 1, 2, 4, ... up to it)")
    keys.add_argument("--max-loras", type=int, default=None, metavar="K",
                      help="most adapters active in a batch (default: no LoRA)")
    keys.add_argument("--separate-decode", action="store_true",
                      help="the step branches on uniformity (its own decode routine), so uniform batches get their own "
                           "keys even where one strategy serves both classes (default: off: one graph per token count)")
    keys.add_argument("--size-multiple", type=int, default=None, metavar="N",
                      help="every key's token count a multiple of N, e.g. the tensor-parallel size under sequence "
                           "parallelism (default: the plan's own: 1)")
    keys.add_argument("--ubatch-threshold", type=int, default=None, metavar="N",
                      help="token count at or above which the engine splits a step into two micro-batches (dual-batch "
                           "overlap): keys of at least N tokens also get a two-micro-batch graph (default: none)")
    keys.add_argument("--unsupported", type=_unsupported_flag, default=None, metavar="STRATEGY:CLASS,...",
                      help="key classes (mixed, spec_decode, decode) a strategy cannot serve, e.g. full:mixed for an "
                           "attention backend without full graphs of mixed batches; those classes go to the mode's other "
                           "strategy, else run eagerly, and plan prints each downgrade (default: none)")
    cap = plan.add_argument_group("padding cap (GraphRegistry's max_padding_tokens and max_padding_ratio)")
    cap.add_argument("--max-padding-tokens", type=_at_least(0), default=None, metavar="N",
                     help="a batch whose every covering key pads more than N tokens runs eagerly: listed as uncovered, "
                          "and counted as eager on a --trace (default: no cap)")
    cap.add_argument("--max-padding-ratio", type=_non_negative_float, default=None, metavar="R",
                     help="the same for more than R padding tokens per real token (default: no cap)")
    trace = plan.add_argument_group("judging on a trace (each option here needs --trace)")
    trace.add_argument("--trace", default=None, metavar="FILE",
                       help="Azure-format request trace, or 'bundled' (default: none: list the plan's keys instead)")
    trace.add_argument("--limit", type=_at_least(1), default=None, metavar="N", help="read only the first N requests of the trace (default: all)")
    trace.add_argument("--spec-depth", type=_at_least(0), default=None, metavar="D",
                       help=f"scheduler: speculative tokens per decode request (default: {_SCHEDULER.spec_depth})")
    trace.add_argument("--step-base-ms", type=_non_negative_float, default=None, metavar="MS",
                       help=f"scheduler: fixed time of one step (default: {_SCHEDULER.step_base_s * 1e3:g})")
    trace.add_argument("--step-per-token-us", type=_non_negative_float, default=None, metavar="US",
                       help=f"scheduler: time per scheduled token (default: {_SCHEDULER.step_per_token_s * 1e6:g})")
    trace.add_argument("--fit", type=_at_least(1), nargs="?", const=0, default=None, metavar="N",
                       help="also fit a plan of at most N graphs on the first half of the trace; both are judged on the "
                            "second half (default: no fit; N defaults to the default plan's graph count)")
    trace.add_argument("--show-sizes", action="store_true", help="with --fit: list the fitted plan's keys (in --json: each plan's)")
    trace.add_argument("--plot", default=None, metavar="PNG",
                       help="write padding waste by token count to PNG, needs matplotlib (default: no plot)")
    plan.add_argument("--json", action="store_true", help="print JSON (settings, keys, uncovered batches or reports) instead of text")
    plan.set_defaults(func=_plan, usage_error=_plan_usage_error)
    return plan


def _add_inspect(sub: Any) -> argparse.ArgumentParser:
    inspect = sub.add_parser(
        "inspect", help="tables of a registry snapshot (reg.snapshot() saved as JSON), filtered and sorted",
        description="Print a registry snapshot's entries, filtered and sorted, with statistics by key class.",
        formatter_class=HelpFormatter,
    )
    inspect.add_argument("snapshot", metavar="SNAPSHOT.json", help="a snapshot written by reg.snapshot() or `demo --snapshot`")
    inspect.add_argument("--strategy", default=None, help="only entries of this strategy (default: every strategy)")
    inspect.add_argument("--form", "--kind", dest="form", choices=["uniform", "mixed"], default=None,
                         help="only uniform decode keys or only mixed-batch keys (default: both; --kind: the old name)")
    inspect.add_argument("--spec-depth", type=_at_least(0), default=None, metavar="D", help="only keys of this spec depth (default: any)")
    inspect.add_argument("--loras", type=_at_least(0), default=None, metavar="K", help="only keys of this active-LoRA count (default: any)")
    inspect.add_argument("--used", action="store_true", help="only entries replayed at least once")
    inspect.add_argument("--sort", default="key", choices=["key", "replays", "padding", "memory", "capture", "recent"],
                         help="order of the entries")
    inspect.add_argument("--explain", default=None, type=parse_descriptor, metavar="T,R[,L,D,U]",
                         help=f"explain how a batch would match: {_EXPLAIN_FORM}, reqs 'any' for none, uniform one of "
                              f"{', '.join(_UNIFORM_WORDS)} (default: no explanation)")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of tables")
    inspect.set_defaults(func=_inspect)
    return inspect


def _add_check(sub: Any) -> argparse.ArgumentParser:
    check = sub.add_parser(
        "check", help="run MODULE:FUNCTION (or FILE.py:FUNCTION) under the cpu emulator and list every graph-unsafe op",
        description="Run a function under the cpu emulator and list every op a CUDA graph capture would refuse.",
        formatter_class=HelpFormatter,
    )
    check.add_argument("target", metavar="MODULE:FUNCTION",
                       help="a function taking no arguments that runs your step once: an importable module "
                            "(pkg.step:run, found from the current directory too) or a file (path/to/step.py:run)")
    check.add_argument("--json", action="store_true", help="print the ops found as JSON")
    check.set_defaults(func=_check)
    return check


def _add_plugins(sub: Any) -> argparse.ArgumentParser:
    plugins = sub.add_parser(
        "plugins", help="list installed plugins: distribution, version, what they provide, hooks", formatter_class=HelpFormatter,
    )
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plugins.set_defaults(func=_plugins)
    return plugins


def parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command's parser and each subcommand's."""
    parser = argparse.ArgumentParser(
        prog="cgregistry", description="CUDA graphs for batched inference engines.",
        epilog="exit codes: 0 success, 1 the job found a problem (demo mismatches, unsafe ops), 2 bad input, "
               "141 the output pipe closed early (| head), silently",
    )
    parser.add_argument("--version", action="version", version=_version_text(), help="print the versions of cgregistry, torch and Python, and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = [add(sub) for add in (_add_demo, _add_plan, _add_inspect, _add_check, _add_plugins)]
    return parser, {command.prog.split()[-1]: command for command in commands}


def _version_text() -> str:
    """``cgregistry X (torch Y, Python Z)``: what a bug report needs."""
    import platform

    import torch

    from cgregistry.version import __version__

    return f"cgregistry {__version__} (torch {torch.__version__}, Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    """The ``cgregistry`` argument parser."""
    return parsers()[0]


def _message(exc: BaseException) -> str:
    """An exception's message (a KeyError's without the quotes str() adds)."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc)


# The exit code of a command whose reader went away (``| head``): what a shell reports for a tool killed by SIGPIPE.
EXIT_PIPE_CLOSED = 128 + 13


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (argparse exits with 2 itself on a usage error)."""
    try:
        return _run(argv)
    except BrokenPipeError:
        return _pipe_closed()


def _run(argv: Sequence[str] | None) -> int:
    parser, commands = parsers()
    args = parser.parse_args(argv)
    problem = getattr(args, "usage_error", lambda _: None)(args)
    if problem:
        commands[args.command].error(problem)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        raise
    except (ValueError, TypeError, KeyError, RuntimeError, OSError) as exc:
        translate = _TRANSLATE.get(args.command, lambda message, _: message)
        print(f"cgregistry {args.command}: error: {translate(_message(exc), args)}", file=sys.stderr)
        return 2


def _pipe_closed() -> int:
    """The reader of stdout left (``cgregistry inspect snap.json | head``): stop quietly, stdout's buffer sent to
    /dev/null so the interpreter's flush at exit does not fail again (Python's documented SIGPIPE handling)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in process): nothing to redirect
        pass
    return EXIT_PIPE_CLOSED


if __name__ == "__main__":
    sys.exit(main())

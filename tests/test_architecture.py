"""The architecture holds: a few wings in few layers, no import cycles, leaf modules, no reaching into private names, collaborators
that never call back into the registry, a whole typed plugin contract, and plugin strategies in plans."""

from __future__ import annotations

import ast
from collections.abc import Callable
import importlib.metadata
import functools
import subprocess
import sys
import types
from pathlib import Path

import attrs
import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.contracts.protocols import Backend, SegmentedBackend, protocol_members
from cgregistry.testing import make_plugins

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "cgregistry"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path) -> set[str]:
    """cgregistry modules ``path`` imports anywhere: at run time, in functions, and under TYPE_CHECKING (structure
    tools count type-only imports too, so a circle closed by one is still a circle)."""
    tree = ast.parse(path.read_text())
    this = module_name(path)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("cgregistry")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cgregistry"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if (PACKAGE.parent / (candidate.replace(".", "/") + ".py")).exists()
                          or (PACKAGE.parent / candidate.replace(".", "/")).is_dir() else node.module)
    found.discard(this)
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: {m for m in package_imports(path) if m in MODULES and m != "cgregistry"} for name, path in MODULES.items()}


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycle = trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state and name != "cgregistry":
            visit(name, [name])


def unit(module: str) -> str:
    """The wing or top-level module a module belongs to: ``cgregistry.capture.memory`` is in ``cgregistry.capture``."""
    return ".".join(module.split(".")[:2])


UNITS = {unit(m) for m in MODULES} - {"cgregistry"}
UNIT_GRAPH = {u: {unit(d) for m in MODULES if unit(m) == u for d in GRAPH[m]} - {u, "cgregistry"} for u in UNITS}


def test_the_package_is_a_few_wings_in_few_layers() -> None:
    """A newcomer sees at most 25 units (top-level modules and subpackages), importing one another in at most
    12 layers and never in a circle."""
    assert len(UNITS) <= 25, sorted(UNITS)

    @functools.cache
    def layer(u: str, trail: tuple[str, ...] = ()) -> int:
        if u in trail:
            pytest.fail(f"import circle between wings: {' -> '.join((*trail[trail.index(u):], u))}")
        return 1 + max((layer(d, (*trail, u)) for d in sorted(UNIT_GRAPH[u])), default=0)

    assert max(layer(u) for u in UNITS) <= 12


@pytest.mark.parametrize("leaf", ["cgregistry.contracts.markers", "cgregistry.errors", "cgregistry.version", "cgregistry.contracts.protocols"])
def test_leaf_modules_import_nothing_of_the_package(leaf: str) -> None:
    assert GRAPH[leaf] == set(), f"{leaf} imports {GRAPH[leaf]}"


def test_kv_cache_memory_is_the_engines_not_the_registrys() -> None:
    """``kvcache/`` (memory reserved before it is backed) is a tool the engine uses beside the registry: no other wing
    imports it, so the graph machinery never depends on it (nor on its optional cuda-bindings)."""
    wing = "cgregistry.kvcache"
    importers = sorted(m for m, deps in GRAPH.items() if unit(m) != wing and any(unit(d) == wing for d in deps))
    assert importers == [], importers


# Import names of pyproject's optional dependencies: cuda-bindings (kvcache), matplotlib (plot), transformers (hf).
OPTIONAL_IMPORTS = ("cuda", "matplotlib", "transformers")


def test_optional_dependencies_are_imported_only_inside_the_functions_that_need_them() -> None:
    """The package imports, and serves on the cpu backend, with none of its extras installed: an optional dependency is
    imported in the function that needs it (cuda-bindings at the first CUDA reservation, matplotlib for a plot), never
    when a module loads."""
    found = []
    for path in MODULES.values():
        tree = ast.parse(path.read_text())
        functions = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        in_functions = {id(n) for f in functions for n in ast.walk(f)}
        for node in ast.walk(tree):
            if id(node) in in_functions:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in OPTIONAL_IMPORTS]
    assert found == [], found


REGISTRY_PARTS = [
    "cgregistry.store.catalog", "cgregistry.store.io", "cgregistry.hooks.events", "cgregistry.capture.job", "cgregistry.capture.pool",
    "cgregistry.capture.queue", "cgregistry.capture.refit", "cgregistry.server", "cgregistry.capture.serving_state",
    "cgregistry.weights.watch", "cgregistry.weights.load",
]


@pytest.mark.parametrize("part", REGISTRY_PARTS)
def test_the_registrys_parts_never_import_it(part: str) -> None:
    assert "cgregistry.registry" not in GRAPH[part]


def private_attributes(tree: ast.AST) -> list[tuple[ast.Attribute, str]]:
    """Every ``x._name`` read in ``tree`` (one leading underscore), with the name the attribute chain starts from
    ("" where it starts from a call or a subscript)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            found.append((node, base.id if isinstance(base, ast.Name) else ""))
    return found


def private_reaches(path: Path) -> list[str]:
    """``module._name`` attribute reads where ``module`` is a cgregistry module bound by an import."""
    tree = ast.parse(path.read_text())
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("cgregistry")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cgregistry"):
            aliases |= {a.asname or a.name for a in node.names if (f"{node.module}.{a.name}") in MODULES or node.module == "cgregistry"}
    return [f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}" for node, root in private_attributes(tree) if root in aliases]


def private_imports(path: Path) -> list[str]:
    """``from cgregistry.x import _name``: a private name taken from a cgregistry module."""
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {a.name}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cgregistry")
        for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
    ]


def private_attribute_reads(path: Path) -> list[str]:
    """``obj._name`` reads outside the module that defines them: any attribute starting with one underscore on a
    name other than ``self`` / ``cls``, except other libraries' (torch's, Hugging Face's config fields)."""
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
        for node, root in private_attributes(ast.parse(path.read_text()))
        if root not in {"self", "cls", "torch", "super"} and node.attr not in THIRD_PARTY_PRIVATE
    ]


# Private names of other libraries that examples and tests must use: torch's, Hugging Face's and argparse's.  ``_apply``:
# torch's Module method through which ``.to()`` and ``to_empty()`` move parameters; the HF example's fused layers extend it.
THIRD_PARTY_PRIVATE = {"_attn_implementation", "_actions", "_HelpAction", "_get_help_string", "_C", "_dynamo", "_inductor",
                       "_schema", "_apply"}


def test_no_module_or_example_reaches_into_another_modules_private_names() -> None:
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "examples").glob("*.py")]
    assert [hit for f in files for hit in private_reaches(f) + private_imports(f)] == []


def test_tests_benchmarks_and_examples_read_no_private_state() -> None:
    """A test that must read ``reg._buffers`` shows a missing inspection API: give it a public seam instead."""
    files = [*(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "examples").glob("*.py")]
    files = [f for f in files if f.name != "test_architecture.py"]
    assert [hit for f in files for hit in private_attribute_reads(f) + private_imports(f)] == []


def test_python_dash_m_runs_the_command_line() -> None:
    done = subprocess.run([sys.executable, "-m", "cgregistry", "plugins"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "cgregistry.strategies.full" in done.stdout
    assert "NumPy" not in done.stderr, "torch's CPU wheel warns 'Failed to initialize NumPy' where numpy is missing"


def test_version_comes_from_package_metadata() -> None:
    assert cg.__version__ == importlib.metadata.version("cgregistry")


def test_every_error_shares_one_base_and_keeps_its_builtin_one() -> None:
    errors = [getattr(cg.errors, n) for n in cg.errors.__all__ if n != "CgregistryError"]
    defined = {name for name, obj in vars(cg.errors).items() if isinstance(obj, type) and issubclass(obj, Exception)}
    assert defined == set(cg.errors.__all__), "every error class the module defines is public, and only those"
    assert {n for n in cg.__all__ if n.endswith("Error")} <= set(cg.errors.__all__), "the top level re-exports, never defines, errors"
    for error in errors:
        assert issubclass(error, cg.CgregistryError), error
        assert issubclass(error, (ValueError, TypeError, RuntimeError)), error


def test_plugin_authors_find_their_names_in_one_namespace() -> None:
    assert {"hookimpl", "hookspec", "Strategy", "Backend", "SegmentedBackend", "StrategyRegistrar"} <= set(cg.plugin.__all__)
    assert not {"hookimpl", "hookspec"} & set(cg.__all__), "the top level is for engine writers"


# ---------------------------------------------------------------- the contract


def test_backend_validation_is_derived_from_the_protocols() -> None:
    assert protocol_members(SegmentedBackend)[: len(protocol_members(Backend))] == protocol_members(Backend)
    assert {"capture_context", "begin_capture", "hold_intermediates"} <= set(protocol_members(SegmentedBackend))
    for name in ("cpu", "cuda"):
        backend = cg.Plugins().backends[name]
        assert isinstance(backend, SegmentedBackend), f"built-in {name} provides the whole contract"


class FullOnlyBackend:
    """A third-party backend that can capture whole graphs but not segments (the cpu backend underneath)."""

    name = "full-only"

    def __init__(self) -> None:
        self.inner = cg.Plugins().backends["cpu"]

    def __getattr__(self, attr: str) -> object:
        if attr in ("capture_context", "begin_capture", "hold_intermediates"):
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def is_available(self) -> bool:
        return True

    def device(self) -> torch.device:
        return torch.device("cpu")

    def new_pool(self) -> object:
        return object()

    def warmup(self, fn, runs):  # type: ignore[no-untyped-def]
        return self.inner.warmup(fn, runs)

    def capture(self, fn, pool):  # type: ignore[no-untyped-def]
        return self.inner.capture(fn, pool)

    def share_outputs(self, leaves):  # type: ignore[no-untyped-def]
        return leaves

    def recover_pool(self, pool):  # type: ignore[no-untyped-def]
        return pool

    def synchronize(self) -> None:
        return None

    @cg.plugin.hookimpl
    def cgregistry_register_backends(self, register):  # type: ignore[no-untyped-def]
        assert isinstance(register, cg.plugin.Registrar) and register.kind == "backend"
        register(self)


def test_a_backend_without_segments_serves_full_and_refuses_breakable_by_name() -> None:
    reg = cg.GraphRegistry(lambda b, x: x * 2, {"x": cg.StaticInput((8,), torch.float32)}, backend="full-only",
                           plugins=make_plugins(FullOnlyBackend()))
    reg.capture([(B(8), "full")])
    torch.testing.assert_close(reg.run(B(3), x=torch.ones(3)), torch.full((3,), 2.0))
    with pytest.raises(cg.CaptureError, match="needs a cgregistry.contracts.protocols.SegmentedBackend"):
        reg.capture([(B(4), "breakable")])


def test_a_registrar_knows_its_plugin() -> None:
    seen = []

    class Probe:
        @cg.plugin.hookimpl
        def cgregistry_register_strategies(self, register):  # type: ignore[no-untyped-def]
            seen.append((register.kind, register.plugin))

    pm = cg.plugin.make_plugin_manager(autoload=False)
    pm.register(Probe(), name="probe")
    cg.Plugins(pm)
    assert ("strategy", "probe") in seen


# ---------------------------------------------------------------- plugin strategies in plans


class VendorRelaxed(cg.plugin.BreakableStrategy):
    name = "vendor-relaxed"
    relaxes_num_reqs = True


class VendorExact(cg.plugin.FullStrategy):
    name = "vendor-exact"
    relaxes_num_reqs = False


class Vendors:
    @cg.plugin.hookimpl
    def cgregistry_register_strategies(self, register):  # type: ignore[no-untyped-def]
        register(VendorRelaxed())
        register(VendorExact())


def vendor_plugins() -> cg.Plugins:
    return make_plugins(Vendors())


@pytest.mark.parametrize("mixed, relaxed", [("vendor-relaxed", True), ("vendor-exact", False), ("piecewise", True), ("full", False)])
def test_each_strategys_own_flag_decides_its_mixed_keys(mixed: str, relaxed: bool) -> None:
    settings = dict(max_num_seqs=8, max_num_tokens=64, mode=("vendor-exact", mixed), plugins=vendor_plugins())
    if mixed == "vendor-exact":  # one strategy for both: uniform keys of their own only when the step branches on uniformity
        folded = cg.CapturePlan.build(**settings)
        assert {e.strategy for e in folded} == {mixed} and not any(e.descriptor.uniform for e in folded)
        settings["separate_decode"] = True
    for plan in (cg.CapturePlan.build(**settings),
                 cg.CapturePlan.fit([B(5, 2), B(9, 3), B.decode(3)], 6, **settings)):
        mixed_keys = [e.descriptor for e in plan if e.strategy == mixed]
        decode_keys = [e.descriptor for e in plan if e.strategy == "vendor-exact" and e.descriptor.uniform]
        assert mixed_keys and decode_keys
        assert all((k.num_reqs is None) == relaxed for k in mixed_keys), mixed_keys


def test_a_mode_pair_may_leave_either_side_out() -> None:
    plugins = vendor_plugins()
    decode_only = cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64, mode=("vendor-exact", None), plugins=plugins)
    assert {e.strategy for e in decode_only} == {"vendor-exact"} and all(e.descriptor.uniform for e in decode_only)
    mixed_only = cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64, mode=(None, "vendor-relaxed"), plugins=plugins)
    assert {e.descriptor.num_reqs for e in mixed_only} == {None}


@pytest.mark.parametrize("mode, message", [
    (("nope", None), r"mode \('nope', None\): strategy 'nope' is not registered"),
    (("full",), "a pair"),
    ("fulll", "unknown mode 'fulll'"),
])
def test_bad_modes_name_themselves(mode: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64, mode=mode)  # type: ignore[arg-type]


def test_a_vendor_plan_captures_and_serves() -> None:
    plugins = vendor_plugins()
    plan = cg.CapturePlan.build(max_num_seqs=4, max_num_tokens=16, mode=("vendor-exact", "vendor-relaxed"), plugins=plugins)
    reg = cg.GraphRegistry(lambda b, x: x + 1, {"x": cg.StaticInput((16,), torch.float32)}, backend="cpu", plugins=plugins,
                           preference=("vendor-exact", "vendor-relaxed"))
    reg.capture(plan)
    for batch in (B.decode(3), B(7, 3)):
        x = torch.arange(float(batch.num_tokens))
        torch.testing.assert_close(reg.run(batch, x=x), x + 1)
    assert reg.stats().by_strategy == {"vendor-exact": 1, "vendor-relaxed": 1}


def test_settings_are_declared_once() -> None:
    settings = cg.PlanSettings(max_num_seqs=8, max_num_tokens=64, mode="full_and_piecewise")
    assert cg.CapturePlan.build(settings) == cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64, mode="full_and_piecewise")
    assert settings.used_capture_sizes[-1] == settings.used_max_capture_size == 16  # what the defaults resolve to
    assert settings.capture_sizes is None and settings.max_capture_size is None, "the settings stay as given"
    assert attrs.evolve(settings, max_num_seqs=64, max_num_tokens=4096).used_max_capture_size == 128
    assert cg.CapturePlan.build(8, 64, "full_and_piecewise") == cg.CapturePlan.build(settings), "positional settings in declaration order"
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int, got 0"):
        cg.PlanSettings(max_num_seqs=0, max_num_tokens=64)
    with pytest.raises(TypeError, match="not both"):
        cg.CapturePlan.build(settings, max_num_seqs=4)
    with pytest.raises(TypeError, match="setting 'max_num_seqs' given twice"):
        cg.CapturePlan.build(8, max_num_seqs=4, max_num_tokens=64)
    with pytest.raises(ValueError, match="max_loras must be a positive int, got -1"):
        cg.PlanSettings(max_num_seqs=8, max_num_tokens=64, lora_counts=[0, 4], max_loras=-1)
    with pytest.raises(ValueError, match=r"lora_counts \[0, 8\] go beyond max_loras=4"):
        cg.PlanSettings(max_num_seqs=8, max_num_tokens=64, lora_counts=[0, 8], max_loras=4)


def test_built_in_modes_need_no_plugin_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    from cgregistry.plan import BUILTIN_RELAXES

    for name, cls in (("full", cg.plugin.FullStrategy), ("breakable", cg.plugin.BreakableStrategy)):
        assert BUILTIN_RELAXES[name] is cls.relaxes_num_reqs
    assert BUILTIN_RELAXES["piecewise"] is cg.Plugins().strategy("piecewise").relaxes_num_reqs
    monkeypatch.setenv("CGREGISTRY_BLOCK_PLUGINS", "cgregistry.strategies.piecewise")
    assert len(cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64)) == 9, "a plan is data: blocking a strategy does not stop it"


def test_the_top_level_holds_what_an_engine_writer_types() -> None:
    assert len(cg.__all__) <= 30 and set(cg.__all__) <= set(dir(cg))
    public = {name for name in dir(cg) if not name.startswith("_")}
    wings = {name for name in public if isinstance(getattr(cg, name), types.ModuleType)}
    assert public - wings == set(cg.__all__) - {"plugin", "__version__"}, "every top-level name is in __all__ or is a wing"
    with pytest.raises(AttributeError):
        cg.hookimpl  # noqa: B018 - plugin markers live in cgregistry.plugin


def test_a_registrar_refuses_classes_and_late_calls() -> None:
    kept = []

    class Sloppy:
        @cg.plugin.hookimpl
        def cgregistry_register_strategies(self, register):  # type: ignore[no-untyped-def]
            kept.append(register)
            register(VendorExact)  # the class, not an instance

    pm = cg.plugin.make_plugin_manager(autoload=False)
    pm.register(Sloppy(), name="sloppy")
    with pytest.raises(cg.PluginError, match="plugin 'sloppy' registered the class VendorExact; register an instance"):
        cg.Plugins(pm)
    with pytest.raises(cg.PluginError, match="after its registration hook returned"):
        kept[0](VendorExact())


def test_explain_agrees_with_match_when_the_batch_is_too_large_for_a_static_input() -> None:
    reg = cg.GraphRegistry(lambda b, x, r: x, {"x": cg.StaticInput((64,), torch.float32), "r": cg.StaticInput((4,), torch.float32, axis="reqs")},
                           backend="cpu", plugins=make_plugins())
    reg.capture([(B(32), "full")])
    explanation = reg.explain(B(20, 12))
    assert reg.match(B(20, 12)) is None and explanation.match is None
    assert "runs eagerly: 12 reqs do not fit static input 'r', which holds 4" in str(explanation)
    assert not any(c.chosen for c in explanation.candidates)


def test_capture_warns_when_a_decode_strategy_can_never_win() -> None:
    plugins = vendor_plugins()
    plan = cg.CapturePlan.build(max_num_seqs=4, max_num_tokens=16, mode=("vendor-exact", "breakable"), plugins=plugins)
    shadowed = cg.GraphRegistry(lambda b, x: x + 1, {"x": cg.StaticInput((16,), torch.float32)}, backend="cpu", plugins=plugins,
                                preference=("full", "piecewise", "breakable"))
    with pytest.warns(RuntimeWarning, match=r"uniform keys of strategy 'vendor-exact' rank after 'breakable'.*preference=\('vendor-exact', 'breakable'"):
        shadowed.capture(plan)
    assert shadowed.match(B.decode(3)).strategy == "breakable", "the warning is true: breakable serves decode batches"
    ordered = cg.GraphRegistry(lambda b, x: x + 1, {"x": cg.StaticInput((16,), torch.float32)}, backend="cpu", plugins=plugins)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ordered.capture(plan)  # no preference given: the plan's order (its decode strategy first) is adopted
    assert ordered.match(B.decode(3)).strategy == "vendor-exact" and ordered.preference[:2] == ("vendor-exact", "breakable")
    assert ordered.stats().hits == 0 and ordered.run(B.decode(3), x=torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
    assert ordered.stats().by_strategy["vendor-exact"] == 1


def test_one_table_of_built_ins_gives_plugins_preference_modes_and_flags() -> None:
    from cgregistry import builtins

    names = [s.name for s in builtins.STRATEGIES]
    assert cg.Matcher([]).preference == names == ["full", "piecewise", "breakable"]
    registered = {info.name for info in cg.Plugins().describe() if info.builtin}
    assert registered == set(builtins.DEFAULT_PLUGINS) == {*builtins.BACKEND_MODULES, *(s.module for s in builtins.STRATEGIES)}
    for row in builtins.STRATEGIES:
        assert cg.Plugins().strategy(row.name).relaxes_num_reqs is row.relaxes_num_reqs
    assert cg.plan.MODES == {
        "none": (None, None), "full": ("full", "full"), "piecewise": (None, "piecewise"), "breakable": (None, "breakable"),
        "full_decode_only": ("full", None), "full_and_piecewise": ("full", "piecewise"), "full_and_breakable": ("full", "breakable"),
    }


def traced_modules(fn: Callable[[], object]) -> tuple[list[str], int]:
    """The package modules ``fn`` enters, in order, and how many calls go into a module entered before from another
    (or from outside the package: torch calling the cpu emulator's hooks)."""
    seen: list[str] = []
    back = 0

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        nonlocal back
        if event != "call" or not frame.f_code.co_filename.startswith(str(PACKAGE)):
            return
        module = frame.f_code.co_filename
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else None
        if module in seen and caller != module:
            back += 1
        elif module not in seen:
            seen.append(module)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return [str(Path(m).relative_to(PACKAGE)) for m in seen], back


FIRST_CAPTURE = """
import json, torch
import cgregistry as cg
from cgregistry import BatchDescriptor as B
from tests.test_architecture import traced_modules

lm_head, embed = torch.nn.Linear(32, 100), torch.nn.Embedding(100, 32)

def forward(batch, input_ids, seq_lens):  # the README's step
    return lm_head(embed(input_ids))

reg = cg.GraphRegistry(forward, backend="cpu", watch=[embed, lm_head], inputs={
    "input_ids": cg.StaticInput((256,), torch.long, fill=0),
    "seq_lens": cg.StaticInput((64,), torch.int32, axis="reqs", fill=1),
})
key, ids, lens = B.decode(8), torch.arange(8), torch.full((8,), 7, dtype=torch.int32)
capture = traced_modules(lambda: reg.capture([(key, "full")]))
reg.run(key, input_ids=ids, seq_lens=lens)
run = traced_modules(lambda: reg.run(key, input_ids=ids, seq_lens=lens))
torch.testing.assert_close(reg.run(key, input_ids=ids, seq_lens=lens), forward(key, ids, lens))
print(json.dumps({"capture": capture, "run": run}))
"""


def test_one_foreground_capture_walks_few_modules() -> None:
    """The process's first capture, of one full key of a step with two inputs, enters at most 10 package modules, with
    at most 20 calls back into one already left; a run() of a shape seen before enters at most 3 (the server, the
    inputs' checks and staging, the backend's replay), going back only to check the second input and to stage both."""
    import json

    done = subprocess.run([sys.executable, "-c", FIRST_CAPTURE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    walked = json.loads(done.stdout.strip().splitlines()[-1])
    modules, back = walked["capture"]
    assert len(modules) <= 10 and back <= 20, (modules, back)
    modules, back = walked["run"]
    assert len(modules) <= 3 and back <= 2, (modules, back)


def test_the_conformance_suite_does_not_depend_on_the_command_line() -> None:
    """A plugin author's tests import ``cgregistry.testing``: the demo decoder it captures lives outside ``cli/``."""
    assert "cgregistry.cli" not in UNIT_GRAPH["cgregistry.testing"], UNIT_GRAPH["cgregistry.testing"]

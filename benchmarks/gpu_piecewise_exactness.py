"""Does a ``piecewise`` entry compute what the eager step computes at the same padded shape?  (HF Llama, GPU.)

A decode batch of 60 requests is padded to a 64-request key.  The oracle is the same step run eagerly
on the padded inputs (what the graph computes), so any difference is the compiled path's, not padding's.
Compares ``full``, ``breakable`` and ``piecewise`` (with and without Inductor pieces), and bounds each
against the same step in float32: a compiled path whose distance to float32 is that of eager bf16 rounds
differently; one farther off computes something else.

    PYTHONPATH=. python3 benchmarks/gpu_piecewise_exactness.py
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import torch

import cgregistry as cg

_spec = importlib.util.spec_from_file_location("hf_llama", Path(__file__).parent.parent / "examples" / "hf_llama.py")
hf = importlib.util.module_from_spec(_spec)
sys.modules["hf_llama"] = hf
_spec.loader.exec_module(hf)
sys.path.insert(0, str(Path(__file__).parent))
from gpu_hf_llama import SHAPE, decode_inputs  # noqa: E402


def main() -> None:
    device = torch.device("cuda")
    model = hf.build_model("llama-3.2-1b", device, SHAPE)
    model32 = copy.deepcopy(model).float()  # the same weights (and cache) in float32: the reference for rounding
    step = hf.make_step(model, hf.decoder(model))
    live, padded = cg.BatchDescriptor.decode(60), cg.BatchDescriptor.decode(64)
    inputs64 = decode_inputs(64, 500, device)
    # the live batch is the first 60 rows; the padded one is what the registry builds from it
    inputs60 = {k: (v[:61] if k == "query_start_loc" else v[:60]) for k, v in inputs64.items()}
    specs = hf.static_inputs(SHAPE)
    pad = {k: v.clone() for k, v in inputs64.items()}
    for k, v in pad.items():
        if k == "query_start_loc":
            v[61:] = v[60]
        else:
            v[60:] = specs[k].fill
    with torch.inference_mode(), cg.eager_batch(padded):
        want = step(padded, **pad)["logits"][:60].float()
        exact = hf.make_step(model32, hf.decoder(model32))(padded, **pad)["logits"][:60]
    rows = [("eager bf16", padded, (want - want).abs().max().item(), 1.0, (want - exact).abs().max().item(),
             (want.argmax(-1) == exact.argmax(-1)).float().mean().item())]
    for label, strategy, key, inductor in (
        ("full", "full", padded, False), ("breakable", "breakable", cg.BatchDescriptor(64), False),
        ("piecewise", "piecewise", cg.BatchDescriptor(64), False), ("piecewise+inductor", "piecewise", cg.BatchDescriptor(64), True),
    ):
        holder = {}
        forward = hf.decoder(model)
        body = (lambda *a: holder["c"](*a)) if strategy == "piecewise" else forward
        reg = cg.GraphRegistry(hf.make_step(model, body), specs, output_axis=hf.OUTPUT_AXES)
        if strategy == "piecewise":
            holder["c"] = reg.compile(forward, inductor=inductor)
        with torch.inference_mode():
            reg.capture([(key, strategy)])
            got = reg.run(live, **inputs60)["logits"].float()
        rows.append((label, reg.match(live).key, (got - want).abs().max().item(), (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
                     (got - exact).abs().max().item(), (got.argmax(-1) == exact.argmax(-1)).float().mean().item()))
        del reg
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; decode 60 padded to 64, logits against eager (bf16) "
          f"at the padded shape, and against the same step in float32 (|logit| up to {exact.abs().max().item():.3g})")
    print(f"{'':20} {'key':32} {'vs eager bf16':>14} {'argmax agree':>12} {'vs float32':>11} {'argmax agree':>12}")
    for label, key, diff, agree, diff32, agree32 in rows:
        print(f"{label:20} {str(key):32} {diff:14.4g} {agree:12.3f} {diff32:11.4g} {agree32:12.3f}")


if __name__ == "__main__":
    main()

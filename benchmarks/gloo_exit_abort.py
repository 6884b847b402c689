"""A gloo process group freed while the interpreter finalizes can abort the process (torch alone, no cgregistry).

Two ranks run 200 all-reduces, destroy the group, and exit.  ``keep``: the group stays in a global, so it is
freed during finalization ("terminate called without an active exception", SIGABRT, 15 of 25 runs on this
project's CPU machine); ``release``: the global is dropped first (0 of 25).  Count the aborts:

    for i in $(seq 25); do torchrun --standalone --nproc-per-node 2 benchmarks/gloo_exit_abort.py keep \
        >/dev/null 2>&1 || echo abort; done | wc -l
"""

from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist

kept: object = None


def main() -> None:
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    for i in range(200):
        dist.all_reduce(torch.full((1000,), float(i)), group=group)
    dist.destroy_process_group()
    if sys.argv[1:] == ["release"]:
        del group
        gc.collect()
    else:
        global kept
        kept = group  # freed only while the interpreter finalizes


if __name__ == "__main__":
    main()

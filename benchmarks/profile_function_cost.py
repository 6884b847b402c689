"""What a profile function on one thread costs every other thread's Python: the cost that decides how the capture
thread finds the moments to stand aside (cgregistry.capture.background.STAND_ASIDE_BY).

A Python-heavy loop on this thread is timed alone, then while another thread has a profile function set
(``sys.setprofile``) and sleeps, then after that thread cleared it and ended.  Up to Python 3.11 a profile function is
its thread's own; from 3.12 it switches on instrumentation for the whole interpreter.

    python3 benchmarks/profile_function_cost.py
"""

from __future__ import annotations

import sys
import threading
import time


def add_one(x: int) -> int:
    return x + 1


def python_loop(n: int = 300_000) -> float:
    """Seconds for ``n`` rounds of a Python call and two builtin calls (the best of five runs)."""
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        s = 0
        for _ in range(n):
            s = add_one(s)
            len("ab")
            abs(-1)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    alone = python_loop()
    ready, done = threading.Event(), threading.Event()

    def profiled() -> None:
        sys.setprofile(lambda frame, event, arg: None)
        ready.set()
        done.wait()
        sys.setprofile(None)

    other = threading.Thread(target=profiled)
    other.start()
    ready.wait()
    beside = python_loop()
    done.set()
    other.join()
    after = python_loop()
    print(f"Python {sys.version.split()[0]}: a Python loop alone {alone * 1e3:.1f} ms; while another thread has a profile "
          f"function {beside * 1e3:.1f} ms ({beside / alone:.2f}x); after it cleared it {after * 1e3:.1f} ms ({after / alone:.2f}x)")


if __name__ == "__main__":
    main()

from __future__ import annotations

from pathlib import Path

import pytest

from cgregistry import BatchDescriptor as B
from cgregistry.plan.workload import Request, SchedulerConfig, read_trace, schedule


def write(tmp_path: Path, rows: list[str], header: str = "TIMESTAMP,ContextTokens,GeneratedTokens") -> Path:
    path = tmp_path / "trace.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def test_bundled_trace_reads_whole() -> None:
    reqs = read_trace()
    assert len(reqs) == 19366
    assert reqs[0] == Request(0.0, 374, 44)
    assert reqs[1].arrival_s == pytest.approx(50.9951690 - 46.6805900)
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert 3000 < reqs[-1].arrival_s < 3700, "about one hour"
    assert len(read_trace(limit=10)) == 10


def test_bad_traces_say_where(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected a header TIMESTAMP,ContextTokens,GeneratedTokens"):
        read_trace(write(tmp_path, [], header="time,in,out"))
    with pytest.raises(ValueError, match=r"trace.csv:3: cannot read row"):
        read_trace(write(tmp_path, ["2023-11-16 18:15:46.1,10,5", "2023-11-16 18:15:47.1,ten,5"]))
    with pytest.raises(ValueError, match=r"trace.csv:2: token counts must be positive, got 0, 5"):
        read_trace(write(tmp_path, ["2023-11-16 18:15:46.1,0,5"]))


def test_schedule_hand_checked(tmp_path: Path) -> None:
    trace = write(tmp_path, ["2023-11-16 18:00:00.0,5,3", "2023-11-16 18:00:00.0,3,1", "2023-11-16 18:00:10.0,2,2"])
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=6, step_base_s=1.0, step_per_token_s=0.0)
    steps = list(schedule(read_trace(trace), config))
    assert steps == [
        B(6, 2),  # A's whole prompt (5) + 1 token of B's chunked prompt
        B(3, 2),  # A decodes 1, B finishes its prompt (2); B is done (one output token)
        B.decode(1),  # A's last decode
        B(2, 1),  # C arrives at t=10 after an idle gap
        B.decode(1),
    ]


def test_schedule_respects_max_num_seqs_and_decodes_first() -> None:
    reqs = [Request(0.0, 4, 10) for _ in range(5)]
    steps = list(schedule(reqs, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=100), max_steps=4))
    assert steps[0] == B(12, 3), "three admitted, two wait"
    assert steps[1] == B.decode(3)
    assert all(s.num_reqs <= 3 for s in steps)


def test_speculative_steps_are_uniform_with_depth() -> None:
    steps = list(schedule([Request(0.0, 2, 5)], SchedulerConfig(spec_depth=1)))
    assert steps == [B(2, 1, spec_depth=1), B.decode(1, 1), B.decode(1, 1)]

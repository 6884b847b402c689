"""Batches larger than every key of their form run eagerly: the capture says which ranges the plan leaves out (the
cgregistry log), and run() warns once when such batches turn out to be at least half of the steps."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.server import ABOVE_LARGEST_HINT_AFTER

PLAN = cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=256)  # the default max_capture_size: 16 tokens


def make() -> cg.GraphRegistry:
    return cg.GraphRegistry(lambda b, x: x * 2, {"x": cg.StaticInput((256, 4), torch.float32)}, backend="cpu")


def test_capture_logs_the_token_ranges_no_key_serves(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="cgregistry"):
        make().capture(PLAN)
    assert "no key serves mixed batches of 17-256 tokens" in caplog.text


def test_run_warns_once_when_most_steps_are_larger_than_every_key() -> None:
    reg = make()
    reg.capture(PLAN)
    with pytest.warns(RuntimeWarning, match=r"16 of the 3\d graph-eligible steps so far ran eagerly") as record:
        for i in range(2 * ABOVE_LARGEST_HINT_AFTER):
            reg.run(B.decode(4), x=torch.ones(4, 4))
            reg.run(B(40 + i, 4), x=torch.ones(40 + i, 4))
    assert sum("graph-eligible" in str(w.message) for w in record) == 1 and record[0].filename == __file__
    assert reg.stats().misses_by_reason["above_largest_key"] == 2 * ABOVE_LARGEST_HINT_AFTER


def test_a_few_large_batches_among_many_served_ones_are_not_warned_about() -> None:
    reg = make()
    reg.capture(PLAN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3 * ABOVE_LARGEST_HINT_AFTER):
            reg.run(B.decode(4), x=torch.ones(4, 4))
            reg.run(B.decode(2), x=torch.ones(2, 4))
            reg.run(B.decode(3), x=torch.ones(3, 4))
            if i % 2:
                reg.run(B(40 + i, 4), x=torch.ones(40 + i, 4))


def test_steps_served_before_a_recapture_count_against_the_warning() -> None:
    reg = make()
    reg.capture(PLAN)
    for _ in range(4 * ABOVE_LARGEST_HINT_AFTER):
        reg.run(B.decode(4), x=torch.ones(4, 4))
    reg.clear()
    reg.capture(PLAN)  # the entries are new; the steps they served before still count
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(ABOVE_LARGEST_HINT_AFTER):
            reg.run(B(40 + i, 4), x=torch.ones(40 + i, 4))

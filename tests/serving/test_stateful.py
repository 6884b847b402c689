"""The registry's two stateful machines (test_reliability.py, test_serving_safety.py), a few examples each.

Their full runs (40 and 30 examples, minutes on two cores) are marked ``slow``: CI runs them with
``python -m pytest -m slow``.  These keep a share of the same rules, invariants and faults in the default
test run, so a change that breaks an engine's life shows there too.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from tests.serving.test_reliability import RegistryMachine
from tests.serving.test_serving_safety import EngineLife

QUICK = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


class QuickRegistryMachine(RegistryMachine):
    """RegistryMachine's rules and invariant, 4 examples."""


class QuickEngineLife(EngineLife):
    """EngineLife's rules and invariants, 4 examples."""


QuickRegistryMachine.TestCase.settings = settings(max_examples=4, stateful_step_count=12, **QUICK)
QuickEngineLife.TestCase.settings = settings(max_examples=4, stateful_step_count=15, **QUICK)
# Both machines run batches before any capture and after clear(), on purpose.
no_graphs_yet = pytest.mark.filterwarnings("ignore:.*with no graph captured or planned:RuntimeWarning")
test_registry_state_machine_quick = no_graphs_yet(QuickRegistryMachine.TestCase)
test_engine_life_cpu_quick = no_graphs_yet(QuickEngineLife.TestCase)

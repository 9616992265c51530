"""The unit tier: every test under tests/unit gets the ``unit`` marker (``pytest -m unit``).

Nothing in this tier may need pyspark, Airflow or Prefect; ``test_tier.py`` checks that by
running the tier with them blocked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

UNIT_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Called with every collected item of the session, not only this directory's.
    for item in items:
        if item.path.resolve().is_relative_to(UNIT_DIR):
            item.add_marker(pytest.mark.unit)

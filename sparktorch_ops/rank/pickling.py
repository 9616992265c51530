"""The pickler of a run's function and of rank 0's value.

pyspark's own copy of cloudpickle wherever pyspark is installed: every Spark Python worker has
it, so the executors need no cloudpickle of their own. Without pyspark (local mode needs none)
the ranks run beside the driver, in its environment, and cloudpickle itself does.
"""

from __future__ import annotations

import importlib
import types


def cloudpickle_module() -> types.ModuleType:
    """pyspark's cloudpickle, else cloudpickle."""
    try:
        return importlib.import_module("pyspark.cloudpickle")
    except ImportError:
        return importlib.import_module("cloudpickle")

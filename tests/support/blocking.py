"""Make packages impossible to import in a subprocess, as if they were not installed.

The source returned by :func:`blocker_source` installs a meta-path finder that raises
ImportError for the named top-level packages. Run it with ``python -c`` before the code under
test, or write it as ``sitecustomize.py`` into a directory put first on ``PYTHONPATH`` so every
Python started from that environment (subprocesses too) has the packages blocked.
"""

from __future__ import annotations

from collections.abc import Iterable

# The optional integrations: the unit tier runs without any of them.
INTEGRATIONS = ("pyspark", "py4j", "airflow", "prefect", "mlflow")
# Everything the core must import without (torch too: report() runs anywhere).
FRAMEWORKS = (*INTEGRATIONS, "torch", "lightning", "deepspeed")


def blocker_source(names: Iterable[str]) -> str:
    """Python source that blocks importing the top-level packages ``names``."""
    return f"""
import sys
class Block:
    blocked = {tuple(sorted(set(names)))!r}
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.blocked:
            raise ImportError(f"{{name}} is blocked in this test")
        return None
sys.meta_path.insert(0, Block())
"""

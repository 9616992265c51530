"""Provider info for Airflow's ``apache_airflow_provider`` entry point.

Registered in ``pyproject.toml``::

    [project.entry-points.apache_airflow_provider]
    provider_info = "sparktorch_ops.airflow.provider:get_provider_info"

It declares the operator, its extra link and the ``[sparktorch_ops]`` config section. It adds no
connection type: the operator reads the Spark provider's existing ``spark`` connections.
"""

from __future__ import annotations

from typing import Any

from sparktorch_ops.wire import VERSION


def get_provider_info() -> dict[str, Any]:
    """The provider info dict (schema: ``airflow/provider_info.schema.json``)."""
    return {
        "package-name": "sparktorch-ops",
        "name": "sparktorch_ops",
        "description": (
            "Run torchrun training (DDP, FSDP, Lightning, DeepSpeed) on Spark barrier tasks or "
            "on the worker: TorchDistributorOperator."
        ),
        "versions": [VERSION],
        "integrations": [
            {
                "integration-name": "sparktorch_ops",
                "external-doc-url": "https://pytorch.org/docs/stable/elastic/run.html",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": "sparktorch_ops",
                "python-modules": ["sparktorch_ops.airflow.operator"],
            }
        ],
        "extra-links": [
            "sparktorch_ops.airflow.links.SparkUILink",
            "sparktorch_ops.airflow.links.MlflowRunLink",
        ],
        "config": {
            "sparktorch_ops": {
                "description": "Defaults of TorchDistributorOperator.",
                "options": {
                    "result_location": {
                        "description": (
                            "Where rank 0's value goes when it is not JSON-safe or larger than "
                            "max_xcom_value_bytes: a local directory or an ObjectStoragePath / "
                            "fsspec URL. Empty: $AIRFLOW_HOME/sparktorch_ops/results."
                        ),
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "s3://aws_default@my-bucket/sparktorch-results",
                        "default": "",
                    },
                    "max_xcom_value_bytes": {
                        "description": (
                            "The largest JSON-safe value (as JSON, in bytes) kept inline in the "
                            "XCom summary."
                        ),
                        "version_added": "0.1.0",
                        "type": "integer",
                        "example": "49152",
                        "default": "49152",
                    },
                },
            }
        },
    }

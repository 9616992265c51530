#!/usr/bin/env bash
# Set up (or refresh) the virtualenv, check style and types, and run the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/venv.sh
source scripts/env.sh
ruff check sparktorch_ops tests dags flows examples benchmarks
mypy
pytest -ra "$@"

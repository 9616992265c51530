#!/usr/bin/env bash
# Set up (or refresh) the virtualenv and run the main job: the example DDP training through the
# CLI on local Spark (barrier mode, 2 ranks).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/venv.sh
source scripts/env.sh
sparktorch-ops run --num-processes 2 --no-local-mode --master 'local[2]' \
  examples/ddp_train.py -- --epochs 3

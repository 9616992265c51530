#!/usr/bin/env bash
# The GPU path, as one script: local mode with use_gpu=True and NCCL, no Spark, no Java.
#
#   bash benchmarks/gpu_check.sh prepare   # here (with network): fetch the wheels the GPU machine lacks
#   bash benchmarks/gpu_check.sh run       # on the GPU machine (the device tool's `run`)
#
# The GPU machine has Python 3.12 and torch with CUDA, lightning, cloudpickle and scikit-learn,
# but no pyspark and no Java, and reaches no package index. `prepare` downloads cp312 wheels of
# what it may lack (pendulum, psutil, pytest and their dependencies, ~3 MB) into
# benchmarks/gpu/wheels; `run` installs the missing ones into a private directory (pip
# --no-index, or plain unzip where there is no pip), puts this checkout on PYTHONPATH, then:
#   1. pytest -m gpu tests/frameworks/test_gpu.py  (GPU per rank, DDP example as function and
#      script, Lightning example, FSDP example, a ResNet-50 step; --noconftest: the suite's
#      conftest imports pyspark)
#   2. benchmarks/gpu/gpu_bench.py: launch (NCCL all-reduce) and throughput (DDP ResNet-50,
#      synthetic 224x224) through ours vs bare torchrun, alternating, medians and ratios.
# Results go to $OUT (the device tool's output folder) or benchmarks/results/gpu.
# Device tool: run(command="bash benchmarks/gpu_check.sh run", carry=["benchmarks/gpu/wheels"],
# timeout_s=540); about 5-6 minutes on one GPU.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wheels="$root/benchmarks/gpu/wheels"
python="${PYTHON:-python3}"

prepare() {
  mkdir -p "$wheels"
  "${PIP_PYTHON:-$root/.venv/bin/python}" -m pip download --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    "pendulum==3.3.0" "psutil==7.2.2" "cloudpickle==3.1.3" "pytest==8.4.2" "pytest-timeout==2.4.0" \
    -d "$wheels"
  du -sh "$wheels"
}

install_missing() {
  # Only what the machine lacks, into a private target that goes first on PYTHONPATH.
  local target="$1" missing=()
  local pair module requirement
  for pair in pendulum:pendulum psutil:psutil cloudpickle:cloudpickle pytest:pytest \
              pytest_timeout:pytest-timeout; do
    module="${pair%%:*}"; requirement="${pair#*:}"
    "$python" -c "import $module" 2>/dev/null || missing+=("$requirement")
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    echo "nothing to install"
    return 0
  fi
  echo "installing from $wheels: ${missing[*]}"
  mkdir -p "$target"
  if "$python" -m pip --version >/dev/null 2>&1; then
    "$python" -m pip install --quiet --no-index --find-links "$wheels" --target "$target" \
      "${missing[@]}"
  else
    # No pip: wheels are zip files; unpacking every carried wheel makes them importable.
    "$python" - "$wheels" "$target" <<'EOF'
import sys, zipfile, pathlib
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    zipfile.ZipFile(wheel).extractall(sys.argv[2])
EOF
  fi
}

run() {
  local out="${OUT:-$root/benchmarks/results/gpu}" rc=0
  mkdir -p "$out"
  cd "$root"
  {
    echo "== machine"; nvidia-smi -L || true; "$python" --version
    "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), 'devices', torch.cuda.device_count())"
  } 2>&1 | tee "$out/machine.txt"
  install_missing /tmp/sparktorch-gpu-deps 2>&1 | tee "$out/install.log"
  export PYTHONPATH="/tmp/sparktorch-gpu-deps:$root${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
  "$python" -c "import pendulum, psutil, cloudpickle, sparktorch_ops.distributor, lightning; \
print('imports ok; pyspark present:', __import__('importlib').util.find_spec('pyspark') is not None)" \
    2>&1 | tee -a "$out/install.log" || exit 2

  echo "== 1. GPU tests (DDP, Lightning, FSDP, ResNet-50 step; use_gpu=True, NCCL)"
  timeout 300 "$python" -m pytest --noconftest -p no:cacheprovider -q -rs -m gpu \
    tests/frameworks/test_gpu.py -o timeout=240 --junitxml="$out/pytest_gpu.xml" 2>&1 \
    | tee "$out/pytest_gpu.log"
  rc=$(( rc | ${PIPESTATUS[0]} ))

  if [ -n "${SKIP_BENCH:-}" ]; then  # SKIP_BENCH=1: the GPU tests only (a quick re-check)
    echo "== done (exit $rc); results in $out"
    exit "$rc"
  fi
  echo "== 2. launch and throughput: ours vs bare torchrun"
  timeout 360 "$python" benchmarks/gpu/gpu_bench.py --out "$out" --repeats "${REPEATS:-3}" 2>&1 \
    | tee "$out/gpu_bench.log"
  rc=$(( rc | ${PIPESTATUS[0]} ))
  echo "== done (exit $rc); results in $out"
  exit "$rc"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 prepare|run" >&2; exit 64 ;;
esac

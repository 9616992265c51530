#!/usr/bin/env bash
# Create or refresh .venv (Python 3.11) with the pinned environment in requirements/lock.txt.
# Cheap when nothing changed: a stamp of the lock file and pyproject.toml decides.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPARKTORCH_VENV:-$root/.venv}"
python="${PYTHON:-python3.11}"
stamp="$venv/.sparktorch-stamp"
want="$(cat "$root/requirements/lock.txt" "$root/requirements/no-deps.txt" "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)"

quiet_pip() {
  # pip.conf on some machines names local indexes that may be absent; those warnings are noise.
  "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "setting up $venv (pinned: requirements/lock.txt)..."
  quiet_pip install -q --upgrade pip
  # Installed without byte-compiling: compileall below does it on every core (pip uses one).
  quiet_pip install -q --no-compile -r "$root/requirements/lock.txt"
  quiet_pip install -q --no-compile --no-deps -r "$root/requirements/no-deps.txt"
  # Repair pyspark if an earlier environment let pyspark-client overwrite its files.
  if ! "$venv/bin/python" -c 'import sys, pyspark.version as v; sys.exit(v.__version__ != "4.3.0")'; then
    quiet_pip uninstall -q -y pyspark-client
    quiet_pip install -q --force-reinstall --no-deps pyspark==4.3.0
  fi
  quiet_pip install -q --no-deps -e "$root"
  # Some packages ship files for other Python versions that do not compile (pip skips them
  # too): compileall then exits 1, and the rest is compiled all the same.
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  "$venv/bin/python" -m compileall -q -q -j 0 "$site" || true
  echo "$want" > "$stamp"
fi

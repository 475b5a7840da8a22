#!/usr/bin/env bash
# The test command of the README: sets up everything, then runs the whole suite.
#   - a virtual environment in .venv with torch 2.13.0 (CPU build) and clusterflow[cpu,test]
#   - Debian's chromium and chromium-driver (the dashboard's browser tests)
#   - Slurm and munge from Debian, and the local three-node cluster (tests/slurm/cluster.sh)
#   - pytest over tests/
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Debian's chromium and its driver (the dashboard's browser tests drive them with Selenium, which
# then never downloads a browser of its own), and Slurm with the local cluster: they come up in
# the background while pip installs (minutes each on a fresh machine), one apt after the other
# (dpkg takes one at a time). What they print is shown, and a failure ends this run, before the
# tests start.
system() {
  if ! { command -v chromium && command -v chromedriver; } >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
    else
      echo "note: not root: install chromium and chromium-driver for the dashboard's browser tests" >&2
    fi
  fi
  if [ "$(id -u)" = 0 ] && [ "${CLUSTERFLOW_NO_SLURM:-0}" != 1 ]; then
    bash tests/slurm/cluster.sh up
  else
    echo "note: not root (or CLUSTERFLOW_NO_SLURM=1): the Slurm tests will be skipped" >&2
  fi
}
SYSTEM_LOG=$(mktemp)
trap 'rm -f "$SYSTEM_LOG"' EXIT
system >"$SYSTEM_LOG" 2>&1 &
SYSTEM_PID=$!
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# torch first: a plain `torch` requirement would otherwise pull the multi-GB CUDA build.
python -c 'import torch' 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[cpu,test]'
# The editable install leaves clusterflow's own modules uncompiled, and where PYTHONDONTWRITEBYTECODE
# is set no process writes their bytecode: every rank, launcher and command of the suite would
# compile them again (0.4 s of CPU each).
python -m compileall -q -j 0 clusterflow tests benchmarks examples >/dev/null
if ! wait "$SYSTEM_PID"; then
  cat "$SYSTEM_LOG" >&2
  echo "tests/run.sh: setting up chromium or the Slurm cluster failed (above)" >&2
  exit 1
fi
cat "$SYSTEM_LOG"
rm -f "$SYSTEM_LOG"
# In parallel: most tests wait (Slurm's queue, process start-up, sleeps), so more workers than
# cores pay; tests/conftest.py groups what must run in one worker (the Slurm cluster's tests, a
# shared run's readers). CLUSTERFLOW_TEST_WORKERS=0 runs everything in this one process.
WORKERS=${CLUSTERFLOW_TEST_WORKERS:-4}
if [ "$WORKERS" = 0 ]; then
  exec python -m pytest -q -rs "$@"
fi
exec python -m pytest -q -rs -n "$WORKERS" --dist loadgroup --no-loadscope-reorder "$@"

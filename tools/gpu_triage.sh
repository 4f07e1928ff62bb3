#!/usr/bin/env bash
# Triage on a lent GPU machine when `make gpu-check` shows crashes: builds .gpu-venv (the
# check's build stage), then runs each named pytest node in its own process (a segfault loses
# one node, not the file), re-running a crashed node under gdb for the native backtrace.
# Usage (device tool): tools/gpu_triage.sh NODE... (a NODE "cmd:SHELL" runs SHELL instead,
# with $PY the test Python: a server started by hand shows what it printed before dying); results in $OUT/triage.tar.gz and a
# one-line verdict per node on stdout. TRIAGE_BUDGET_S bounds the whole run (default 330).
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-/tmp/triage-out}
LOGS=$(mktemp -d)
BUDGET=${TRIAGE_BUDGET_S:-330}
NODE_S=${TRIAGE_NODE_S:-60}  # one node's limit
START=$SECONDS
pack() { tar czf "$OUT_DIR/triage.tar.gz" -C "$LOGS" . ; }
trap pack EXIT
left() { echo $((BUDGET - (SECONDS - START))); }

[ -n "${TRIAGE_PY:-}" ] || python3 tools/gpu_check.py --only build --out "$LOGS/gpu" >"$LOGS/build.txt" 2>&1
tail -3 "$LOGS/build.txt"
PY=${TRIAGE_PY:-.gpu-venv/bin/python}
[ -x "$PY" ] || { echo "no .gpu-venv: build failed"; exit 1; }
GDB=$(command -v gdb || command -v cuda-gdb || true)
echo "debugger: ${GDB:-none}"
export MOECOMM_REQUIRE_GPU=1 PYTHONFAULTHANDLER=1

i=0
for node in "$@"; do
  i=$((i + 1))
  t=$(left)
  if [ "$t" -lt 15 ]; then echo "[$i] NOT RUN (budget): $node"; continue; fi
  per=$(( t < NODE_S + 5 ? t - 5 : NODE_S ))
  log="$LOGS/$(printf %02d $i).txt"
  if [ "${node#cmd:}" != "$node" ]; then
    echo "\$ ${node#cmd:}" >"$log"
    PY=$PY timeout -k 5 "$per" bash -c "${node#cmd:}" >>"$log" 2>&1
    rc=$?
    echo "[$i] rc=$rc :: ${node#cmd:}"; tail -15 "$log" | sed 's/^/    /'
    continue
  fi
  echo "\$ pytest $node" >"$log"
  timeout -k 5 "$per" "$PY" -m pytest -p no:cacheprovider -q -rA --tb=long -m gpu \
    --timeout=$((per - 5)) "$node" >>"$log" 2>&1
  rc=$?
  verdict=$(grep -E "^[0-9]+ (passed|failed)|[0-9]+ (passed|failed|skipped|error)" "$log" | tail -1)
  if [ $rc -ge 128 ] || [ $rc -eq 124 ] || grep -q "Fatal Python error" "$log"; then
    verdict="CRASH rc=$rc $(grep -m1 'Fatal Python error' "$log")"
    if [ -n "$GDB" ] && [ "$(left)" -gt 40 ]; then
      timeout -k 5 60 "$GDB" -batch -ex "set pagination off" -ex run -ex "bt 40" \
        --args "$PY" -m pytest -p no:cacheprovider -q -x --tb=short -m gpu -p no:faulthandler \
        "$node" >"$log.gdb" 2>&1
    fi
  fi
  echo "[$i] rc=$rc ${verdict:-no summary} :: $node"
  grep -E "^(E  |FAILED|ERROR)" "$log" | head -6 | cut -c1-300 | sed 's/^/    /'
  [ -f "$log.gdb" ] && grep -E "^#[0-9]+ " "$log.gdb" | head -12 | cut -c1-200 | sed 's/^/    /' 
done

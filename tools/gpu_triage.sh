#!/usr/bin/env bash
# Triage on a lent GPU machine when `make gpu-check` shows crashes: builds .gpu-venv (the
# check's build stage), then runs each named pytest node in its own process (a segfault loses
# one node, not the file), re-running a crashed node under gdb for the native backtrace.
# Usage (device tool): tools/gpu_triage.sh NODE... (a NODE "cmd:SHELL" runs SHELL instead,
# with $PY the test Python: a server started by hand shows what it printed before dying).
# Results in $OUT/triage.tar.gz (per node NN.txt, its output; NN.xml, its junit; NN.txt.gdb)
# and on stdout one verdict line per node, then one line per test from its junit.
# TRIAGE_BUDGET_S bounds the whole run (default 330), TRIAGE_NODE_S one node (default 60).
# TRIAGE_PY names a test Python that exists already (no build).
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-/tmp/triage-out}
mkdir -p "$OUT_DIR"
LOGS=$(mktemp -d)
BUDGET=${TRIAGE_BUDGET_S:-330}
NODE_S=${TRIAGE_NODE_S:-60}  # one node's limit
# pytest-timeout per test is this share of the node's limit (and at least TEST_MIN_S): a hung
# test then fails inside pytest, which still writes its junit and -rA text, instead of the
# whole node being killed by `timeout` with everything it had to say.
TEST_SHARE_PCT=60
TEST_MIN_S=5
START=$SECONDS
pack() { tar czf "$OUT_DIR/triage.tar.gz" -C "$LOGS" . ; rm -rf "$LOGS"; }
trap pack EXIT
left() { echo $((BUDGET - (SECONDS - START))); }
signame() {  # "SIGSEGV" for an exit status of 128+11 (what bash and timeout report)
  [ "$1" -gt 128 ] && [ "$1" -lt 160 ] && echo " (SIG$(kill -l $(($1 - 128)) 2>/dev/null))"
}

# One line per test case of a junit file: VERDICT classname::name: message.
junit_verdicts() {
  "$PY" - "$1" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    name = f"{case.get('classname', '')}::{case.get('name', '')}"
    verdict, why = "PASSED", ""
    for tag in ("failure", "error", "skipped"):
        el = case.find(tag)
        if el is not None:
            verdict = {"failure": "FAILED", "error": "ERROR", "skipped": "SKIPPED"}[tag]
            why = " ".join((el.get("message") or el.text or "").split())[:240]
            break
    print(f"    {verdict} {name}" + (f": {why}" if why else ""))
PYEOF
}

if [ -z "${TRIAGE_PY:-}" ]; then
  python3 tools/gpu_check.py --only build --out "$LOGS/gpu" >"$LOGS/build.txt" 2>&1
  tail -3 "$LOGS/build.txt"
fi
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
  xml="$LOGS/$(printf %02d $i).xml"
  if [ "${node#cmd:}" != "$node" ]; then
    echo "\$ ${node#cmd:}" >"$log"
    PY=$PY timeout -k 5 "$per" bash -c "${node#cmd:}" >>"$log" 2>&1
    rc=$?
    verdict="rc=$rc"
    [ $rc -eq 124 ] && verdict="TIMEOUT after ${per} s"
    [ $rc -gt 128 ] && verdict="CRASH rc=$rc$(signame $rc)"
    echo "[$i] $verdict :: ${node#cmd:}"; tail -15 "$log" | sed 's/^/    /'
    continue
  fi
  per_test=$(( per * TEST_SHARE_PCT / 100 ))
  [ "$per_test" -lt "$TEST_MIN_S" ] && per_test=$TEST_MIN_S
  echo "\$ pytest $node (node limit $per s, per test $per_test s)" >"$log"
  timeout -k 5 "$per" "$PY" -m pytest -p no:cacheprovider -v -rA --tb=long -m gpu \
    --timeout="$per_test" --junitxml="$xml" "$node" >>"$log" 2>&1
  rc=$?
  verdict=$(grep -E "^[0-9]+ (passed|failed)|[0-9]+ (passed|failed|skipped|error)" "$log" | tail -1)
  if [ $rc -ge 128 ] || [ $rc -eq 124 ] || grep -q "Fatal Python error" "$log"; then
    verdict="CRASH rc=$rc$(signame $rc) $(grep -m1 'Fatal Python error' "$log")"
    [ $rc -eq 124 ] && verdict="TIMEOUT: killed at the node's $per s"
    if [ -n "$GDB" ] && [ "$(left)" -gt 40 ]; then
      timeout -k 5 60 "$GDB" -batch -ex "set pagination off" -ex run -ex "bt 40" \
        --args "$PY" -m pytest -p no:cacheprovider -q -x --tb=short -m gpu -p no:faulthandler \
        "$node" >"$log.gdb" 2>&1
    fi
  fi
  echo "[$i] rc=$rc ${verdict:-no summary} :: $node"
  if [ -s "$xml" ]; then
    junit_verdicts "$xml" || echo "    (junit unreadable)"
  else
    # The -v lines still say which tests finished, and the last one named is the one it died in.
    grep -E "::\S+ (PASSED|FAILED|SKIPPED|ERROR)" "$log" | sed 's/^/    /'
    echo "    no junit: the process died; it was in: $(grep -oE '^\S+::\S+' "$log" | tail -1)"
  fi
  grep -E "^(E  |FAILED|ERROR)" "$log" | head -6 | cut -c1-300 | sed 's/^/    /'
  [ -f "$log.gdb" ] && grep -E "^#[0-9]+ " "$log.gdb" | head -12 | cut -c1-200 | sed 's/^/    /'
done
exit 0

#!/usr/bin/env bash
# The engine environment for tests/engines/: vLLM and SGLang, for their Python only, with the
# pure-Python (and CPU-wheel) modules their MoE dispatch code imports, pinned in
# tests/engines/requirements.txt. Every package is installed with --no-deps into its own folder
# (.venv/engines/site by default, MOECOMM_ENGINES_DIR to move it), never into the main venv: the
# tests' rank processes append that folder to sys.path after the venv's site-packages, so torch
# stays the venv's CPU wheel (pip cannot replace it from here) and the main suite never sees it.
#
# Idempotent: a stamp records the requirements' hash and the Python version; when both match it
# only says so. Otherwise it installs into a fresh folder and swaps it in (an interrupted run
# leaves the previous environment, or none, never half of one), then prints size and time.
#   tools/engines_env.sh           create or update
#   tools/engines_env.sh --check   exit 0 when current, 1 when absent or stale (installs nothing)
#   tools/engines_env.sh --force   reinstall even when current
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
DIR=${MOECOMM_ENGINES_DIR:-.venv/engines}
REQ=tests/engines/requirements.txt
# The opt-in alias (`import deep_ep` / `import nixl_ep` answered by moecomm), installed with the
# engines as a user installs it; its files are part of the stamp, so an edit reinstalls.
ALIAS=engines/alias
ALIAS_FILES=("$ALIAS/moecomm_engine_alias.py" "$ALIAS/moecomm_engine_alias.pth")
# Modules the main venv must keep providing: finding one in the engine folder means a pin pulled
# it in, and it would be shadowed by the venv's anyway (the folder comes last on sys.path).
GUARDED=(torch numpy transformers tokenizers pydantic triton)

stamp_text() {
    printf '%s\n%s\n' "$(cat "$REQ" "${ALIAS_FILES[@]}" | sha256sum | cut -d' ' -f1)" \
        "$("$PY" -c 'import sys; print("python%d.%d" % sys.version_info[:2])')"
}

want=$(stamp_text)
if [[ -f $DIR/.stamp && -d $DIR/site && "$(cat "$DIR/.stamp")" == "$want" ]]; then
    if [[ ${1:-} != --force ]]; then
        [[ ${1:-} == --check ]] || echo "engine environment up to date: $DIR ($(du -sh "$DIR/site" | cut -f1))"
        exit 0
    fi
fi
if [[ ${1:-} == --check ]]; then
    echo "engine environment absent or stale: $DIR (run tools/engines_env.sh)" >&2
    exit 1
fi

start=$(date +%s)
mkdir -p "$DIR"
rm -rf "$DIR/site.new"
# --no-compile: the tests import a few hundred of the engines' ~10^4 modules; Python writes their
# bytecode at first import, so compiling everything here would only cost time and disk.
"$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile \
    --target "$DIR/site.new" -r "$REQ"
"$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile \
    --target "$DIR/site.new" "./$ALIAS"
for mod in "${GUARDED[@]}"; do
    if [[ -e $DIR/site.new/$mod ]]; then
        echo "engines_env: $mod was installed into the engine folder; it must come from .venv" >&2
        exit 1
    fi
done
rm -rf "$DIR/site" "$DIR/.stamp"
mv "$DIR/site.new" "$DIR/site"
echo "$want" >"$DIR/.stamp"
echo "engine environment installed: $DIR/site, $(du -sh "$DIR/site" | cut -f1)," \
    "$(($(date +%s) - start)) s"

#!/usr/bin/env bash
# Downloads into .gpu-wheels/ (git-ignored) the wheels moecomm's tests need that the GPU image
# ('cuda': Python 3.12, CUDA torch, Triton, nvcc 13, no network) may lack, for cp312
# manylinux x86_64, so that `make gpu-check` there installs them with
# `pip install --no-index --find-links .gpu-wheels ...` (the build stage of the GPU check,
# tools/gpu_check_stages.py, does; its preflight checks each is in the image or carried here).
# torch, triton, numpy and NVSHMEM are NOT fetched: the image has them, and the build must use
# its CUDA torch. docs/gpu-check.md lists every wheel and why.
#
# Usage: tools/fetch_gpu_wheels.sh [DEST] (default .gpu-wheels); PYTHON=... picks the pip.
# The device tool carries at most 64 MiB of ignored paths: the script fails when the folder is
# larger than that.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu-wheels}
if [[ -z "${PYTHON:-}" ]]; then
	if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
LIMIT_MIB=${GPU_WHEELS_LIMIT_MIB:-60}

# The requirements, one place: the GPU check's build stage installs exactly this list there.
mapfile -t REQS < <(grep -vE '^\s*(#|$)' tools/gpu-requirements.txt)

PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3
	--abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
	--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
	--platform manylinux_2_24_x86_64 --platform any)

rm -rf "$DEST"
mkdir -p "$DEST"
# With their dependencies (none of these pulls torch), resolved for the target Python.
# (A pip configuration may name local indexes that do not exist here: pip warns and goes on.)
"$PYTHON" -m pip download -q --disable-pip-version-check "${PLATFORM[@]}" -d "$DEST" "${REQS[@]}" \
	2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

size_kib=$(du -sk "$DEST" | cut -f1)
echo "fetched $(ls "$DEST" | wc -l) wheels into $DEST: $((size_kib / 1024)) MiB"
ls -1 "$DEST"
if ((size_kib > LIMIT_MIB * 1024)); then
	echo "error: $DEST is over ${LIMIT_MIB} MiB; the device tool carries at most 64 MiB" >&2
	exit 1
fi

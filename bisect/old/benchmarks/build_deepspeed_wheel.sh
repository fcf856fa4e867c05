#!/usr/bin/env bash
# Build .dssite/: DeepSpeed as a pure-Python wheel (DS_BUILD_OPS=0: no op prebuilt; CPUAdam JIT-builds on the GPU
# machine, which has nvcc and ninja) plus the pure-Python/cp312 packages it needs that the GPU image lacks
# (hjson, pydantic and its helpers), unpacked so the folder travels with the tree (about 15 MiB).
#
#   bash benchmarks/build_deepspeed_wheel.sh        # from the repo root, in the project venv (needs torch to build)
#   then carry .dssite/ (with .devsite/ and .data/) and put it on PYTHONPATH there (benchmarks/gpu_session.sh does).
#
# DeepSpeed is published on the package index as a source distribution only; `pip wheel` builds it here with the
# venv's torch (--no-build-isolation: an isolated build would download a second torch). The GPU image already has
# einops, msgpack, ninja, numpy, packaging, psutil, py-cpuinfo, tqdm, typing-extensions (KINDS.md package list).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
ds_version=${DEEPSPEED_VERSION:-0.19.8}
deps=${DEEPSPEED_EXTRA_DEPS:-"hjson pydantic pydantic-core annotated-types typing-inspection"}
grep -qx '/.dssite/' .git/info/exclude 2>/dev/null || echo '/.dssite/' >> .git/info/exclude
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation --no-binary :all: -w "$tmp/ds" \
  "deepspeed==$ds_version"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$tmp/deps" $deps
rm -rf .dssite && mkdir .dssite
for w in "$tmp"/ds/*.whl "$tmp"/deps/*.whl; do python3 -m zipfile -e "$w" .dssite/; done
# pydantic and pydantic-core must match exactly: check the pin against what was downloaded.
want=$(grep -h '^Requires-Dist: pydantic-core==' .dssite/pydantic-*.dist-info/METADATA | sed 's/.*==//')
have=$(sed -n 's/^Version: //p' .dssite/pydantic_core-*.dist-info/METADATA)
[ "$want" = "$have" ] || { echo "pydantic wants pydantic-core $want, got $have: set DEEPSPEED_EXTRA_DEPS" >&2; exit 1; }
find .dssite -name '__pycache__' -prune -exec rm -rf {} +
du -sh .dssite
echo "carry .dssite/; on the GPU machine: export PYTHONPATH=\$PWD/.dssite:\$PWD/.devsite:\$PWD\${PYTHONPATH:+:\$PYTHONPATH}"

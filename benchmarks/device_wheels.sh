#!/usr/bin/env bash
# Wheels that the lent GPU machine's image lacks, for benchmarks/accelerator_check.py (docs/accelerator.md).
#
#   benchmarks/device_wheels.sh [DIR]          # default DIR: .whl (git-ignored); WITH_TOKAMAX=0: pydantic only
#
# Downloads (no install) manylinux x86_64 / CPython 3.12 wheels, one version each, --no-deps so that
# nothing the image already has (jax, flax, optax, torch, transformers, absl, jaxtyping, tqdm) is
# shadowed: pydantic with the pydantic-core it pins, annotated-types, typing-inspection and
# typing-extensions (pydantic wants a newer one than the image may have) for jaxpe.model; tokamax
# 0.0.12 with what the image lacks of its needs (einshape, qwix, typeguard 2.13.3, immutabledict,
# tensorboardX). About 4 MiB in all. On the device machine, in a `run`
# with carry [".whl"]:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
for p in "${platforms[@]}"; do args+=(--platform "$p"); done
download() { python3 -m pip download -q "${args[@]}" -d "$dest" "$@"; }

mkdir -p "$dest"
rm -f "$dest"/*.whl  # one version of each: two stop the install there
download pydantic annotated-types typing-inspection typing-extensions  # pydantic wants a recent typing-extensions
core=$(unzip -p "$dest"/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
[ -n "$core" ] || { echo "no pydantic-core pin in the pydantic wheel" >&2; exit 1; }
download "pydantic-core==$core"
if [ "${WITH_TOKAMAX:-1}" = 1 ]; then
  # 0.0.12: the version jaxpe's tokamax backend is tested with; later ones import xprof (21 MiB more)
  download "tokamax==${TOKAMAX_VERSION:-0.0.12}" einshape qwix "typeguard==2.13.3" immutabledict tensorboardx
fi
ls "$dest"
du -sh "$dest"

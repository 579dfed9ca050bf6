#!/usr/bin/env bash
# The console scripts and the optional imports in a virtual environment with only the core install
# (jax, numpy; no system site packages): each must name the extra to install, in one line, not
# fail with a bare "No module named ...". tests/extras_test.py checks the same in-process by
# blocking the modules; this is the real install (about 30 s from a local package index).
# Usage: .ci/core_install_check.sh [VENV_DIR]   (default: a temporary directory, removed after)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$(mktemp -d)/core}
python -m venv "$venv"
"$venv/bin/pip" install -q jax jaxlib numpy
"$venv/bin/pip" install -q --no-deps -e "$root"
cd "$(dirname "$venv")"  # not the checkout: the installed package is what runs
status=0
for script in $(python -c "import tomllib; print(*tomllib.load(open('$root/pyproject.toml', 'rb'))['project']['scripts'])"); do
  [ -x "$venv/bin/$script" ] || { echo "FAIL: $script not installed"; status=1; continue; }
  set +e; err=$("$venv/bin/$script" --help 2>&1 >/dev/null); rc=$?; set -e
  if [ "$rc" = 2 ] && [[ "$err" == *'pip install "jaxpe[train]"'* ]] && [ "$(wc -l <<<"$err")" = 1 ]; then
    echo "ok: $script: $err"
  else
    echo "FAIL: $script (exit $rc): $err"; status=1
  fi
done
for module in jaxpe.model jaxpe.train.trainer jaxpe.bloom jaxpe.study; do
  set +e; err=$("$venv/bin/python" -c "import $module" 2>&1 | tail -1); set -e
  if [[ "$err" == *MissingExtraError*'pip install "jaxpe['* ]]; then echo "ok: import $module: $err"
  else echo "FAIL: import $module: $err"; status=1; fi
done
"$venv/bin/python" -c "import jaxpe; jaxpe.apply_rope" && echo "ok: import jaxpe (core)" || status=1
[ -n "${1:-}" ] || rm -rf "$(dirname "$venv")"
exit $status

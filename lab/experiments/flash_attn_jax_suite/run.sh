#!/usr/bin/env bash
# nshepperd/flash_attn_jax's tests against flashjax through the shim beside this script (README.md here).
#   lab/experiments/flash_attn_jax_suite/run.sh CHECKOUT [pytest args]
# CHECKOUT: a clone of github.com/nshepperd/flash_attn_jax (a work tree, or a bare git directory: HEAD's tests).
# Their tests are copied into a temporary directory and never into this repository. Needs einops (their tests import
# it); PYTHON picks the interpreter (default .venv/bin/python), PYTHONPATH is kept (e.g. where einops is installed).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
src=${1:?usage: run.sh FLASH_ATTN_JAX_CHECKOUT [pytest args]}
shift
python=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [[ -d $src/tests ]]; then
  cp -r "$src/tests" "$work/tests"
else
  git --git-dir="$src" archive HEAD tests | tar -x -C "$work"
fi
export PYTHONPATH="$here:$root/python${PYTHONPATH:+:$PYTHONPATH}"
"$python" -c "import einops" 2>/dev/null || { echo "their tests need einops: $python -m pip install einops" >&2; exit 2; }
# From $work, which has no ./src: their tests' sys.path.insert(0, './src') then finds nothing and `import
# flash_attn_jax` gets the shim. test_ring.py tests their ring attention (flashjax has none: issue 40) and
# test_sharding.py their HLO under a multi-GPU mesh; the three files below are the attention tests.
cd "$work"
"$python" -m pytest -q -p no:cacheprovider tests/test_flash.py tests/test_cross.py tests/test_varlen.py "$@"

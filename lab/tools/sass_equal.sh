#!/usr/bin/env bash
# Do two source trees compile every generated kernel file to the same SASS? For changes that must not touch device
# code (refactors of the host side, comments, moved headers): each csrc/kernels/generated/*.cu of both trees is
# compiled to a cubin for each arch the release runs it on (sm90_*: sm_90a; sm80_*: sm_80 and sm_90a, where Hopper
# runs the portable family) with the library's device flags, disassembled with cuobjdump, and compared function by
# function (addresses and the cubin's name stripped).
#   lab/tools/sass_equal.sh BASE_TREE [NEW_TREE] [JOBS]       (NEW_TREE defaults to this checkout)
# Needs nvcc and the venv's CUTLASS; installs PyPI's cuobjdump into .venv when missing (as sass.sh does). Prints one
# line per file ("same" / "DIFFERENT: N functions differ") and exits 1 when any differs. Device code only: host code
# is not compiled, so it takes about half the time of a build.
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=$(cd "$1" && pwd)
NEW=$(cd "${2:-.}" && pwd)
JOBS=${3:-$(nproc)}
python=.venv/bin/python
bin=$("$python" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13", "bin"))' 2>/dev/null || true)
if [ -z "$bin" ] || [ ! -x "$bin/cuobjdump" ] || [ ! -x "$bin/nvdisasm" ]; then
  "$python" -m pip install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
  bin=$("$python" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13", "bin"))')
fi
CUTLASS=$("$python" -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))')
WORK=$(mktemp -d)
NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}

compile() {  # tree tag file arch
  local tree=$1 tag=$2 file=$3 arch=$4 stem
  stem=$(basename "$file" .cu)
  tag=$tag.$arch
  "$NVCC" -cubin -arch="$arch" -O3 -DNDEBUG -std=c++17 --expt-relaxed-constexpr -lineinfo \
    -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -I"$tree/csrc" -I"$tree/csrc/include" -isystem "$CUTLASS" \
    -o "$WORK/$tag.$stem.cubin" "$tree/csrc/kernels/generated/$stem.cu"
  PATH="$bin:$PATH" "$bin/cuobjdump" -sass "$WORK/$tag.$stem.cubin" |
    sed -E 's#/\*[0-9a-f]{4,}\*/##; s#[[:space:]]+$##' | grep -v -E '^[[:space:]]*$|Fatbin|code for sm|File ' \
    > "$WORK/$tag.$stem.sass"
}
export -f compile
export WORK NVCC CUTLASS bin

units=()
for f in $(cd "$NEW/csrc/kernels/generated" && ls *.cu); do
  units+=("$f sm_90a")
  [[ $f == sm80_* ]] && units+=("$f sm_80")
done
# The heavy sm90 files first, so that the parallel jobs end together.
for unit in "${units[@]}"; do
  echo "$BASE base $unit"
  echo "$NEW new $unit"
done | sort -k3,3r | xargs -P "$JOBS" -L 1 bash -c 'compile "$0" "$1" "$2" "$3"'

status=0
for unit in "${units[@]}"; do
  read -r f arch <<< "$unit"
  stem=${f%.cu}.$arch
  if cmp -s "$WORK/base.$arch.${f%.cu}.sass" "$WORK/new.$arch.${f%.cu}.sass"; then
    echo "$stem: same ($(grep -c 'Function :' "$WORK/new.$arch.${f%.cu}.sass") functions)"
  else
    status=1
    differ=$("$python" - "$WORK/base.$arch.${f%.cu}.sass" "$WORK/new.$arch.${f%.cu}.sass" <<'EOF'
import sys
def functions(path):
    out, name = {}, None
    for line in open(path):
        if "Function :" in line:
            name = line.split("Function :")[1].strip()
            out[name] = []
        elif name:
            out[name].append(line)
    return out
a, b = functions(sys.argv[1]), functions(sys.argv[2])
print(sum(1 for n in set(a) | set(b) if a.get(n) != b.get(n)))
EOF
)
    echo "$stem: DIFFERENT: $differ functions differ"
  fi
done
rm -rf "$WORK"
exit $status

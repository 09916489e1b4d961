#!/usr/bin/env bash
# SASS of one sm90 forward instantiation without a GPU, and where each steady step waits for its GEMMs.
#   lab/tools/sass.sh [bf16|fp16] [head_dim]          (default bf16 128) -> build/sass/sm90_fwd_<dtype>_hdim<D>.sass
# The CUDA toolkit on the build machine has no cuobjdump; PyPI's nvidia-cuda-cuobjdump wheel does (installed into
# .venv on first use). After the SASS, lab/tools/sass_waits.py prints, for every kernel, the instruction stream from
# each S wait (WARPGROUP.DEPBAR.LE gsb0, 0x1) to the next ping-pong turn, compressed to op runs, with the PV wait
# (gsb0, 0x0) and the branches marked: whether the softmax (MUFU) runs before or after the PV wait is visible there.
# It is a static view in address order: predicated branches (the softcap path, the masked path) put other copies
# of the softmax in between; ncu's source page (tools/device_check.sh ncu) gives execution counts per line.
# The compile command is the library build's own, taken from ninja (BUILD: the build directory, default the last one
# tools/build.sh made, build/last), so that the SASS is the shipped one: a hand-kept copy of the flags without
# -DNDEBUG gave a D 128 hot loop 707 instructions long, scheduled differently from the library's 699 (lab/log/v22.md).
# Without a build, the flags below are CMake Release's as of v22, and the script says it used them.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dtype=${1:-bf16}; hdim=${2:-128}
case "$dtype" in bf16|fp16) ;; *) echo "dtype must be bf16 or fp16" >&2; exit 2 ;; esac
"$repo/tools/env.sh"
python="$repo/.venv/bin/python"
# cuobjdump runs nvdisasm, a wheel of its own; both land in .venv's nvidia/cu13/bin.
bin=$("$python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "bin"))' 2>/dev/null || true)
if [ ! -x "$bin/cuobjdump" ] || [ ! -x "$bin/nvdisasm" ]; then
  "$python" -m pip install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
  bin=$("$python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "bin"))')
fi
export PATH="$bin:$PATH"
cuobjdump="$bin/cuobjdump"
cutlass_include=$("$python" -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))')
out="$repo/build/sass"; mkdir -p "$out"
name="sm90_fwd_${dtype}_hdim${hdim}"
"$python" "$repo/tools/gen_kernels.py" --print sm90 fwd "$dtype" "$hdim" > "$out/$name.cu"
build=${BUILD:-$(cat "$repo/build/last" 2>/dev/null || true)}
compile=""
if [ -n "$build" ] && [ -f "$build/build.ninja" ]; then
  source "$repo/lab/tools/build_commands.sh"
  compile=$(stem_compile_command "$build" "$name")
  [[ $compile == *sm_90a* ]] || compile=""  # a build without the sm90a device pass has no such kernel to show
fi
if [ -n "$compile" ]; then
  # The build's command on this script's source, its object written here.
  compile=$(sed -E "s# -c [^ ]+\.cu -o [^ ]+\$# -Xptxas -v -c $out/$name.cu -o $out/$name.o#" <<< "$compile")
  (cd "$build" && eval "$compile") 2>&1 | grep -E "C75[0-9]+|spill" || true
  "$cuobjdump" -sass -arch sm_90a "$out/$name.o" > "$out/$name.sass"
else
  echo "sass.sh: no build has $name.cu (BUILD=${build:-unset}); compiling with the flags restated here" >&2
  "${NVCC:-/usr/local/cuda/bin/nvcc}" -std=c++17 --expt-relaxed-constexpr -O3 -DNDEBUG -lineinfo \
    -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -I"$repo/csrc" -I"$repo/csrc/include" -isystem "$cutlass_include" \
    -gencode=arch=compute_90a,code=sm_90a -cubin -Xptxas -v -o "$out/$name.cubin" "$out/$name.cu" 2>&1 |
    grep -E "C75[0-9]+|spill" || true
  "$cuobjdump" -sass -arch sm_90a "$out/$name.cubin" > "$out/$name.sass"
fi
echo "SASS: $out/$name.sass"
"$python" "$repo/lab/tools/sass_waits.py" "$out/$name.sass"

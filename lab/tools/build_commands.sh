# Sourced by lab/tools/sass.sh and lab/tools/codegen_variant.sh: the commands of a CMake/ninja build of flashjax.
#   stem_compile_command BUILD STEM   the nvcc command that compiles csrc/kernels/generated/STEM.cu in BUILD, with its
#                                     dependency-file options (-MD -MT -MF) dropped; empty where BUILD has none
stem_compile_command() {
  ninja -C "$1" -t commands flashjax 2>/dev/null | { grep -F "generated/$2.cu -o " || true; } | head -1 |
    sed -E 's# -MD -MT [^ ]+ -MF [^ ]+##'
}

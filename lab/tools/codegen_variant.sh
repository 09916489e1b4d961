#!/usr/bin/env bash
# A codegen variant of one kernel file: recompiles one generated kernel source of an existing build with extra nvcc
# flags (or with a macro that a source perturbation tests for) and links a copy of the library with that object,
# leaving the build itself untouched. For A/B of what the compiler does with the same source (lab/log/v22.md:
# a never-taken branch at kernel entry moved the D 128 kernel's cycles by +2-3% through the hot loop's registers).
#   lab/tools/codegen_variant.sh NAME "EXTRA NVCC FLAGS" [STEM]
#     STEM: the generated file, default sm90_fwd_bf16_hdim128; BUILD: the build directory, default the last one
#     tools/build.sh made (build/last). Writes .devcarry/variants/NAME.so.xz (lab/tools/ab_device.sh's VARIANTS).
#   e.g. lab/tools/codegen_variant.sh lvl10 "--ptxas-options=-regUsageLevel=10"
set -euo pipefail
cd "$(dirname "$0")/../.."
name=$1 flags=$2 stem=${3:-sm90_fwd_bf16_hdim128}
build=${BUILD:-$(cat build/last)}
source lab/tools/build_commands.sh
work=$(mktemp -d)
compile=$(stem_compile_command "$build" "$stem")
link=$(ninja -C "$build" -t commands flashjax | grep -F -- "-o libflashjax.so " | tail -1)
[[ -n $compile && -n $link ]] || { echo "codegen_variant: no compile command for $stem or no link command in $build" >&2; exit 1; }
object=$(sed -E 's/.* -o ([^ ]+)$/\1/' <<< "$compile")
# The same command with the extra flags and its object written elsewhere.
compile=$(sed -E "s# -o [^ ]+\$# $flags -o $work/$stem.o#" <<< "$compile")
link=${link//" $object "/" $work/$stem.o "}
link=${link//"-o libflashjax.so "/"-o $work/libflashjax.so "}
(cd "$build" && eval "$compile" && eval "$link")
mkdir -p .devcarry/variants
xz -T0 -c "$work/libflashjax.so" > ".devcarry/variants/$name.so.xz"
rm -rf "$work"
echo "codegen_variant: .devcarry/variants/$name.so.xz ($stem with: $flags; build $build)"

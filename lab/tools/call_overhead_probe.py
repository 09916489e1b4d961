"""What one jitted call runs besides the attention kernel (device diagnostic; lab/log/v15.md).

Prints the fusions, custom calls and constants of the optimized HLO of bench.py's forward call, for flashjax and for
cuDNN. Before v15 a flashjax call also ran a fill kernel for its unused sinks operand (a loop_broadcast_fusion ahead
of the custom call); this shows whether anything like that has come back.
Usage (on the GPU): python lab/tools/call_overhead_probe.py [row regex]
"""
import re
import sys

import jax

sys.path.insert(0, "bench")
import bench  # noqa: E402


def hlo_lines(fn, args):
    text = jax.jit(fn).lower(*args).compile().as_text()
    return [ln.strip()[:160] for ln in text.splitlines()
            if re.search(r"ENTRY|fusion\(|custom-call|constant\(|command_buffer|call\(", ln)]


def main():
    pattern = sys.argv[1] if len(sys.argv) > 1 else r"^d128-s4096-causal$"
    for row in bench.select_rows(bench.parse_args(["--rows", pattern])):
        args = bench.make_inputs(row, 1, 0)[0][:3]
        for impl in ("flashjax", "cudnn"):
            print(f"== {row.name}, {impl}: optimized HLO")
            print("\n".join(hlo_lines(bench.attention_fn(impl, row, "kernel"), args)))


if __name__ == "__main__":
    main()

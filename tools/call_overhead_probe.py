"""What one jitted flash_attn call runs besides the kernel, and what it costs (device diagnostic).

Prints the optimized HLO of the forward's executable (fusions, custom calls, constants), then times the call as the
library builds it against the same call with the sinks placeholder as a host constant, interleaved with cuDNN
(bench.py's trials). Usage: python tools/call_overhead_probe.py [row regex] [rounds]
"""
import re
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "bench")
import bench  # noqa: E402
import flashjax  # noqa: E402
from flashjax import api, primitives, _ffi  # noqa: E402


def kernel_attention_host_zeros(q, k, v, sinks, options):
    width = _ffi.padded_head_dim(max(q.shape[-1], v.shape[-1]))
    has_sinks = sinks is not None
    sinks_arr = sinks if has_sinks else np.zeros((q.shape[2],), np.float32)
    left, right = options.window
    out, lse = primitives.forward(api._pad_last(q, width), api._pad_last(k, width), api._pad_last(v, width),
                                  sinks_arr, softmax_scale=options.softmax_scale, softcap=options.softcap,
                                  window_left=left, window_right=right, has_sinks=has_sinks)
    return out[..., :v.shape[-1]], lse


def hlo_summary(fn, args):
    text = fn.lower(*args).compile().as_text()
    keep = [ln.strip()[:160] for ln in text.splitlines()
            if re.search(r"ENTRY|fusion\(|custom-call|constant\(|broadcast|command_buffer|call\(", ln)]
    return keep


def main():
    pattern = sys.argv[1] if len(sys.argv) > 1 else r"^d128-s4096-causal$"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    rows = [r for r in bench.grid_rows(16384, 2048, (64, 128, 256), (512, 1024, 4096)) if re.search(pattern, r.name)]
    bench.warm_up(2.0)
    for row in rows:
        sets = bench.make_inputs(row, 3, 0)
        calls = [s[:3] for s in sets]
        base = bench.attention_fn("flashjax", row, "kernel")
        f_lib = jax.jit(lambda q, k, v: base(q, k, v))
        f_cudnn = jax.jit(bench.attention_fn("cudnn", row, "kernel"))
        jax.block_until_ready(f_lib(*calls[0]))
        print(f"== {row.name}: optimized HLO of the library's call")
        print("\n".join(hlo_summary(f_lib, calls[0])))
        original = api._kernel_attention
        api._kernel_attention = kernel_attention_host_zeros
        try:
            f_host = jax.jit(lambda q, k, v: base(q, k, v))
            jax.block_until_ready(f_host(*calls[0]))
            print("== the same with a host-constant sinks placeholder")
            print("\n".join(hlo_summary(f_host, calls[0])))
        finally:
            api._kernel_attention = original
        diff = float(jnp.max(jnp.abs(f_lib(*calls[1]).astype(jnp.float32) - f_host(*calls[1]).astype(jnp.float32))))
        print(f"max |library - host-constant| = {diff}")
        fns = {"cudnn": f_cudnn, "library": f_lib, "host_zeros": f_host}
        reps = {n: bench.calibrate_reps(f, calls, 10) for n, f in fns.items()}
        for r in range(rounds):
            samples = {n: [] for n in fns}
            for _ in range(7):
                for n, f in fns.items():
                    samples[n].append(bench.trial_seconds(f, calls, reps[n]))
            tf = {n: row.flops("fwd") / statistics.median(t) / 1e12 for n, t in samples.items()}
            us = {n: statistics.median(t) * 1e6 for n, t in samples.items()}
            print(f"{row.name} round {r}: " + "  ".join(f"{n} {tf[n]:.1f} TF ({us[n]:.1f} us)" for n in fns)
                  + f"  host/library {tf['host_zeros'] / tf['library']:.4f}", flush=True)


if __name__ == "__main__":
    main()

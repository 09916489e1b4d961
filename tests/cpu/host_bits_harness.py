"""Runs the mask-bits kernel's CUDA source on the host: one std::thread per CUDA thread, a block's 128 at a time,
__ballot_sync emulated with a per-warp barrier, under AddressSanitizer and UndefinedBehaviorSanitizer. It checks the
kernel's own logic (the task walk of a capped grid, the word and row indexing, the bits past seqlen_k, the stores'
bounds) on a machine without a GPU; a ballot that some lane of a warp skips would hang, hence the timeout.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

from host_mask_harness import SANITIZERS, _array, _field_initializer, compiler  # noqa: F401 (compiler: re-export)

PRELUDE = r"""
#include <algorithm>
#include <barrier>
#include <cstdio>
#include <thread>
#include <vector>
struct FakeDim3 { unsigned x, y, z; };
static FakeDim3 gridDim, blockDim;
static thread_local FakeDim3 threadIdx, blockIdx;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __grid_constant__
using std::min;
struct FakeWarp {
  std::barrier<> arrived{32};
  bool votes[32];
};
static thread_local FakeWarp* this_warp;
static unsigned __ballot_sync(unsigned, bool predicate) {
  this_warp->votes[threadIdx.x % 32] = predicate;
  this_warp->arrived.arrive_and_wait();
  unsigned word = 0;
  for (int lane = 0; lane < 32; ++lane) word |= (this_warp->votes[lane] ? 1u : 0u) << lane;
  this_warp->arrived.arrive_and_wait();  // every lane has read the votes before any lane writes the next
  return word;
}
"""


def program_source(source: str, kernel_name: str, fields, sizes: tuple[int, int, int, int], blocks: int) -> str:
    batch, heads, seqlen_q, seqlen_k = sizes
    words = -(-seqlen_k // 32)
    count = batch * heads * seqlen_q * words
    lines = [PRELUDE, source]
    lines += [_array(f"field{j}", f) for j, f in enumerate(fields)]
    lines += [
        "int main() {",
        "  FlashjaxMaskFields f = {};",
        *(f"  f.field[{j}] = {_field_initializer(f'field{j}', np.asarray(v))};" for j, v in enumerate(fields)),
        # Guard words on both sides catch a store out of the bitmask's bounds.
        f"  std::vector<unsigned> bits({count} + 64, 0xDEADBEEFu);",
        f"  gridDim = {{{blocks}u, 1u, 1u}};",
        "  blockDim = {128u, 1u, 1u};",
        f"  for (unsigned block = 0; block < {blocks}u; ++block) {{",
        "    FakeWarp warps[4];",
        "    std::vector<std::thread> threads;",
        "    for (unsigned t = 0; t < 128; ++t) threads.emplace_back([&, t] {",
        "      threadIdx = {t, 0u, 0u};",
        "      blockIdx = {block, 0u, 0u};",
        "      this_warp = &warps[t / 32];",
        f"      {kernel_name}(f, {batch}, {heads}, {seqlen_q}, {seqlen_k}, bits.data() + 32);",
        "    });",
        "    for (auto& thread : threads) thread.join();",
        "  }",
        "  for (size_t i = 0; i < bits.size(); ++i) std::printf(\"%u\\n\", bits[i]);",
        "  return 0;",
        "}",
    ]
    return "\n".join(lines) + "\n"


def run_kernel_on_host(source: str, kernel_name: str, fields, sizes: tuple[int, int, int, int], blocks: int,
                       workdir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(the bitmask [batch, heads, seqlen_q, words] the kernel wrote with a grid of `blocks`, the 64 guard words)."""
    cpp, binary = workdir / "host_bits.cpp", workdir / "host_bits"
    cpp.write_text(program_source(source, kernel_name, fields, sizes, blocks))
    flags = ["-std=c++20", "-O1", "-pthread", "-Wall", "-Werror", "-Wno-unused-parameter", "-Wno-unused-function",
             "-Wno-unused-variable", "-Wno-unknown-pragmas", *SANITIZERS]  # unroll pragmas are nvcc's
    build = subprocess.run([compiler(), *flags, str(cpp), "-o", str(binary)], capture_output=True, text=True)
    if build.returncode != 0:
        raise AssertionError(f"g++ rejected the bits kernel ({cpp}):\n{build.stderr[-4000:]}")
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise AssertionError(f"host bits kernel failed ({result.returncode}):\n{result.stderr[-4000:]}")
    values = np.array(result.stdout.split(), dtype=np.uint64).astype(np.uint32)
    batch, heads, seqlen_q, seqlen_k = sizes
    bits = values[32:-32].reshape(batch, heads, seqlen_q, -(-seqlen_k // 32))
    return bits, np.concatenate([values[:32], values[-32:]])

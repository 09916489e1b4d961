"""The mask-bits kernel's GPU time (issue 38), outside XLA: the document mask of mask_kernels_bench's docs4k case
(B 4, S 4096, 16 documents) through today's kernel source (mask_bits_emit.bits_kernel_source) and a few variants of
it, each compiled with NVRTC and launched through the driver API (ctypes), timed by CUDA events, its bits checked
against numpy. No libflashjax.so needed.   python lab/experiments/bits_kernel_variants.py   (PYTHONPATH=python)"""
import ctypes
import re
import sys

import jax.numpy as jnp
import numpy as np

import flashjax
from flashjax import mask_bits_emit, mask_codegen, nvrtc

B, S, DOCS = 4, 4096, 16
cuda = None  # loaded in main (a CPU host can still compile the variants)


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def variants(source):
    inner = "for (int i = 0; i < chunk_words; ++i) {"
    assert inner in source and "constexpr int kRows = 16;" in source
    out = {"today": source}
    for n in (4, 8):
        out[f"unroll{n}"] = source.replace(inner, f"#pragma unroll {n}\n    " + inner)
    for rows in (8, 32):
        out[f"rows{rows}"] = source.replace("constexpr int kRows = 16;", f"constexpr int kRows = {rows};")
    out["rows32_unroll4"] = out["rows32"].replace(inner, "#pragma unroll 4\n    " + inner)
    return out


def main():
    ids_np = np.repeat(np.arange(DOCS, dtype=np.int32), S // DOCS)[None].repeat(B, 0)
    mod = flashjax.document_mask(jnp.asarray(ids_np))
    generated = mask_codegen.generate_mask_mod(mod)
    name = "bits_variant"
    kernel = mask_bits_emit.bits_kernel_source(generated.graph, name, generated.function_name)
    words = (S + 31) // 32
    expect = np.zeros((B, S, words), np.uint32)
    same = ids_np[:, :, None] == ids_np[:, None, :]  # [B, q, kv]
    packed = np.packbits(same.reshape(B, S, words, 32)[..., ::-1], axis=-1, bitorder="big")
    expect = packed.view(">u4").reshape(B, S, words).astype(np.uint32)

    global cuda
    cuda = ctypes.CDLL("libcuda.so.1")
    check(cuda.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
    check(cuda.cuCtxSetCurrent(ctx), "setcurrent")
    major, minor = ctypes.c_int(), ctypes.c_int()
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
    sms = ctypes.c_int()
    cuda.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev)
    arch = f"sm_{major.value}{minor.value}"

    def alloc(nbytes):
        ptr = ctypes.c_uint64()
        check(cuda.cuMemAlloc_v2(ctypes.byref(ptr), nbytes), "alloc")
        return ptr

    d_ids = alloc(ids_np.nbytes)
    check(cuda.cuMemcpyHtoD_v2(d_ids, ids_np.ctypes.data_as(ctypes.c_void_p), ids_np.nbytes), "h2d")
    out_bytes = B * S * words * 4
    d_bits = alloc(out_bytes)

    class Field(ctypes.Structure):
        _fields_ = [("data", ctypes.c_uint64), ("stride", ctypes.c_longlong * 4), ("extent", ctypes.c_int * 4)]

    class Fields(ctypes.Structure):
        _fields_ = [("field", Field * 8)]

    fields = Fields()
    fields.field[0].data = d_ids.value
    fields.field[0].stride[:] = [S, 1, 0, 0]
    fields.field[0].extent[:] = [B, S, 1, 1]
    for k in range(1, 8):
        fields.field[k].extent[:] = [0, 0, 0, 0]
    a_batch, a_heads, a_sq, a_sk = ctypes.c_int(B), ctypes.c_int(1), ctypes.c_int(S), ctypes.c_int(S)
    args = (ctypes.c_void_p * 6)(*[ctypes.cast(ctypes.pointer(x), ctypes.c_void_p) for x in
                                   (fields, a_batch, a_heads, a_sq, a_sk, d_bits)])
    start, stop = ctypes.c_void_p(), ctypes.c_void_p()
    check(cuda.cuEventCreate(ctypes.byref(start), 0), "event")
    check(cuda.cuEventCreate(ctypes.byref(stop), 0), "event")
    print(f"device {arch}, {sms.value} SMs; document mask B {B} S {S}, {DOCS} docs; bits {out_bytes / 1e6:.1f} MB")
    for tag, body in variants(kernel).items():
        rows = int(re.search(r"constexpr int kRows = (\d+);", body).group(1))
        binary = nvrtc.compile_cuda(generated.source + body, arch=arch)
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        check(cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(binary.data)), "load")
        check(cuda.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), "getfunction")
        tasks = B * ((S + rows - 1) // rows) * ((words + 31) // 32)
        for grid_tag, blocks in (("1 task/warp", (tasks + 3) // 4), ("8 CTAs/SM", min((tasks + 3) // 4, 8 * sms.value))):
            check(cuda.cuMemsetD8_v2(d_bits, 0xAB, out_bytes), "memset")

            def launch():
                check(cuda.cuLaunchKernel(fn, blocks, 1, 1, 128, 1, 1, 0, None, args, None), "launch")
            launch()
            check(cuda.cuCtxSynchronize(), "sync")
            got = np.empty((B, S, words), np.uint32)
            check(cuda.cuMemcpyDtoH_v2(got.ctypes.data_as(ctypes.c_void_p), d_bits, out_bytes), "d2h")
            ok = np.array_equal(got, expect)
            reps = 200
            cuda.cuEventRecord(start, None)
            for _ in range(reps):
                launch()
            cuda.cuEventRecord(stop, None)
            check(cuda.cuEventSynchronize(stop), "eventsync")
            ms = ctypes.c_float()
            cuda.cuEventElapsedTime(ctypes.byref(ms), start, stop)
            print(f"{tag:<16} {grid_tag:<12} blocks {blocks:6d}  {ms.value / reps * 1e3:7.1f} us/call  "
                  f"{'ok' if ok else 'WRONG'}")
        cuda.cuModuleUnload(module)
    return 0


if __name__ == "__main__":
    sys.exit(main())

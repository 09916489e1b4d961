"""`python -m flashjax`: what is installed, what JAX sees, and which path typical calls would take."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import __version__, _ffi, api


def _typical_calls():
    bf16 = jnp.bfloat16
    spec = jax.ShapeDtypeStruct
    yield "causal, D 128", dict(q=spec((2, 4096, 16, 128), bf16), k=spec((2, 4096, 16, 128), bf16),
                                v=spec((2, 4096, 16, 128), bf16), causal=True)
    yield "GQA 32/8, D 64, fp16", dict(q=spec((1, 2048, 32, 64), jnp.float16), k=spec((1, 2048, 8, 64), jnp.float16),
                                       v=spec((1, 2048, 8, 64), jnp.float16))
    yield "D 72 (padded), window", dict(q=spec((1, 1024, 8, 72), bf16), k=spec((1, 1024, 8, 72), bf16),
                                        v=spec((1, 1024, 8, 72), bf16), window_size=(256, 0))
    yield "varlen, D 128", dict(q=spec((8192, 16, 128), bf16), k=spec((8192, 16, 128), bf16),
                                v=spec((8192, 16, 128), bf16), varlen=True)


def _print_cuda() -> None:
    """The CUDA major of the library, the driver and JAX's plugin, and whether they fit together."""
    plugins = _ffi.jax_cuda_plugins()
    plugin_text = ", ".join(f"jax-cuda{m}-plugin {v}" for m, v in sorted(plugins.items())) or "none (CPU-only jax)"
    driver = _ffi.driver_cuda_version()
    driver_text = f"CUDA {_ffi.cuda_text(driver)}" if driver else "none found"
    if not _ffi.available():
        print(f"CUDA: NVIDIA driver {driver_text}, jax plugin {plugin_text}")
        return
    env = _ffi.cuda_environment()
    major = env["library"] // 1000
    verdict = env["problem"] or env["warning"] or (
        f"they match (flashjax-cu{major})" if major in plugins else "no jax CUDA plugin: only the reference runs")
    print(f"CUDA: library {_ffi.cuda_text(env['library'])}, NVIDIA driver {driver_text}, jax plugin {plugin_text}: "
          f"{verdict}")


def main() -> None:
    print(f"flashjax {__version__}")
    if _ffi.available():
        info = _ffi.build_info()
        print(f"library: {info['path']}")
        print(f"  version {info['version']}, CUDA {_ffi.cuda_text(info['cuda_version'])}, "
              f"archs {', '.join(info['cuda_archs'])}, kernel set '{info['kernel_set']}' ({len(info['kernels'])} kernels)")
        for k in info["kernels"]:
            print(f"  {k['family']} {k['direction']} {k['dtype']} head dim {k['head_dim']}, "
                  f"{k['smem_bytes'] / 1024:g} KB shared memory per block")
    else:
        print(f"library: not found ({_ffi.LIBRARY_NAME}); only backend='reference' runs")
    _print_cuda()
    print(f"jax {jax.__version__}; devices:")
    for d in jax.devices():
        cc = getattr(d, "compute_capability", None)
        limit = ""
        if cc and _ffi.available():
            major, minor = str(cc).split(".")
            # The plan's device as the library resolves it (its shared-memory table), for any one call.
            device = _ffi.plan(dtype="bfloat16", batch=1, seqlen_q=1, seqlen_k=1, heads_q=1, heads_k=1,
                               head_dim=64, device_sm=int(major) * 10 + int(minor))["device"]
            limit = f", {device['smem_per_block_optin'] / 1024:g} KB shared memory per block"
        print(f"  {d.platform}:{d.id} {d.device_kind}" + (f" (compute capability {cc}{limit})" if cc else ""))
    if _ffi.available():
        settings = [s for s in _ffi.build_info()["settings"] if s["value"]]
        print("settings: " + (", ".join(f"{s['name']}={s['value']}" for s in settings) if settings else
                              "none set (" + ", ".join(s["name"] for s in _ffi.build_info()["settings"]) + ")"))
    print("typical calls:")
    for name, call in _typical_calls():
        print(f"  {name}: {api.explain(**call)}")


if __name__ == "__main__":
    main()

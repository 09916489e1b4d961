"""flashjax: FlashAttention for JAX, with CUDA kernels on CuTe/CUTLASS called through XLA FFI.

    out = flashjax.flash_attn(q, k, v, causal=True)                       # [B, S, H, D]
    out = flashjax.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)  # packed [T, H, D]
    print(flashjax.explain(q, k, v, causal=True))                          # which kernel runs, and why
    out = flashjax.ring_attention(q, k, v, axis_name="seq", causal=True)   # inside jax.shard_map: sequence split

`python -m flashjax` prints what is installed and which path typical calls take.
"""
import sys

if sys.version_info < (3, 12):
    raise ImportError(f"flashjax needs Python >= 3.12 (as jax 0.11 does); this is Python {sys.version.split()[0]}")

from . import _ffi  # noqa: E402
from ._ffi import export_checks  # noqa: E402
from .api import explain, flash_attn, flash_attn_varlen, flash_mha, flash_mha_varlen  # noqa: E402
from .masks import MaskMod, causal_mask, document_mask, prefix_lm_mask, sliding_window_mask, static  # noqa: E402
from .ring import from_zigzag, ring_attention, to_zigzag  # noqa: E402
from .varlen import check_varlen  # noqa: E402

__version__ = "0.2.0"

__all__ = [
    "flash_attn", "flash_attn_varlen", "flash_mha", "flash_mha_varlen", "explain", "check_varlen",
    "ring_attention", "to_zigzag", "from_zigzag", "export_checks",
    "MaskMod", "static", "causal_mask", "document_mask", "sliding_window_mask", "prefix_lm_mask",
]

_ffi.check_environment()

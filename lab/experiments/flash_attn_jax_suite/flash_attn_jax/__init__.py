"""flash_attn_jax's public names over flashjax, so that nshepperd/flash_attn_jax's own tests run against flashjax
(lab/experiments/flash_attn_jax_suite/README.md). flash_mha has the same keywords there and here."""
from flashjax import flash_mha

from .varlen import flash_mha_varlen

__all__ = ["flash_mha", "flash_mha_varlen"]

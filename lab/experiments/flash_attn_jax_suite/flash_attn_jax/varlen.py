"""flash_attn_jax.varlen.flash_mha_varlen's signature mapped onto flashjax.flash_attn_varlen (its tests import it from
this module). Its max_seqlen default -1 means "not given"; zero_tensors has no meaning here (outputs are defined)."""
import flashjax


def flash_mha_varlen(q, k, v, seqlens_q, seqlens_k=None, seqused_k=None, max_seqlen_q=-1, max_seqlen_k=-1,
                     softmax_scale=None, is_causal=False, window_size=(-1, -1), zero_tensors=False,
                     deterministic=False):
    return flashjax.flash_attn_varlen(
        q, k, v, seqlens_q, seqlens_q if seqlens_k is None else seqlens_k, seqused_k=seqused_k,
        max_seqlen_q=None if max_seqlen_q < 0 else max_seqlen_q,
        max_seqlen_k=None if max_seqlen_k < 0 else max_seqlen_k,
        softmax_scale=softmax_scale, causal=is_causal, window_size=window_size, deterministic=deterministic)

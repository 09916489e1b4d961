"""flashjax on one mesh of 8 devices: batch, heads and sequence split at once (docs/sharding.md).

    python examples/sharding.py       # on a CPU it makes 8 virtual devices; on 8 GPUs the kernels run

A (batch 2, heads 2, seq 2) mesh: flash_attn under jit splits batch and heads with no communication, and
ring_attention inside jax.shard_map splits the sequence too (the zigzag layout, so that causal work is balanced).
Both are checked against one unsharded call, forward and backward.
"""
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Only for CPU runs (read when JAX starts its CPU client); GPUs are real devices.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import flashjax  # noqa: E402


def main():
    mesh = jax.make_mesh((2, 2, 2), ("batch", "heads", "seq"))  # Explicit axes, jax.make_mesh's default
    rng = np.random.default_rng(0)
    batch, seqlen, heads_q, heads_k, head_dim = 4, 1024, 8, 2, 64
    q, k, v = (jnp.asarray(rng.standard_normal((batch, seqlen, h, head_dim)), jnp.bfloat16)
               for h in (heads_q, heads_k, heads_k))
    sinks = jnp.asarray(rng.standard_normal(heads_q), jnp.float32)

    def loss(out):
        return jnp.sum(out.astype(jnp.float32) ** 2)

    # 1. Batch and heads: shard the inputs and call flash_attn under jit; each device runs its shard.
    split = NamedSharding(mesh, P("batch", None, "heads"))
    qs, ks, vs = (jax.device_put(x, split) for x in (q, k, v))
    heads_split = jax.device_put(sinks, NamedSharding(mesh, P("heads")))
    attend = jax.jit(jax.value_and_grad(lambda q, k, v, s: loss(flashjax.flash_attn(q, k, v, sinks=s, causal=True)),
                                        argnums=(0, 1, 2)))
    value, grads = attend(qs, ks, vs, heads_split)

    # 2. Sequence too: ring_attention inside shard_map over all three axes. The sequence is put in zigzag order
    #    once (as a data loader would order its tokens), which balances causal work over the ring.
    seq_split = P("batch", "seq", "heads")
    ring = jax.shard_map(
        lambda q, k, v, s: flashjax.ring_attention(q, k, v, sinks=s, axis_name="seq", causal=True, layout="zigzag"),
        mesh=mesh, in_specs=(seq_split, seq_split, seq_split, P("heads")), out_specs=seq_split)
    zq, zk, zv = (jax.device_put(flashjax.to_zigzag(x, mesh.shape["seq"]), NamedSharding(mesh, seq_split))
                  for x in (q, k, v))
    ring_attend = jax.jit(jax.value_and_grad(lambda q, k, v, s: loss(ring(q, k, v, s)), argnums=(0, 1, 2)))
    ring_value, ring_grads = ring_attend(zq, zk, zv, heads_split)  # the loss does not depend on the order
    ring_grads = [flashjax.from_zigzag(g, mesh.shape["seq"]) for g in ring_grads]

    # 3. Both against one unsharded call.
    one_value, one_grads = jax.jit(attend)(q, k, v, sinks)
    for name, (got, want) in {"batch+heads": (value, one_value), "batch+heads+seq": (ring_value, one_value)}.items():
        print(f"{name}: loss {float(got):.4f} (one call {float(want):.4f})")
        assert abs(float(got) - float(want)) <= 2e-2 * abs(float(want)), name
    for name, grad in (("batch+heads", grads), ("batch+heads+seq", ring_grads)):
        for g, w in zip(grad, one_grads):
            g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
            assert np.linalg.norm(g - w) <= 3e-2 * np.linalg.norm(w), name
    print("gradients match")


if __name__ == "__main__":
    main()

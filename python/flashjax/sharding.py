"""How a flashjax call splits over a device mesh: batch and heads, with no communication (docs/sharding.md).

XLA cannot partition the kernels' FFI calls by itself: it would gather every operand onto every device. So each
primitive (primitives.py) lowers through jax's custom_partitioning with the one policy written here, and the
reference path runs through `check` (an identity with the same policy), so that both backends accept and refuse the
same shardings:

- The batch and head axes split, taken from the first operand that has a batch or head sharding (q before k before
  v); every operand is given that split, so each device runs the same call on its shard. Only a gradient that sums
  over the batch (dsinks) is reduced, with one all-reduce of Hq floats.
- Grouped-query attention splits the KV heads with their query heads: the number of head shards must divide Hk.
- A sharded sequence axis raises a ValueError that points at ring attention (ring.py): attention needs every key
  for every query, and the silent alternative is XLA gathering the whole sequence onto every device.
- A sharded head dim (D, Dv) is gathered (Shardy's need_replication): a layout no attention call is given on purpose.

Explicit-sharding meshes (jax.make_mesh's default) carry shardings in the types, so `explicit_split` applies the same
policy at trace time and api.py runs the call under jax.sharding.auto_axes, which hands it to the rule above.
"""
from __future__ import annotations

import dataclasses
import math

import jax
from jax._src import dispatch  # custom_partitioning's lowering needs devices; no public spelling (jax 0.11, 0.12)
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType, NamedSharding, PartitionSpec

# What each dimension of an operand is, by role.
_ROLE_DIMS = {
    "q": ("batch", "seq_q", "heads_q", "dim"),          # q, out, d_out, dq and their tangents [B, Sq, Hq, D]
    "kv": ("batch", "seq_k", "heads_k", "dim"),         # k, v, dk, dv [B, Sk, Hk, D]
    "rows": ("batch", "heads_q", "seq_q"),              # lse, d_lse [B, Hq, Sq]
    "heads": ("heads_q",),                              # sinks [Hq]
    "heads_sum": ("heads_q",),                          # dsinks [Hq]: a sum over the batch
    "packed_q": ("seq_q", "heads_q", "dim"),            # varlen q [Tq, Hq, D]
    "packed_kv": ("seq_k", "heads_k", "dim"),           # varlen k, v [Tk, Hk, D]
    "packed_rows": ("heads_q", "seq_q"),                # varlen lse [Hq, Tq]
    # A mask mod's bits [Bm, Hm, Sq, Wk] (primitives.py): Bm is B or 1, Hm Hq or 1 ("one": a broadcast axis, never
    # split), so they split with the call where they are per batch / per head and are replicated where they broadcast.
    "mask_bh": ("batch", "heads_q", "seq_q", "words"),
    "mask_b": ("batch", "one", "seq_q", "words"),
    "mask_h": ("one", "heads_q", "seq_q", "words"),
    "mask_": ("one", "one", "seq_q", "words"),
}
# Dimension kinds that are never split: Shardy gets a replicated factor of their own for each.
_UNSPLIT = ("dim", "one", "words")

# (operand names, operand roles, result roles) of each partitioned operation: the three primitives (design §3.9) and
# the reference path's checks of a dense and of a varlen call.
SIGNATURES = {
    "fwd": (("q", "k", "v", "sinks"), ("q", "kv", "kv", "heads"), ("q", "rows")),
    "tangent": (("q", "k", "v", "sinks", "out", "lse", "q's tangent", "k's tangent", "v's tangent", "sinks' tangent"),
                ("q", "kv", "kv", "heads", "q", "rows", "q", "kv", "kv", "heads"), ("q", "rows")),
    "bwd": (("q", "k", "v", "out", "lse", "d_out", "d_lse", "sinks"),
            ("q", "kv", "kv", "q", "rows", "q", "rows", "heads"), ("q", "kv", "kv", "heads_sum")),
    "jvp": (("q", "k", "v", "sinks", "q's tangent", "k's tangent", "v's tangent", "sinks' tangent"),
            ("q", "kv", "kv", "heads", "q", "kv", "kv", "heads"), ("q", "rows", "q", "rows")),
    "dense": (("q", "k", "v"), ("q", "kv", "kv"), ("q", "kv", "kv")),
    "varlen": (("q", "k", "v"), ("packed_q", "packed_kv", "packed_kv"), ("packed_q", "packed_kv", "packed_kv")),
}


_MASK_KINDS = ("fwd", "tangent", "bwd")


def signature(kind: str, shapes) -> tuple:
    """SIGNATURES[kind], with the optional mask bits (an operand past the fixed ones) named and given their role by
    their shape against q's [B, Sq, Hq, D]."""
    names, roles, results = SIGNATURES[kind]
    if kind in _MASK_KINDS and len(shapes) > len(roles):
        bits, q = tuple(shapes[len(roles)]), tuple(shapes[0])
        role = "mask_" + ("b" if bits[0] == q[0] else "") + ("h" if bits[1] == q[2] else "")
        names, roles = names + ("mask_bits",), roles + (role,)
    return names, roles, results


@dataclasses.dataclass(frozen=True)
class Split:
    """The mesh axes the batch and the heads are split over (empty: not split)."""
    batch: tuple[str, ...]
    heads: tuple[str, ...]

    def spec(self, role: str, lead: tuple = ()) -> PartitionSpec:
        """The PartitionSpec of an operand of this role (`lead`: the specs of extra leading dims, under vmap)."""
        by_kind = {"batch": self.batch or None, "heads_q": self.heads or None, "heads_k": self.heads or None}
        return PartitionSpec(*lead, *(by_kind.get(kind) for kind in _ROLE_DIMS[role]))


class _Devices(str):
    """A dimension split n ways whose mesh axes are unknown (the checks read XLA's own sharding: see `partitioned`)."""


def _over(axes, axis_sizes) -> str:
    shards = math.prod(axis_sizes[a] for a in axes)
    if axes and all(isinstance(a, _Devices) for a in axes):
        return f"{shards} devices"
    return f"mesh axes {tuple(str(a) for a in axes)} ({shards} shards)"


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _dims(spec: PartitionSpec, ndim: int) -> tuple[tuple[str, ...], ...]:
    """Per dimension, the mesh axes it is sharded over."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(_axes(e) for e in entries)


def decide(kind: str, axis_sizes: dict, dims: list, shapes: list, leads=None) -> Split:
    """The split of a call whose operands are sharded as `dims` (per operand, per dimension, the mesh axes), or the
    ValueError that says why it cannot run per shard. `leads`: per operand, the extra leading (vmapped) dims."""
    names, roles, _ = signature(kind, shapes)
    operands = [(name, role, lead, operand_dims[lead:], shape[lead:]) for name, role, lead, operand_dims, shape
                in zip(names, roles, leads or (0,) * len(roles), dims, shapes)]
    size = {}  # dimension kind -> length
    leader = None
    for name, role, lead, operand_dims, shape in operands:
        for i, (dim_kind, axes) in enumerate(zip(_ROLE_DIMS[role], operand_dims)):
            size.setdefault(dim_kind, shape[i])
            if dim_kind.startswith("seq") and axes:
                raise ValueError(
                    f"flashjax: {name}'s sequence axis (dimension {lead + i}) is sharded over "
                    f"{_over(axes, axis_sizes)}, but flash_attn splits only the batch and the heads (attention needs "
                    "every key for every query, and the alternative is gathering the whole sequence onto every "
                    "device). To split the sequence, call flashjax.ring_attention inside jax.shard_map "
                    "(docs/sharding.md); otherwise replicate that axis, e.g. with jax.lax.with_sharding_constraint")
        split = dict(zip(_ROLE_DIMS[role], operand_dims))
        if leader is None and any(split.get(k) for k in ("batch", "heads_q", "heads_k")):
            leader = Split(split.get("batch", ()), split.get("heads_q", ()) or split.get("heads_k", ()))
    leader = leader or Split((), ())
    shards = math.prod(axis_sizes[a] for a in leader.batch)
    if leader.batch and size["batch"] % shards:
        raise ValueError(f"flashjax: the batch ({size['batch']}) must divide evenly over "
                         f"{_over(leader.batch, axis_sizes)}")
    shards = math.prod(axis_sizes[a] for a in leader.heads)
    if size["heads_k"] % shards:
        raise ValueError(
            f"flashjax: the heads are split over {_over(leader.heads, axis_sizes)}, and {shards} must divide the "
            f"{size['heads_k']} key/value heads: each KV head stays on the devices of its "
            f"{size['heads_q'] // size['heads_k']} query heads (grouped-query attention, {size['heads_q']} query "
            f"heads). Split the heads a number of ways that divides {size['heads_k']}, or replicate them")
    return leader


# ------------------------------------------------------------------------------------------------ custom_partitioning
def _sharding_of(x, ndim):
    sharding = x.sharding
    if sharding is None:  # GSPMD asks before it knows every operand's sharding
        return ((),) * ndim
    if not isinstance(sharding, NamedSharding):
        # Seen inside jax.shard_map with some mesh axes left Auto: XLA then names no mesh axes.
        raise TypeError(
            f"flashjax: the kernels' partitioning needs the mesh axes of the operands' sharding, and XLA gave "
            f"{sharding}. Inside jax.shard_map, make every mesh axis manual (leave axis_names at its default, all "
            "axes, with the batch and head axes in in_specs; docs/sharding.md's example does) rather than leaving "
            "some of them Auto")
    return _dims(sharding.spec, ndim)


def _tiles_of(x, ndim):
    """Per dimension, a stand-in axis for the number of devices it is split over, from XLA's sharding itself."""
    if x.sharding is None:
        return ((),) * ndim
    hlo = x.sharding._to_xla_hlo_sharding(ndim)  # what custom_partitioning itself calls
    tiles = (1,) * ndim if hlo.is_replicated() else tuple(hlo.tile_assignment_dimensions()[:ndim])
    return tuple((_Devices(n),) if n > 1 else () for n in tiles)


def _check_only(kind, leads, arg_shapes):
    dims = [_tiles_of(x, len(x.shape)) for x in arg_shapes]
    sizes = {a: int(a) for operand_dims in dims for d in operand_dims for a in d}
    decide(kind, sizes, dims, [x.shape for x in arg_shapes], leads)


def _plan(kind, leads, mesh, arg_shapes):
    dims = [_sharding_of(x, len(x.shape)) for x in arg_shapes]
    split = decide(kind, dict(mesh.shape), dims, [x.shape for x in arg_shapes], leads)
    used = set(split.batch) | set(split.heads)
    # Extra leading (vmapped) dims keep their own sharding, less any axis the split takes.
    lead_specs = [tuple(tuple(a for a in d if a not in used) or None for d in operand_dims[:lead])
                  for operand_dims, lead in zip(dims, leads)]
    return split, lead_specs


def _result_leads(kind, lead_specs):
    # Only the checks (identities) see vmapped dims; their results keep their operands' leading dims.
    return lead_specs if kind in ("dense", "varlen") else [()] * len(SIGNATURES[kind][2])


def _leads_of(kind, params, num_operands):
    return dict(params).get("leads") or (0,) * num_operands


def _rule(kind, params, group, shapes):
    """Shardy's einsum-like rule: batch b, sequences s and t, query heads h, KV heads k (the same factor without
    GQA), and a factor of its own for each head dim, which must be replicated. GQA's query heads are not the
    compound factor (k g): Shardy would then give KV heads a part of a mesh axis (k over 2 of 4 devices), which a
    NamedSharding cannot name; partition() gives each operand its heads' shards instead."""
    _, roles, result_roles = signature(kind, shapes)
    leads = _leads_of(kind, params, len(roles))
    letters = {"batch": "b", "seq_q": "s", "seq_k": "t", "heads_q": "h" if group > 1 else "k", "heads_k": "k"}
    replicated = []

    def mapping(role, lead, tag):
        factors = [f"l{tag}_{j}" for j in range(lead)]
        for dim_kind in _ROLE_DIMS[role]:
            if dim_kind in _UNSPLIT:
                factor = f"{dim_kind[0]}{tag}_{len(factors)}"
                replicated.append(factor)
                factors.append(factor)
            else:
                factors.append(letters[dim_kind])
        return " ".join(factors)

    operands = [mapping(role, lead, i) for i, (role, lead) in enumerate(zip(roles, leads))]
    if kind in ("dense", "varlen"):  # identities: result i is operand i
        results = list(operands)
    else:
        results = [mapping(role, 0, f"r{i}") for i, role in enumerate(result_roles)]
    rule = ", ".join(operands) + " -> " + ", ".join(results)
    return rule, dict(need_replication_factors=tuple(replicated))


def partitioned(kind: str, local):
    """`local(*arrays, **params)` (the per-device computation, a tuple of results) as a function of
    (params as a sorted tuple of items, *arrays) that XLA partitions by this module's policy.

    The checks of the reference path (kinds "dense", "varlen") keep their operands' shardings and only validate
    them, reading XLA's own shardings (decode_shardings=False): the reference's GQA reshape may give k a part of a
    mesh axis, which jax cannot name as a NamedSharding and would fail on before the check could explain."""
    _, _, result_roles = SIGNATURES[kind]
    check_only = kind in ("dense", "varlen")

    def fn(params, *arrays):
        return tuple(local(*arrays, **dict(params)))

    def shardings(kind, params, mesh, arg_shapes):
        _, roles, _ = signature(kind, [x.shape for x in arg_shapes])
        leads = _leads_of(kind, params, len(roles))
        split, lead_specs = _plan(kind, leads, mesh, arg_shapes)
        args = tuple(NamedSharding(mesh, split.spec(r, lead)) for r, lead in zip(roles, lead_specs))
        results = tuple(NamedSharding(mesh, split.spec(r, lead))
                        for r, lead in zip(result_roles, _result_leads(kind, lead_specs)))
        return split, args, results

    def partition(params, mesh, arg_shapes, result_shape):
        if check_only:
            _check_only(kind, _leads_of(kind, params, len(arg_shapes)), arg_shapes)
            given = tuple(x.sharding for x in arg_shapes)
            return mesh, lambda *arrays: arrays, given, given
        split, args, results = shardings(kind, params, mesh, arg_shapes)
        has_sum = "heads_sum" in result_roles and dict(params).get("has_sinks") and split.batch

        def lower(*arrays):
            outs = fn(params, *arrays)
            if not has_sum:
                return outs
            # dsinks sums over every row of the batch: each batch shard holds a part of the sum.
            return tuple(jax.lax.psum(o, split.batch) if r == "heads_sum" else o for o, r in zip(outs, result_roles))

        return mesh, lower, results, args

    def infer(params, mesh, arg_shapes, result_shape):  # the GSPMD partitioner's question (Shardy reads the rule)
        if check_only:
            return tuple(x.sharding or NamedSharding(mesh, PartitionSpec()) for x in arg_shapes)
        try:
            return shardings(kind, params, mesh, arg_shapes)[2]
        except ValueError:
            # An exception here aborts the process (XLA checks the callback's status); partition raises it instead.
            return tuple(NamedSharding(mesh, PartitionSpec()) for _ in result_roles)

    def rule(params, mesh, operand_types, result_types):
        shapes = [tuple(mlir.ir.RankedTensorType(t).shape) for t in operand_types]
        _, roles, _ = signature(kind, shapes)
        leads = _leads_of(kind, params, len(roles))
        heads = {k: shape[lead + _ROLE_DIMS[role].index(k)] for role, lead, shape in zip(roles, leads, shapes)
                 for k in ("heads_q", "heads_k") if k in _ROLE_DIMS[role]}
        return _rule(kind, params, heads["heads_q"] // max(heads["heads_k"], 1), shapes)

    wrapped = custom_partitioning(fn, static_argnums=(0,))
    wrapped.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                          decode_shardings=not check_only)
    return wrapped


def lowering(kind: str, local):
    """A lowering rule that partitions the primitive of this kind by the policy, each shard running `local`."""
    wrapped = partitioned(kind, local)

    def lower(ctx, *args, **params):
        items = tuple(sorted(params.items()))
        return mlir.lower_fun(lambda *a: wrapped(items, *a), multiple_results=True)(ctx, *args)

    return lower


def register(primitive, kind: str, local) -> None:
    """Lower `primitive` on every platform through the policy, each shard binding `local` (the real lowering)."""
    mlir.register_lowering(primitive, lowering(kind, local))
    # custom_partitioning lowers only with the call's devices known (a single device: the call itself, inlined).
    dispatch.prim_requires_devices_during_lowering.add(primitive)


# ------------------------------------------------------------------------------------------------ explicit sharding
def explicit_split(kind: str, *arrays):
    """(mesh, Split) when an operand's type carries explicit mesh axes (the policy applied now, at trace time: its
    errors are raised here), else None (Auto axes: the partitioner applies it when the call is compiled)."""
    types = [jax.typeof(x) for x in arrays]
    shardings = [getattr(t, "sharding", None) for t in types]
    mesh = next((s.mesh for s in shardings if _is_explicit(s)), None)
    if mesh is None:
        return None
    dims = [_dims(s.spec, len(t.shape)) if s is not None and s.mesh == mesh else ((),) * len(t.shape)
            for s, t in zip(shardings, types)]
    return mesh, decide(kind, dict(mesh.shape), dims, [t.shape for t in types])


def _is_explicit(sharding) -> bool:
    """Whether a type's sharding names an Explicit mesh axis."""
    if sharding is None or not hasattr(sharding, "spec"):
        return False
    types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
    return any(types[a] == AxisType.Explicit for entry in sharding.spec for a in _axes(entry))


def same_sharding(fn, x):
    """fn(x) for an fn that moves data along x's axes (a permutation): with explicit axes it runs with them made Auto
    (XLA moves the data) and its result keeps x's sharding."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if not _is_explicit(sharding):
        return fn(x)
    return jax.sharding.auto_axes(fn, out_sharding=sharding)(x)


def run_explicit(fn, mesh, split: Split, result_roles, *args):
    """fn(*args) with the mesh's explicit axes made Auto inside (so the partitioner applies the policy) and its
    results given the split's shardings."""
    out_sharding = tuple(NamedSharding(mesh, split.spec(role)) for role in result_roles)
    return jax.sharding.auto_axes(fn, out_sharding=out_sharding)(*args)


# ------------------------------------------------------------------------------------------------ the reference's check
check_p = Primitive("flashjax_sharding_check")
check_p.multiple_results = True
check_p.def_impl(lambda *xs, **_: xs)
check_p.def_abstract_eval(lambda *xs, **_: xs)


def check(kind: str, q, k, v):
    """q, k, v unchanged, after the policy's checks on their sharding ("dense" or "varlen" call): the reference path
    runs through this, so that it refuses what the kernel path refuses."""
    return tuple(check_p.bind(q, k, v, kind=kind, leads=(0, 0, 0)))


def _check_jvp(primals, tangents, **params):
    return check_p.bind(*primals, **params), list(tangents)


def _check_batching(args, dims, *, kind, leads):
    # A vmapped axis becomes an extra leading dim of that operand, which the policy does not look at.
    moved = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims)]
    leads = tuple(lead + (d is not None) for lead, d in zip(leads, dims))
    return check_p.bind(*moved, kind=kind, leads=leads), [None if d is None else 0 for d in dims]


ad.primitive_jvps[check_p] = _check_jvp
batching.primitive_batchers[check_p] = _check_batching
_check_lowerings = {kind: lowering(kind, lambda *xs, **_: xs) for kind in ("dense", "varlen")}
mlir.register_lowering(check_p, lambda ctx, *xs, kind, leads: _check_lowerings[kind](ctx, *xs, kind=kind, leads=leads))
dispatch.prim_requires_devices_during_lowering.add(check_p)

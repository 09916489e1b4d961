"""Emits a mask mod's expression graph as a CUDA C++ device function (docs/mask_codegen.md).

The source is self-contained (no #include, so NVRTC needs no header path) and deterministic: it is a function of
the graph alone, which is a function of the mod's class, static() values and field shapes, never of field values.
It defines, under an include guard shared by every generated mod:

- ``FlashjaxMaskField`` / ``FlashjaxMaskFields``, the one fixed layout in which the kernels receive any mod's array
  fields (``ABI_SOURCE`` documents it), and the ``fjm_*`` helpers that give the graph's operations XLA's
  semantics (flashjax.mask_ops);

and then the predicate, ``__device__ __forceinline__ bool <name>(int b, int h, int q_idx, int kv_idx, const
FlashjaxMaskFields& f)`` (or ``extern "C" __device__`` for separate compilation), one ``const`` local per graph
node, plus ``static`` tables for constant arrays.
``probe_kernel_source`` adds a kernel that evaluates the predicate over an index grid, for compile checks and
device tests.
"""

from __future__ import annotations

from flashjax.mask_graph import INDEX_NAMES, ConstTable, MaskGraph, Node
from flashjax.mask_ops import CXX_HELPERS, OPS, cxx_int_literal
from flashjax.mask_trace import MAX_FIELD_RANK, MAX_FIELDS

__all__ = ["ABI_SOURCE", "DEFAULT_FUNCTION_NAME", "emit_mask_mod_source", "emit_nodes", "table_definitions", "table_read",
           "const_literal", "cxx_type", "probe_kernel_source"]

DEFAULT_FUNCTION_NAME = "flashjax_mask_mod"

ABI_SOURCE = f"""#ifndef FLASHJAX_MASK_FIELDS_ABI
#define FLASHJAX_MASK_FIELDS_ABI 1
// The array fields of a mask mod as the kernels receive them, one layout for every mod: f.field[k] is the k-th
// array leaf of the mod's pytree (flashjax.mask_codegen.mask_field_operands gives them in order), k < {MAX_FIELDS}.
// Element (i0, ..., i{MAX_FIELD_RANK - 1}) is data[i0 * stride[0] + ...]: strides count elements (0 on a broadcast
// axis), an axis past the field's rank has extent 1. Fields are int32 on the device; a bool field holds 0 / 1.
struct FlashjaxMaskField {{
  const int* data;
  long long stride[{MAX_FIELD_RANK}];
  int extent[{MAX_FIELD_RANK}];
}};
struct FlashjaxMaskFields {{
  FlashjaxMaskField field[{MAX_FIELDS}];
}};
{CXX_HELPERS}
// Every index is clamped into [0, extent), as jnp indexing clamps: an index expression that strays (a position past
// a sequence's ids, a wrong b) reads a wrong element of the field, never memory outside it.
__device__ __forceinline__ int fjm_read(const FlashjaxMaskField& f, int i0, int i1, int i2, int i3) {{
  if (f.extent[0] <= 0 || f.extent[1] <= 0 || f.extent[2] <= 0 || f.extent[3] <= 0) return 0;  // no element
  const long long offset = fjm_clamp_index(i0, f.extent[0]) * f.stride[0] + fjm_clamp_index(i1, f.extent[1]) *
      f.stride[1] + fjm_clamp_index(i2, f.extent[2]) * f.stride[2] + fjm_clamp_index(i3, f.extent[3]) * f.stride[3];
  return f.data[offset];
}}
#endif  // FLASHJAX_MASK_FIELDS_ABI
"""


def cxx_type(dtype: str) -> str:
    return "bool" if dtype == "bool" else "int"


def const_literal(node: Node) -> str:
    if node.dtype == "bool":
        return "true" if node.attr else "false"
    return cxx_int_literal(node.attr)


def _table_definition(name: str, table: ConstTable) -> str:
    values = ", ".join(cxx_int_literal(int(v)) for v in table.values)
    return f"static __device__ const int {name}[{len(table.values)}] = {{{values}}};  // shape {list(table.shape)}"


def table_read(name: str, table: ConstTable, indices: list[str]) -> str:
    strides = [1] * len(table.shape)
    for d in range(len(table.shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * table.shape[d + 1]
    terms = [f"fjm_clamp_index({i}, {n}) * {s}" for i, n, s in zip(indices, table.shape, strides)]
    return f"{name}[{' + '.join(terms)}]"


def emit_nodes(graph: MaskGraph, node_ids, expressions: dict[int, str], tables: dict[ConstTable, str], *,
               table_prefix: str, local_prefix: str = "v") -> list[str]:
    """One ``const`` local per node of ``node_ids`` (topological order), as C++ lines. ``expressions`` maps every
    node already available (and, on return, each of these) to how C++ refers to it; constants and indices are
    inlined, not given locals. Constant tables are named into ``tables`` (``<table_prefix>_table<k>``)."""
    body = []
    for node_id in node_ids:
        node = graph.nodes[node_id]
        args = [expressions[a] for a in node.args]
        if node.op == "const":
            expressions[node_id] = const_literal(node)
            continue
        if node.op == "index":
            expressions[node_id] = node.attr
            continue
        if node.op == "field":
            padded = args + ["0"] * (MAX_FIELD_RANK - len(args))
            expression = f"fjm_read(f.field[{node.attr}], {', '.join(padded)})"
        elif node.op == "table":
            table_name = tables.setdefault(node.attr, f"{table_prefix}_table{len(tables)}")
            expression = table_read(table_name, node.attr, args)
        else:
            arg_dtypes = tuple(graph.nodes[a].dtype for a in node.args)
            expression = OPS[node.op].cxx(arg_dtypes, tuple(args))
        local = f"{local_prefix}{len(body)}"
        body.append(f"  const {cxx_type(node.dtype)} {local} = {expression};")
        expressions[node_id] = local
    return body


def table_definitions(tables: dict[ConstTable, str]) -> list[str]:
    return [_table_definition(name, table) for table, name in tables.items()]


def emit_mask_mod_source(graph: MaskGraph, *, function_name: str = DEFAULT_FUNCTION_NAME,
                         external: bool = False) -> str:
    """The C++ source of ``graph``'s predicate as ``function_name`` (a C identifier; distinct names let several
    mods share one translation unit).

    By default the predicate is ``__forceinline__``, for a source that also holds the kernel. ``external=True``
    makes it ``extern "C" __device__`` instead, for separate compilation (NVRTC ``-rdc=true``, or ``-dlto`` for
    link-time inlining) and linking into kernels built apart from it.
    """
    if not function_name.isidentifier():
        raise ValueError(f"function_name must be a C identifier, got {function_name!r}")
    tables: dict[ConstTable, str] = {}
    expressions: dict[int, str] = {}  # node id -> how later nodes refer to it
    body = emit_nodes(graph, graph.reachable(), expressions, tables, table_prefix=function_name)

    qualifiers = 'extern "C" __device__' if external else "__device__ __forceinline__"
    field_lines = [f"//   f.field[{k}]: {spec.name}, {spec.dtype}{list(spec.shape)}" for k, spec in enumerate(graph.fields)]
    lines = [
        f"// Generated by flashjax.mask_codegen from the mask mod {graph.mod_class}; do not edit.",
        "// Array fields:" if graph.fields else "// No array fields.",
        *field_lines,
        ABI_SOURCE,
        *table_definitions(tables),
        f"{qualifiers} bool {function_name}(int {INDEX_NAMES[0]}, int {INDEX_NAMES[1]}, "
        f"int {INDEX_NAMES[2]}, int {INDEX_NAMES[3]}, const FlashjaxMaskFields& f) {{",
        *body,
        f"  return {expressions[graph.output]};",
        "}",
        "",
    ]
    return "\n".join(lines)


def probe_kernel_source(function_name: str = DEFAULT_FUNCTION_NAME) -> str:
    """A kernel ``<function_name>_probe`` writing the predicate at every (b, h, q_start + q, kv_start + kv) of a
    [batch, heads, seqlen_q, seqlen_k] grid to ``out`` (one byte each, row-major): appended to a mod's source it
    gives NVRTC code to generate, and a device test the values to compare with the reference."""
    return f"""
extern "C" __global__ void {function_name}_probe(FlashjaxMaskFields f, int batch, int heads, int seqlen_q,
                                                 int seqlen_k, int q_start, int kv_start, unsigned char* out) {{
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)batch * heads * seqlen_q * seqlen_k) return;
  const int kv = (int)(i % seqlen_k);
  const int q = (int)(i / seqlen_k % seqlen_q);
  const int h = (int)(i / ((long long)seqlen_k * seqlen_q) % heads);
  const int b = (int)(i / ((long long)seqlen_k * seqlen_q * heads));
  out[i] = {function_name}(b, h, q_start + q, kv_start + kv, f) ? 1 : 0;
}}
"""

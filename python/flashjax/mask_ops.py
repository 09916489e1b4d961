"""The operations of a mask-mod expression graph, each defined once in numpy and once in C++ (docs/mask_codegen.md).

A graph value is a scalar of dtype ``bool`` or ``int32``. Every operation here means exactly what the jax
primitive of the same meaning computes under XLA, on every input, because the kernels must agree with the
reference bit for bit:

- int32 add/sub/mul/neg/abs wrap around (two's complement), as XLA's do; C++ signed overflow is undefined, so the
  C++ side computes them on unsigned values;
- ``div`` truncates toward zero and ``rem`` takes the dividend's sign (lax.div / lax.rem; jnp's ``//`` and ``%``
  are built from them, so floor semantics follow from the graph). XLA defines the cases C++ leaves undefined:
  x / 0 = -1, x % 0 = x, INT_MIN / -1 = INT_MIN, INT_MIN % -1 = 0;
- shifts by an amount outside [0, 32) give 0 (left, logical right) or the sign fill (arithmetic right);
- ``and``/``or``/``xor``/``not`` are logical on bool and bitwise on int32.

The numpy functions serve both the graph builder's constant folding and the interpreter, so folding can never
disagree with evaluation. They take numpy arrays (0-d included) of the argument dtypes and broadcast.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

__all__ = ["OPS", "OpSpec", "CXX_HELPERS", "INT32_MIN", "cxx_int_literal"]

INT32_MIN = -(2**31)


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One graph operation: how many arguments, which dtypes it takes, what dtype it returns, and its meaning."""

    arity: int
    operands: str  # "int32" (int32 only), "any" (bool or int32, all the same), "select" (bool, then two equal)
    result: str  # "bool", "int32" or "same" (the dtype of the value arguments)
    numpy: Callable[..., np.ndarray]
    # C++ expression from the argument dtypes and argument expressions.
    cxx: Callable[[tuple[str, ...], tuple[str, ...]], str]


def _wrap32(values64: np.ndarray) -> np.ndarray:
    """int64 -> int32 keeping the low 32 bits, as two's-complement hardware (and XLA) does."""
    return np.asarray(values64, dtype=np.int64).astype(np.int32)


def _i64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def _trunc_div(x, y) -> np.ndarray:
    x64, y64 = _i64(x), _i64(y)
    safe = np.where(y64 == 0, 1, y64)
    quotient = np.abs(x64) // np.abs(safe) * np.sign(x64) * np.sign(safe)  # rounds toward zero
    return np.where(y64 == 0, np.int32(-1), _wrap32(quotient))  # INT_MIN / -1 = 2**31 wraps to INT_MIN


def _trunc_rem(x, y) -> np.ndarray:
    x64, y64 = _i64(x), _i64(y)
    safe = np.where(y64 == 0, 1, y64)
    quotient = np.abs(x64) // np.abs(safe) * np.sign(x64) * np.sign(safe)
    return np.where(y64 == 0, np.asarray(x, dtype=np.int32), _wrap32(x64 - quotient * safe))


def _shift(kind: str):
    def shift(x, amount):
        x32 = np.asarray(x, dtype=np.int32)
        amount_u = np.asarray(amount, dtype=np.int32).astype(np.uint32)  # negative amounts are huge, as in XLA
        in_range = amount_u < 32
        safe = np.where(in_range, amount_u, 0).astype(np.uint32)
        bits = x32.astype(np.uint32)
        if kind == "left":
            shifted, fill = (bits << safe).astype(np.int32), np.int32(0)
        elif kind == "logical":
            shifted, fill = (bits >> safe).astype(np.int32), np.int32(0)
        else:
            shifted, fill = x32 >> safe.astype(np.int32), np.where(x32 < 0, np.int32(-1), np.int32(0))
        return np.where(in_range, shifted, fill).astype(np.int32)

    return shift


def _call(name: str) -> Callable[[tuple[str, ...], tuple[str, ...]], str]:
    return lambda dtypes, args: f"{name}({', '.join(args)})"


def _infix(symbol: str) -> Callable[[tuple[str, ...], tuple[str, ...]], str]:
    return lambda dtypes, args: f"({args[0]} {symbol} {args[1]})"


def _logic(symbol: str) -> Callable[[tuple[str, ...], tuple[str, ...]], str]:
    # On bool, (a & b) is an int 0/1 that converts back exactly; written as bool ops for readability.
    logical = {"&": "&&", "|": "||", "^": "!="}[symbol]
    return lambda dtypes, args: f"({args[0]} {logical if dtypes[0] == 'bool' else symbol} {args[1]})"


def _not_cxx(dtypes, args) -> str:
    return f"(!{args[0]})" if dtypes[0] == "bool" else f"(~{args[0]})"  # ~ on a bool would give -2 (true)


def _int32_binary(fn):
    return lambda x, y: _wrap32(fn(_i64(x), _i64(y)))


OPS: dict[str, OpSpec] = {
    "add": OpSpec(2, "int32", "int32", _int32_binary(np.add), _call("fjm_add")),
    "sub": OpSpec(2, "int32", "int32", _int32_binary(np.subtract), _call("fjm_sub")),
    "mul": OpSpec(2, "int32", "int32", _int32_binary(np.multiply), _call("fjm_mul")),
    "div": OpSpec(2, "int32", "int32", _trunc_div, _call("fjm_div")),
    "rem": OpSpec(2, "int32", "int32", _trunc_rem, _call("fjm_rem")),
    "neg": OpSpec(1, "int32", "int32", lambda x: _wrap32(-_i64(x)), _call("fjm_neg")),
    "abs": OpSpec(1, "int32", "int32", lambda x: _wrap32(np.abs(_i64(x))), _call("fjm_abs")),
    "sign": OpSpec(1, "int32", "int32", lambda x: np.sign(np.asarray(x, np.int32)), _call("fjm_sign")),
    "shl": OpSpec(2, "int32", "int32", _shift("left"), _call("fjm_shl")),
    "shr_arithmetic": OpSpec(2, "int32", "int32", _shift("arithmetic"), _call("fjm_shr_arithmetic")),
    "shr_logical": OpSpec(2, "int32", "int32", _shift("logical"), _call("fjm_shr_logical")),
    "min": OpSpec(2, "any", "same", np.minimum, lambda d, a: f"({a[0]} < {a[1]} ? {a[0]} : {a[1]})"),
    "max": OpSpec(2, "any", "same", np.maximum, lambda d, a: f"({a[0]} > {a[1]} ? {a[0]} : {a[1]})"),
    "and": OpSpec(2, "any", "same", np.bitwise_and, _logic("&")),
    "or": OpSpec(2, "any", "same", np.bitwise_or, _logic("|")),
    "xor": OpSpec(2, "any", "same", np.bitwise_xor, _logic("^")),
    "not": OpSpec(1, "any", "same", np.invert, _not_cxx),
    "eq": OpSpec(2, "any", "bool", np.equal, _infix("==")),
    "ne": OpSpec(2, "any", "bool", np.not_equal, _infix("!=")),
    "lt": OpSpec(2, "any", "bool", np.less, _infix("<")),
    "le": OpSpec(2, "any", "bool", np.less_equal, _infix("<=")),
    "gt": OpSpec(2, "any", "bool", np.greater, _infix(">")),
    "ge": OpSpec(2, "any", "bool", np.greater_equal, _infix(">=")),
    "to_bool": OpSpec(1, "int32", "bool", lambda x: np.asarray(x) != 0, lambda d, a: f"({a[0]} != 0)"),
    "to_int32": OpSpec(1, "bool", "int32", lambda x: np.asarray(x, np.int32), lambda d, a: f"(int)({a[0]})"),
    # select(pred, on_false, on_true), the argument order of lax.select_n.
    "select": OpSpec(3, "select", "same", lambda p, f, t: np.where(p, t, f),
                     lambda d, a: f"({a[0]} ? {a[2]} : {a[1]})"),
}


def cxx_int_literal(value: int) -> str:
    """An int32 C++ literal; INT_MIN cannot be written as a negated literal (2147483648 is not an int)."""
    return "(-2147483647 - 1)" if value == INT32_MIN else str(value)


# Device helpers of the operations whose C++ operator would be undefined or different from XLA on some input.
CXX_HELPERS = r"""
__device__ __forceinline__ int fjm_add(int a, int b) { return (int)((unsigned)a + (unsigned)b); }
__device__ __forceinline__ int fjm_sub(int a, int b) { return (int)((unsigned)a - (unsigned)b); }
__device__ __forceinline__ int fjm_mul(int a, int b) { return (int)((unsigned)a * (unsigned)b); }
__device__ __forceinline__ int fjm_neg(int a) { return (int)(0u - (unsigned)a); }
__device__ __forceinline__ int fjm_abs(int a) { return a < 0 ? fjm_neg(a) : a; }
__device__ __forceinline__ int fjm_sign(int a) { return (a > 0) - (a < 0); }
// XLA's integer division: x / 0 = -1 and INT_MIN / -1 = INT_MIN; x % 0 = x and x % -1 = 0 (INT_MIN % -1 included).
__device__ __forceinline__ int fjm_div(int a, int b) {
  return b == 0 ? -1 : (b == -1 ? fjm_neg(a) : a / b);
}
__device__ __forceinline__ int fjm_rem(int a, int b) { return b == 0 ? a : (b == -1 ? 0 : a % b); }
// Shift amounts are read as unsigned, as XLA does: outside [0, 32) the bits are all shifted out.
__device__ __forceinline__ int fjm_shl(int a, int s) { return (unsigned)s >= 32u ? 0 : (int)((unsigned)a << s); }
__device__ __forceinline__ int fjm_shr_logical(int a, int s) {
  return (unsigned)s >= 32u ? 0 : (int)((unsigned)a >> s);
}
__device__ __forceinline__ int fjm_shr_arithmetic(int a, int s) {
  return (unsigned)s >= 32u ? (a < 0 ? -1 : 0) : (a >> s);
}
__device__ __forceinline__ int fjm_clamp_index(int i, int extent) {
  return i < 0 ? 0 : (i >= extent ? extent - 1 : i);
}
"""

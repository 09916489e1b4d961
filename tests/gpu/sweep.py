"""Random kernel-vs-reference configurations, shared by the pytest sweep and the compute-sanitizer run."""
from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import flashjax

# Relative-norm tolerances against the f32 reference (docs/design.md §5); gradients get twice the forward's.
TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """One kernel-vs-reference case, built by keyword: Config(dtype="bfloat16", batch=1, seqlen_q=..., seqlen_k=...,
    heads_q=..., heads_k=..., head_dim=..., causal=True). head_dim_v defaults to head_dim."""
    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_k: int
    head_dim: int
    head_dim_v: int | None = None
    causal: bool = False
    window_size: tuple = (-1, -1)
    sinks: bool = False
    softcap: float = 0.0
    deterministic: bool = False

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    def __str__(self):
        return (f"{self.dtype} B{self.batch} Sq{self.seqlen_q} Sk{self.seqlen_k} H{self.heads_q}/{self.heads_k} "
                f"D{self.head_dim}/{self.head_dim_v} causal={self.causal} window={self.window_size} "
                f"sinks={self.sinks} softcap={self.softcap}" + (" deterministic" if self.deterministic else ""))


def _length(rng):
    """Lengths across every regime, never a multiple of 64 (ragged tiles are the point)."""
    regime = rng.random()
    if regime < 0.03:
        return 0
    n = int(rng.integers(1, 130) if regime < 0.45 else rng.integers(1, 1100) if regime < 0.85
            else rng.integers(1100, 4097))
    return n + 1 if n % 64 == 0 else n


def random_config(rng) -> Config:
    heads_k = int(rng.choice([1, 2, 4]))
    ratio = int(rng.choice([1, 2, 4, 8]))
    def width():  # any width 1..256 (padded to a compiled one by the library), a multiple of 8 three times in four
        return int(rng.integers(1, 33)) * 8 if rng.random() < 0.75 else int(rng.integers(1, 257))
    head_dim = width()
    head_dim_v = head_dim if rng.random() < 0.8 else width()
    seqlen_q, seqlen_k = _length(rng), _length(rng)
    batch = int(rng.integers(1, 5))
    # Keep each case small enough that the f32 reference (which materializes scores) stays fast.
    while batch > 1 and batch * heads_k * ratio * seqlen_q * seqlen_k > 2**26:
        batch -= 1
    while heads_k * ratio > 1 and batch * heads_k * ratio * seqlen_q * seqlen_k > 2**26:
        ratio = max(1, ratio // 2) if ratio > 1 else ratio
        heads_k = heads_k // 2 if ratio == 1 and heads_k > 1 else heads_k
    window = (-1, -1)
    if rng.random() < 0.35:
        def side():
            r = rng.random()
            return -1 if r < 0.25 else int(rng.integers(0, 16)) if r < 0.6 else int(rng.integers(0, 5000))
        window = (side(), side())
    return Config(dtype=str(rng.choice(["bfloat16", "float16"])), batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                  heads_q=heads_k * ratio, heads_k=heads_k, head_dim=head_dim, head_dim_v=head_dim_v,
                  causal=bool(rng.random() < 0.35), window_size=window, sinks=bool(rng.random() < 0.3),
                  softcap=float(rng.choice([0.0, 0.0, 0.0, 5.0, 30.0])))


def make_inputs(cfg: Config, rng):
    dtype = jnp.dtype(cfg.dtype)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    q = normal(cfg.batch, cfg.seqlen_q, cfg.heads_q, cfg.head_dim)
    k = normal(cfg.batch, cfg.seqlen_k, cfg.heads_k, cfg.head_dim)
    v = normal(cfg.batch, cfg.seqlen_k, cfg.heads_k, cfg.head_dim_v)
    sinks = jnp.asarray(rng.standard_normal(cfg.heads_q), jnp.float32) if cfg.sinks else None
    d_out = normal(cfg.batch, cfg.seqlen_q, cfg.heads_q, cfg.head_dim_v)
    d_lse = jnp.asarray(rng.standard_normal((cfg.batch, cfg.heads_q, cfg.seqlen_q)), jnp.float32)
    return q, k, v, sinks, d_out, d_lse


def run(cfg: Config, inputs, backend: str):
    """out, lse and the gradients (dq, dk, dv, dsinks) for cotangents (d_out, d_lse), under jit."""
    q, k, v, sinks, d_out, d_lse = inputs
    if backend == "reference":  # the spec runs in f32 on the same (rounded) inputs
        q, k, v, d_out = (x.astype(jnp.float32) for x in (q, k, v, d_out))

    def attention(q, k, v, sinks):
        return flashjax.flash_attn(q, k, v, causal=cfg.causal, window_size=cfg.window_size, sinks=sinks,
                                   softcap=cfg.softcap, return_lse=True, deterministic=cfg.deterministic,
                                   backend=backend)

    @jax.jit
    def fwd_bwd(q, k, v, sinks, d_out, d_lse):
        (out, lse), vjp = jax.vjp(attention, q, k, v, sinks)
        # Empty rows have lse = -inf: their lse cotangent is irrelevant, keep it finite.
        grads = vjp((d_out.astype(out.dtype), jnp.where(jnp.isfinite(lse), d_lse, 0.0)))
        return out, lse, grads

    if backend == "reference":
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fwd_bwd(q, k, v, sinks, d_out, d_lse)
    return fwd_bwd(q, k, v, sinks, d_out, d_lse)


def rel_err(got, want, denom=None):
    """||got - want|| / denom, denom defaulting to ||want|| (the plain difference when that is 0)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    if not np.all(np.isfinite(got)):
        return float("nan")
    if denom is None:
        denom = np.linalg.norm(want)
    num = np.linalg.norm(got - want)
    return float(num / denom) if denom > 0 else float(num)


def dsinks_scale(cfg: Config, inputs, reference):
    """Per head, the sum of the magnitudes of the terms that make up dsinks.

    dsinks_h = sum over the head's rows of p_sink * (d_lse - D'), p_sink = exp(sink_h - lse), D' = rowsum(dO * O):
    a sum of many terms of both signs. Kernels form D' from the rounded output (as FlashAttention does), an error
    relative to rowsum(|dO * O|), so an honest error measure for dsinks divides by the same sum of magnitudes; the
    plain relative error blows up whenever the signed sum happens to cancel (few rows, one head).
    """
    _, _, _, sinks, d_out, d_lse = inputs
    out_r, lse_r, _ = reference
    lse = np.asarray(lse_r, np.float64)  # [B, H, Sq]
    p_sink = np.where(np.isfinite(lse), np.exp(np.asarray(sinks, np.float64)[None, :, None] - lse), 0.0)
    d_o = np.asarray(d_out.astype(jnp.float32), np.float64)
    o = np.asarray(out_r, np.float64)
    terms = np.abs(np.asarray(d_lse, np.float64)) + np.einsum("bshd,bshd->bhs", np.abs(d_o), np.abs(o))
    return np.sum(p_sink * terms, axis=(0, 2))


def compare(cfg: Config, kernel, reference, inputs=None) -> dict[str, float]:
    """Relative errors per output; lse compared on finite entries after checking -inf sits in the same places.

    With `inputs`, dsinks' error is measured against dsinks_scale instead of |dsinks| (see there)."""
    out_k, lse_k, grads_k = kernel
    out_r, lse_r, grads_r = reference
    lse_k, lse_r = np.asarray(lse_k), np.asarray(lse_r)
    errors = {"out": rel_err(out_k, out_r)}
    same_inf = np.array_equal(np.isneginf(lse_k), np.isneginf(lse_r)) and not np.any(np.isnan(lse_k))
    finite = np.isfinite(lse_r)
    errors["lse"] = rel_err(lse_k[finite], lse_r[finite]) if same_inf else float("nan")
    for name, g_k, g_r in zip(("dq", "dk", "dv"), grads_k, grads_r):
        errors[name] = rel_err(g_k, g_r)
    if cfg.sinks:
        scale = np.linalg.norm(dsinks_scale(cfg, inputs, reference)) if inputs is not None else 0.0
        errors["dsinks"] = rel_err(grads_k[3], grads_r[3], scale if scale > 0 else None)
    return errors


def check(cfg: Config, errors: dict[str, float]) -> list[str]:
    tol = TOLERANCE[cfg.dtype]
    bad = []
    for name, err in errors.items():
        limit = tol if name in ("out", "lse") else 2 * tol
        if not err <= limit:  # NaN never passes
            bad.append(f"{name} rel err {err:.3g} > {limit:g}")
    return bad


def assert_grads_repeat(first, rerun, what, repeats=4):
    """deterministic=True: `repeats` more runs (rerun() -> (out, lse, grads)) give the gradients of `first` bit for
    bit."""
    first_grads = [np.asarray(g) for g in first[2] if g is not None]
    for repeat in range(repeats):
        grads = [np.asarray(g) for g in rerun()[2] if g is not None]
        for name, a, b in zip(("dq", "dk", "dv", "dsinks"), first_grads, grads):
            assert a.tobytes() == b.tobytes(), f"{what}: {name} differs in run {repeat + 2}"


def special_value_errors(name, got, want, limit, denominator=None):
    """Where `got` differs from `want` in its NaN or +-inf positions, or in its finite entries beyond `limit`."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return [f"{name}: shape {got.shape} != {want.shape}"]
    bad = []
    for what, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        differ = test(got) != test(want)
        if differ.any():
            bad.append(f"{name}: {what} at {int(differ.sum())} entries where the reference differs (first at "
                       f"{tuple(int(i) for i in np.argwhere(differ)[0])}: got {got[differ][0]}, want {want[differ][0]})")
    finite = np.isfinite(want) & np.isfinite(got)
    err = rel_err(got[finite], want[finite], denominator)
    if not err <= limit:
        bad.append(f"{name}: finite entries rel err {err:.3g} > {limit:g}")
    return bad


# ------------------------------------------------------------------------- forward mode (tests/gpu/test_jvp.py)
def make_tangent_inputs(cfg, rng, sinks_value=None):
    """Primals (q, k, v, sinks) and random tangents for each (sinks' tangent f32, when the call has sinks)."""
    q, k, v, sinks, _, _ = make_inputs(cfg, rng)
    if sinks_value is not None:
        sinks = sinks.at[1].set(sinks_value)
    dtype = jnp.dtype(cfg.dtype)
    tq, tk, tv = (jnp.asarray(rng.standard_normal(x.shape), dtype) for x in (q, k, v))
    ts = jnp.asarray(rng.standard_normal(sinks.shape), jnp.float32) if sinks is not None else None
    return (q, k, v, sinks), (tq, tk, tv, ts)


def attention(cfg, backend):
    def f(q, k, v, sinks):
        return flashjax.flash_attn(q, k, v, causal=cfg.causal, window_size=cfg.window_size, sinks=sinks,
                                   softcap=cfg.softcap, return_lse=True, backend=backend)
    return f


def _without_absent_sinks(primals, tangents):
    """The arguments jax.jvp differentiates: sinks (and their tangent) only where the call has them."""
    n = 4 if primals[3] is not None else 3
    return primals[:n], tangents[:n]


def run_jvp(cfg, primals, tangents, backend):
    """(out, lse), (t_out, t_lse) under jit; the reference in f32 on the same rounded values."""
    if backend == "reference":
        primals = tuple(x if x is None else x.astype(jnp.float32) for x in primals)
        tangents = tuple(x if x is None else x.astype(jnp.float32) for x in tangents)
    f = attention(cfg, backend)
    p, t = _without_absent_sinks(primals, tangents)
    g = (lambda *a: f(*a)) if len(p) == 4 else (lambda q, k, v: f(q, k, v, None))
    with warnings.catch_warnings():  # the reference backend warns that it is the reference
        warnings.simplefilter("ignore")
        return jax.jit(lambda p, t: jax.jvp(g, p, t))(p, t)


def jvp_errors(cfg, kernel, reference, skip_lse_heads=()):
    """Special-value positions and relative errors of out, lse, t_out, t_lse; t_lse on the rows whose reference lse
    is finite (an empty row's lse is -inf, its tangent 0 on both paths: checked apart)."""
    (out_k, lse_k), (t_out_k, t_lse_k) = kernel
    (out_r, lse_r), (t_out_r, t_lse_r) = reference
    tol = TOLERANCE[cfg.dtype]
    bad = special_value_errors("out", out_k, out_r, tol) + special_value_errors("lse", lse_k, lse_r, tol)
    bad += special_value_errors("t_out", t_out_k, t_out_r, 2 * tol)
    t_lse_k, t_lse_r, lse_r = (np.array(x, np.float64) for x in (t_lse_k, t_lse_r, lse_r))
    for head in skip_lse_heads:
        t_lse_k[:, head] = t_lse_r[:, head] = 0.0
    empty = np.isneginf(lse_r)
    if np.any(t_lse_k[empty] != 0.0):
        bad.append("t_lse is not 0 on rows with no visible key")
    bad += special_value_errors("t_lse", np.where(empty, 0.0, t_lse_k), np.where(empty, 0.0, t_lse_r), 2 * tol)
    return bad

"""Bases for gradient low-rank projection (GaLore, Fira, APOLLO): pure functions, torch only.

Notation (Zhao et al. 2024): a weight W and its gradient G are m x n (out x in); r is the rank.

* Right projection (used when m >= n): the basis P is r x n with orthonormal rows,
  R = G P^T is m x r and the way back is back(N) = N P.
* Left projection (used when m < n): the basis P is m x r with orthonormal columns,
  R = P^T G is r x n and back(N) = P N.
* Full (two-sided) projection: P_L is m x r, P_R is r x n, R = P_L^T G P_R^T is r x r and
  back(N) = P_L N P_R. Both factors live in ONE tensor so that optimizer state stays a single
  tensor per parameter: the packed basis is [P_L^T | P_R], shape r x (m + n).

So the basis always has shape `basis_shape(...)` and the projected gradient `low_rank_shape(...)`;
`project` / `project_back` apply them. Bases are computed in fp32 and returned in fp32; callers
store them in whatever dtype they like (the optimizers store the parameter dtype, like galore-torch).

Methods (`method` argument, the optimizers' ``basis`` group key):

* ``"svd"``: thin SVD of G (``torch.linalg.svd(full_matrices=False)``), top-r singular vectors;
  numerically the same basis galore-torch and fira compute.
* ``"randomized_svd"``: Halko, Martinsson and Tropp (2011), Alg. 4.4: a Gaussian sketch with
  k = r + p columns (p = `oversample`), `power_iters` (q) rounds of subspace iteration
  (pivoted-LU normalisation between rounds, Householder QR for the returned orthonormal
  columns), the last round finished by Rayleigh-Ritz on the other side of G, which saves one of
  Halko's products, usually through a QR's R factor alone (see `_randomized_left_vectors`);
  the top-r vectors come from the eigenvectors of a small k x k Gram. With `prev` (the
  previous basis) the sketch starts from it (warm start) and only the p extra columns are
  random. The Gaussian draws come from a CPU ``torch.Generator`` seeded by
  ``mix_seed(seed, refresh)`` (`gaussian`), so a basis is reproducible from
  (G, seed, refresh, prev) and its sketch is the same on any hardware. Defaults p = 8, q = 1:
  within 1% of the exact basis's captured energy on power-law spectra at a fraction of the SVD's
  cost (benchmarks/optimizer_step.py).
* ``"random"``: APOLLO's projection (Zhu et al. 2024): i.i.d. N(0, 1/r) entries drawn from a
  generator seeded by ``mix_seed(seed, refresh)``. It is a Johnson-Lindenstrauss map
  (E[P^T P] = I for the right side), NOT orthonormal, and never needs storing: it is regenerated
  from (seed, refresh), drawn by a CPU generator and moved to the gradient's device, so it is the
  same on every device (`gaussian`; a CUDA generator would give another stream, and another
  again on another GPU model).
* ``"identity"``: the first r coordinate axes; with r = min(m, n) projection is the identity, which
  is how the tests check that an optimizer reduces to plain AdamW.

Random draws (`gaussian`): every Gaussian that defines a basis is drawn on the CPU from a CPU
``torch.Generator`` (`cpu_generator`) and copied to the device, so a run, its resume on other
hardware and the CPU-vs-CUDA numerics check draw the same values. For a basis redrawn every step
from the same seed (APOLLO, GoLore after its switch) on a non-CPU device, the CPU draw is held
(pinned) per parameter until its seed changes (`held_on_host`), so the CPU draws once per refresh
and the step only copies.

Failure policy (`compute_basis`): if G holds inf/nan, or the decomposition raises or returns a
non-finite basis, the previous basis `prev` is returned unchanged (None when there is none), the
failure is counted (``stats.failed`` and the module counter `failed_refreshes()`), and a warning is
issued once per process.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from optimizers.precision import full_fp32

PROJ_TYPES: tuple[str, ...] = ("std", "reverse_std", "right", "left", "full")
"""galore-torch's ``proj_type`` values. std: right if m >= n else left; reverse_std: the opposite;
right / left: always that side; full: both sides (r x r core)."""

METHODS: tuple[str, ...] = ("randomized_svd", "svd", "random", "identity")
"""Ways to compute a basis (the optimizers' ``basis`` group key)."""

DEFAULT_OVERSAMPLE: int = 8
"""Default p: extra sketch columns of randomized_svd (k = r + p). See benchmarks/optimizer_step.py."""

DEFAULT_POWER_ITERS: int = 1
"""Default q: subspace-iteration rounds of randomized_svd. See benchmarks/optimizer_step.py."""

_MIN_PIVOT: float = 1e-4
"""Smallest |R_ii| / max |R_ii| of W's R factor for which randomized_svd applies R^{-1} to A W
instead of forming W's Q (see `_randomized_left_vectors`): at 1e-4 the captured energy matches
the formed-Q path's to ~1e-5 of the exact basis's on power-law spectra."""

_MASK64 = (1 << 64) - 1
_failed_total = 0
_warned = False


@dataclass
class RefreshStats:
    """Counters `compute_basis` updates when given one (the optimizers keep one each).

    Attributes:
        count: successful basis computations.
        seconds: cumulative wall time inside `compute_basis` (host time; on an accelerator the
            linear-algebra calls synchronise, so it is close to device time).
        failed: refreshes that kept the previous basis (non-finite gradient or a raised error).
    """

    count: int = 0
    seconds: float = 0.0
    failed: int = 0


def failed_refreshes() -> int:
    """Process-wide number of failed basis computations (all callers)."""
    return _failed_total


def reset_failure_warning() -> None:
    """Re-arms the warn-once flag (tests use it; training code never needs to)."""
    global _warned
    _warned = False


def mix_seed(seed: int, counter: int) -> int:
    """Derives a 63-bit generator seed from (seed, counter) with the splitmix64 finaliser.

    Nearby inputs (refresh 1, 2, 3...) give unrelated seeds, so successive random bases and
    sketches are independent while staying reproducible from two integers.

    Args:
        seed: base seed (a parameter's seed).
        counter: the refresh count k (or a parameter index when deriving per-parameter seeds).

    Returns:
        An int in [0, 2^63) accepted by ``torch.Generator.manual_seed``.
    """
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(counter) + 0x632BE59BD9B4E019) & _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x & ((1 << 63) - 1)


def cpu_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with `seed`: the source of every draw that defines a basis.

    CPU and CUDA generators give different streams for one seed (and the CUDA stream of
    ``randn`` depends on the launch configuration, so on the GPU model), so a draw made on the
    device would change a method's state with the hardware. Drawing on the CPU and copying
    (`gaussian`) keeps it a function of the seed alone.
    """
    return torch.Generator(device="cpu").manual_seed(int(seed))


def gaussian(
    shape: tuple[int, ...],
    generator: torch.Generator,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """i.i.d. N(0, 1) entries of `shape`, drawn on the CPU from `generator` and moved to `device`.

    The values depend on the generator's state alone, never on `device`: a run draws the same
    bases on any hardware (on the CPU the copy is a no-op, so the values are exactly a plain
    ``torch.randn(shape, generator=generator)``'s).

    Raises:
        ValueError: `generator` is not a CPU generator.
    """
    if generator.device.type != "cpu":
        raise ValueError(f"bases are drawn from a CPU generator, got one on {generator.device}")
    # device="cpu" explicitly: under a default-device context (torch.device("cuda")) it would not be.
    return torch.randn(shape, generator=generator, dtype=dtype, device="cpu").to(device)


# CPU draws of the bases redrawn every step (`held_on_host`), kept while their holder (a
# parameter) lives: (key, pinned CPU tensor) per holder.
_held_draws: WeakIdKeyDictionary = WeakIdKeyDictionary()


def held_on_host(
    holder: torch.Tensor | None,
    key: tuple,
    make: Callable[[], torch.Tensor],
    *,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``make()`` (a CPU draw) moved to `device`.

    For a non-CPU `device` and a `holder` (the parameter the draw belongs to), the CPU tensor is
    kept, pinned where CUDA is available, for as long as the holder lives and asks with the same
    `key` (everything the draw depends on), and each call only copies it: a basis regenerated
    every step from the same seed (APOLLO; GoLore after its switch) costs one CPU draw per refresh
    instead of one per step. On the CPU nothing is kept (the draw is the tensor: holding it would
    be storing the basis). The values are ``make()``'s either way.
    """
    device = torch.device(device)
    if holder is None or device.type == "cpu":
        return make().to(device)
    held = _held_draws.get(holder)
    if held is None or held[0] != key:
        host = make()
        if device.type == "cuda" and torch.cuda.is_available():
            host = host.pin_memory()
        held = (key, host)
        _held_draws[holder] = held
    return held[1].to(device, non_blocking=True)


def choose_side(shape: tuple[int, ...], proj_type: str = "std") -> str:
    """Which side galore-torch projects a gradient of `shape` on, for its `proj_type`.

    Args:
        shape: (m, n) of the weight / gradient.
        proj_type: one of `PROJ_TYPES`.

    Returns:
        "right" (R = G P^T), "left" (R = P^T G) or "full" (R = P_L^T G P_R^T).
    """
    if len(shape) != 2:
        raise ValueError(f"projection needs a 2-D matrix, got shape {tuple(shape)}")
    m, n = shape
    if proj_type == "std":
        return "right" if m >= n else "left"
    if proj_type == "reverse_std":
        return "left" if m >= n else "right"
    if proj_type in ("right", "left", "full"):
        return proj_type
    raise ValueError(f"unknown proj_type {proj_type!r}; choose one of {', '.join(PROJ_TYPES)}")


def effective_rank(shape: tuple[int, ...], rank: int, method: str = "svd") -> int:
    """The rank r actually used: min(rank, m, n) for decompositions, `rank` for random maps.

    A thin SVD has only min(m, n) singular vectors, so asking for more truncates (as galore-torch
    does by slicing); a random JL map has no such limit.
    """
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if method == "random":
        return int(rank)
    return int(min(rank, shape[0], shape[1]))


def basis_shape(shape: tuple[int, ...], rank: int, side: str, method: str = "svd") -> tuple[int, int]:
    """Shape of the basis tensor: (r, n) right, (m, r) left, (r, m + n) full (packed)."""
    m, n = shape
    r = effective_rank(shape, rank, method)
    if side == "right":
        return (r, n)
    if side == "left":
        return (m, r)
    if side == "full":
        return (r, m + n)
    raise ValueError(f"side must be 'left', 'right' or 'full', got {side!r}")


def low_rank_shape(shape: tuple[int, ...], rank: int, side: str, method: str = "svd") -> tuple[int, int]:
    """Shape of R (and of the low-rank Adam moments): (m, r) right, (r, n) left, (r, r) full."""
    m, n = shape
    r = effective_rank(shape, rank, method)
    return {"right": (m, r), "left": (r, n), "full": (r, r)}[side]


@full_fp32()
def project(grad: torch.Tensor, basis: torch.Tensor, side: str) -> torch.Tensor:
    """R = G P^T (right), P^T G (left) or P_L^T G P_R^T (full, packed basis).

    Args:
        grad: G, m x n.
        basis: P in the layout of `basis_shape`; same dtype as `grad`.
        side: "right", "left" or "full".
    """
    if side == "right":
        return torch.mm(grad, basis.t())  # torch.mm: the @ operator adds a Python-level wrapper
    if side == "left":
        return torch.mm(basis.t(), grad)
    m = grad.shape[0]
    return (basis[:, :m] @ grad) @ basis[:, m:].t()


@full_fp32()
def project_back(low: torch.Tensor, basis: torch.Tensor, side: str, m: int | None = None) -> torch.Tensor:
    """back(N) = N P (right), P N (left) or P_L N P_R (full): the map from R's space to G's.

    Args:
        low: N, shaped like R.
        basis: P in the layout of `basis_shape`.
        side: "right", "left" or "full".
        m: rows of the weight; needed for "full" only, to split the packed [P_L^T | P_R].
    """
    if side == "right":
        return low @ basis
    if side == "left":
        return basis @ low
    if m is None:
        raise ValueError("project_back(side='full') needs m, the weight's row count")
    return (basis[:, :m].t() @ low) @ basis[:, m:]


@full_fp32()
def svd_basis(g32: torch.Tensor, rank: int, side: str) -> torch.Tensor:
    """Exact top-r singular vectors of fp32 G via a thin SVD (what galore-torch computes).

    Returns:
        P in the layout of `basis_shape` (fp32).
    """
    u, _, vh = torch.linalg.svd(g32, full_matrices=False)
    r = effective_rank(tuple(g32.shape), rank)
    if side == "right":
        return vh[:r].contiguous()
    if side == "left":
        return u[:, :r].contiguous()
    return torch.cat([u[:, :r].t(), vh[:r]], dim=1).contiguous()


def _finite(x: torch.Tensor) -> bool:
    # A sum is non-finite iff some entry is (barring overflow): one reduction, no boolean mask.
    return bool(torch.isfinite(x.sum()))


def _lu_normalize(y: torch.Tensor) -> torch.Tensor:
    """Y U^{-1} from Y = P L U: same span as Y, well-conditioned columns (= P L, |L_ij| <= 1).

    The cheap normaliser between power steps (as scikit-learn's): a pivoted LU and one triangular
    solve cost about half a Householder QR of the same tall matrix on CPU. Not finite when Y is
    rank deficient (a zero pivot); `_span_normalize` then falls back to QR.
    """
    lu, _, _ = torch.linalg.lu_factor_ex(y)  # no error check: a zero pivot surfaces as inf/nan
    k = y.shape[1]
    return torch.linalg.solve_triangular(lu[:k, :k].triu(), y, upper=True, left=False)


def _span_normalize(y: torch.Tensor) -> torch.Tensor:
    """`_lu_normalize`, or a QR when that is not finite (rank-deficient Y)."""
    z = _lu_normalize(y)
    return z if _finite(z) else _orth(y)


def _orth(y: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning Y (Householder QR: orthonormal even when Y is rank deficient)."""
    return torch.linalg.qr(y, mode="reduced")[0]


def _top_left(c: torch.Tensor, r: int) -> torch.Tensor:
    """Top-r left singular vectors of a tall-or-square C (rows x k, k small), orthonormal.

    From the k x k Gram: C V = U S with V the top eigenvectors of C^T C; the columns of C V are
    orthogonal in exact arithmetic and are re-orthonormalised by one QR (which keeps their
    order, so column i still points along the i-th singular direction).
    """
    _, evecs = torch.linalg.eigh(c.t() @ c)  # fp32: the Gram of a k-column block; ascending
    return _orth(c @ evecs[:, -r:].flip(1))


def _randomized_left_vectors(
    a: torch.Tensor,
    r: int,
    oversample: int,
    power_iters: int,
    generator: torch.Generator,
    init: torch.Tensor | None,
) -> torch.Tensor:
    """Top-r left singular vectors of `a` (rows x cols) by randomized subspace iteration.

    Sketch: Y = A Omega (Omega cols x k Gaussian, k = r + p), or with `init` (rows x r0, the
    previous basis, orthonormal) Y = [init | A Omega'] where only the k - r0 extra columns are
    random: the previous subspace already holds most of the new one when gradients drift.

    q = `power_iters` rounds of subspace iteration follow (Halko et al. 2011, Alg. 4.4). The
    last round ends with Rayleigh-Ritz on the right-hand side instead of Halko's left-hand one:
    W = A^T norm(Y), U = the top-r left singular vectors of A Q_W (Q_W: orthonormal columns
    spanning W). range(A Q_W) is the subspace Halko's round gives, and A W costs the product
    that his B = Q^T A would; the product he spends forming Y = A W before it is saved. So a
    cold start costs 2q + 1 products with A, a warm start 2q plus one with p columns. Q_W is
    usually not formed: Householder's R factor (W = Q_W R) gives A Q_W = (A W) R^{-1}, a
    triangular solve on the rows x k product, which costs less than forming the cols x k Q_W
    (5-10% of a refresh at the LLaMA shapes). The solve amplifies rounding by about cond(R),
    of which max |R_ii| / min |R_ii| is a cheap lower estimate, so it is used only while that
    ratio stays below 1 / `_MIN_PIVOT`; a steeper spectrum or a rank-deficient W (a low-rank or
    zero gradient) forms Q_W from the same reflectors instead. With q = 0 the sketch itself is
    the subspace: U = top-r left singular vectors of Q Q^T A, Q = orth(Y) (one more product).
    """
    rows, cols = a.shape
    k = min(r + max(int(oversample), 0), rows, cols)
    blocks = []
    if init is not None:
        init = init[:, :k]
        blocks.append(init)
    extra = k - (init.shape[1] if init is not None else 0)
    if extra > 0:
        omega = gaussian((cols, extra), generator, device=a.device, dtype=a.dtype)
        blocks.append(a @ omega)
    y = torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]
    if int(power_iters) <= 0:
        q = _orth(y)
        bt = a.t() @ q  # B^T = (Q^T A)^T, cols x k
        evals, evecs = torch.linalg.eigh(bt.t() @ bt)
        return q @ evecs[:, torch.argsort(evals, descending=True)[:r]]
    for _ in range(int(power_iters) - 1):
        # One normalisation per round suffices: a single product with A^T A grows cond(Y) by
        # (sigma_1 / sigma_k)^2 at most, which the LU absorbs.
        y = a @ (a.t() @ _span_normalize(y))
    w = a.t() @ _span_normalize(y)
    # W = Q R (Householder). A well-conditioned R gives A Q = (A W) R^{-1} without forming Q.
    reflectors, tau = torch.geqrf(w)
    upper = reflectors[:k].triu()
    diag = upper.diagonal().abs()
    if bool(diag.min() > _MIN_PIVOT * diag.max()):
        return _top_left(torch.linalg.solve_triangular(upper, a @ w, upper=True, left=False), r)
    return _top_left(a @ torch.linalg.householder_product(reflectors, tau), r)


@full_fp32()
def randomized_svd_basis(
    g32: torch.Tensor,
    rank: int,
    side: str,
    *,
    oversample: int = DEFAULT_OVERSAMPLE,
    power_iters: int = DEFAULT_POWER_ITERS,
    generator: torch.Generator | None = None,
    prev: torch.Tensor | None = None,
) -> torch.Tensor:
    """Approximate top-r singular vectors of fp32 G (Halko randomized SVD), layout of `basis_shape`.

    Args:
        g32: G (m x n), fp32.
        rank: r.
        side: "right" (returns V_r^T, r x n), "left" (U_r, m x r) or "full" (packed).
        oversample: p, extra sketch columns; k = r + p.
        power_iters: q, subspace-iteration rounds (each costs two products with G and two LUs).
        generator: source of the Gaussian sketch, a CPU generator (`cpu_generator`; seeded 0 when
            None): the sketch is drawn on the CPU and copied to G's device (`gaussian`).
        prev: previous basis in the same layout (any dtype) for a warm start, or None.

    Cost: 2q + 1 products of G with a k-column block (2 m n k flops each; a warm start replaces
    one by a product with p columns) plus O((m + n) k^2) for LUs, QRs and the Gram, and O(k^3)
    for a k x k eigh: against O(m n min(m, n)) with a large constant for the exact SVD.
    """
    if generator is None:
        generator = cpu_generator(0)
    m, n = g32.shape
    r = effective_rank((m, n), rank)
    p32 = None if prev is None else prev.to(device=g32.device, dtype=torch.float32)
    if side == "right":
        init = None if p32 is None else p32.t()
        v = _randomized_left_vectors(g32.t(), r, oversample, power_iters, generator, init)
        return v.t().contiguous()
    if side == "left":
        return _randomized_left_vectors(g32, r, oversample, power_iters, generator, p32).contiguous()
    if side == "full":
        init_l = None if p32 is None else p32[:, :m].t()
        init_r = None if p32 is None else p32[:, m:].t()
        u = _randomized_left_vectors(g32, r, oversample, power_iters, generator, init_l)
        v = _randomized_left_vectors(g32.t(), r, oversample, power_iters, generator, init_r)
        return torch.cat([u.t(), v.t()], dim=1).contiguous()
    raise ValueError(f"side must be 'left', 'right' or 'full', got {side!r}")


def gaussian_basis(
    shape: tuple[int, ...],
    rank: int,
    side: str,
    generator_seed: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    holder: torch.Tensor | None = None,
) -> torch.Tensor:
    """A Gaussian projection with N(0, 1/r) entries drawn from a CPU generator seeded with
    `generator_seed`, in `dtype` on `device`.

    The one drawing code path of every seeded random basis: `random_basis` (the (seed, refresh)
    stream) and the optimizers' random-basis policies (which may chain their own seeds, as
    apollo-torch's stream does) all end here. The fp32 N(0, 1) draw (`gaussian`), its division by
    sqrt(r) and the cast to `dtype` all run on the CPU, and the result is copied: the same values
    on every device.

    Args:
        shape: (m, n) of the gradient.
        rank: r (not clamped: a JL map may have any width).
        side: "right" (r x n) or "left" (m x r); "full" is not defined for random maps.
        generator_seed: seed of the CPU generator (`cpu_generator`).
        device: where the basis is returned (the values do not depend on it).
        dtype: the basis's dtype (the parameter's).
        holder: the parameter whose basis this is: on a non-CPU device the CPU result is kept
            until the seed changes (`held_on_host`), so a basis redrawn every step is drawn once.
    """
    if side == "full":
        raise ValueError(
            "random projection supports side 'left' or 'right' only (proj_type 'full' is not defined)"
        )
    bshape = basis_shape(shape, rank, side, "random")

    def make() -> torch.Tensor:
        return (gaussian(bshape, cpu_generator(generator_seed)) / math.sqrt(rank)).to(dtype)

    return held_on_host(holder, ("gaussian_basis", int(generator_seed), bshape, dtype), make, device=device)


def random_basis(
    shape: tuple[int, ...],
    rank: int,
    side: str,
    *,
    seed: int,
    refresh: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """APOLLO's Gaussian projection, entries N(0, 1/r) (fp32), regenerated from (seed, refresh).

    Basis k of a parameter with seed s is `gaussian_basis` drawn from ``mix_seed(s, k)``: independent
    of how many bases came before, reproducible from two integers.

    Args:
        shape: (m, n) of the gradient.
        rank: r (not clamped: a JL map may have any width).
        side: "right" (r x n) or "left" (m x r); "full" is not defined for random maps.
        seed: the parameter's seed.
        refresh: k, the refresh count.
        device: where the basis is returned (drawn on the CPU: the values do not depend on it).
    """
    return gaussian_basis(shape, rank, side, mix_seed(seed, refresh), device=device)


def identity_basis(
    shape: tuple[int, ...], rank: int, side: str, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The first r coordinate axes in the layout of `basis_shape` (identity when r = min(m, n))."""
    m, n = shape
    r = effective_rank(shape, rank)
    if side == "right":
        return torch.eye(r, n, device=device)
    if side == "left":
        return torch.eye(m, r, device=device)
    return torch.cat([torch.eye(r, m, device=device), torch.eye(r, n, device=device)], dim=1)


def _fail(prev: torch.Tensor | None, stats: RefreshStats | None, why: str) -> torch.Tensor | None:
    global _failed_total, _warned
    _failed_total += 1
    if stats is not None:
        stats.failed += 1
    if not _warned:
        _warned = True
        warnings.warn(
            f"projection basis refresh failed ({why}); keeping the previous basis. "
            "Further failures are counted (optimizer.failed_refreshes) but not warned again.",
            RuntimeWarning,
            stacklevel=3,
        )
    return prev


def _decompose(
    g32: torch.Tensor,
    rank: int,
    side: str,
    method: str,
    sketch: torch.Tensor | None,
    seed: int,
    refresh: int,
    oversample: int,
    power_iters: int,
) -> torch.Tensor:
    """The SVD-based bases of `compute_basis` on a finite fp32 G: the exact thin SVD's, or the
    randomized one drawn from ``mix_seed(seed, refresh)`` (started from `sketch` when given)."""
    if method == "svd":
        return svd_basis(g32, rank, side)
    gen = cpu_generator(mix_seed(seed, refresh))
    return randomized_svd_basis(
        g32, rank, side, oversample=oversample, power_iters=power_iters, generator=gen, prev=sketch
    )


def _check_basis_args(grad: torch.Tensor, method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown basis method {method!r}; choose one of {', '.join(METHODS)}")
    if grad.ndim != 2:
        raise ValueError(f"projection needs a 2-D gradient, got shape {tuple(grad.shape)}")


@full_fp32()
def compute_basis(
    grad: torch.Tensor,
    rank: int,
    side: str,
    method: str = "randomized_svd",
    prev: torch.Tensor | None = None,
    *,
    seed: int = 0,
    refresh: int = 0,
    oversample: int = DEFAULT_OVERSAMPLE,
    power_iters: int = DEFAULT_POWER_ITERS,
    warm_start: bool = True,
    stats: RefreshStats | None = None,
) -> torch.Tensor | None:
    """The one entry point: a rank-r basis for gradient G, computed in fp32, returned in fp32.

    Args:
        grad: G, m x n, any float dtype (converted to fp32 for the decomposition).
        rank: r.
        side: "right" | "left" | "full" (see `choose_side`).
        method: one of `METHODS`.
        prev: the basis in use (layout of `basis_shape`), returned as-is on failure and used as the
            warm-start sketch of randomized_svd when `warm_start`.
        seed: the parameter's seed (random and randomized_svd draw from ``mix_seed(seed, refresh)``).
        refresh: k, index of the basis being computed.
        oversample, power_iters: p and q of randomized_svd.
        warm_start: start randomized_svd from `prev` when given.
        stats: counters to update (count, seconds, failed), or None.

    Returns:
        The new basis (fp32, contiguous); or `prev` (the same object, possibly None) when G is not
        finite or the decomposition fails. The random method never reads G's values, so it never fails.
    """
    _check_basis_args(grad, method)
    t0 = time.perf_counter()
    shape = tuple(grad.shape)
    try:
        if method == "random":
            out = random_basis(shape, rank, side, seed=seed, refresh=refresh, device=grad.device)
        elif method == "identity":
            out = identity_basis(shape, rank, side, device=grad.device)
        else:
            g32 = grad.detach().float()
            # One reduction instead of an m x n boolean mask: any inf/nan makes the sum non-finite
            # (a finite gradient whose sum overflows fp32 would need entries near 1e34).
            if not _finite(g32):
                return _fail(prev, stats, "non-finite gradient")
            out = _decompose(
                g32, rank, side, method, prev if warm_start else None, seed, refresh, oversample, power_iters
            )
            if not _finite(out):
                return _fail(prev, stats, "decomposition returned non-finite values")
    except RuntimeError as err:  # torch.linalg.LinAlgError is a RuntimeError
        return _fail(prev, stats, f"{type(err).__name__}: {err}")
    finally:
        if stats is not None:
            stats.seconds += time.perf_counter() - t0
    if stats is not None:
        stats.count += 1
    return out


__all__ = [
    "DEFAULT_OVERSAMPLE",
    "DEFAULT_POWER_ITERS",
    "METHODS",
    "PROJ_TYPES",
    "RefreshStats",
    "basis_shape",
    "choose_side",
    "compute_basis",
    "cpu_generator",
    "effective_rank",
    "failed_refreshes",
    "gaussian",
    "gaussian_basis",
    "held_on_host",
    "identity_basis",
    "low_rank_shape",
    "mix_seed",
    "project",
    "project_back",
    "random_basis",
    "randomized_svd_basis",
    "reset_failure_warning",
    "svd_basis",
]

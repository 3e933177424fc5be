// flashot CPU kernels: the block-sparse kernels of the multiscale engine (B = 1): softmin, the pair step
// with barycentres and sub-tile pruning, the narrow plan product.
#pragma once
#include "abi.h"
#include "colsum.h"
#include "fpenv.h"
#include "panel.h"
#include "parallel.h"
#include "prune.h"

namespace {

// The folded pair panel (dot costs, static D = DS <= 3, one vector of columns): scores in a local frame with
// origin o (the caller's: the row panel's mean), s_ij = A_i + H_j + <u_i, z_j> with A_i = hx_i - k |x_i - o|^2,
// u_i = 2 k (x_i - o), z_j = y_j - o and H_j = hs_j - k |z_j|^2.  That is hx_i + hs_j - k |x_i - y_j|^2 with one
// add and DS FMAs per vector of pairs before the exponential (panel(): the norms' add, DS FMAs, the bias add and
// the scale), rounded at the scale of the panel's neighbourhood instead of |x|^2 + |y|^2.  u, A: the R rows'
// terms (u row stride DS); column j of [j0, j1) (padded layout) is read at z[d * ldz + j - jz], H[j - jz].
// Sums as panel()'s MODE_PAIR / MODE_PAIRB / MODE_PAIRBC, except the rows' numerators: sum_j E_ij z_j (the
// caller adds o times the row sum); the columns' sum_i E_ij x_i from the original rows x.
template <typename T, int R, int DS, int MODE>
static inline void panel_local(const T* __restrict x, const T* __restrict u, const T* __restrict A,
                               const T* __restrict z, const T* __restrict H, int64_t ldz, int64_t jz, int64_t j0,
                               int64_t j1, typename VT<T>::v* __restrict sum, T* __restrict P, int64_t Mp) {
  typedef typename VT<T>::v v;
  constexpr int L = VT<T>::L;
  constexpr bool BARY = MODE == MODE_PAIRB || MODE == MODE_PAIRBC;
  constexpr int SV = BARY ? 1 + DS : 1;
  const v zero = {};
  v sm[R], pb[BARY ? R : 1][DS];
  T ar[R], ur[R][DS];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    ar[r] = A[r];
    sm[r] = sum[r * SV];
    for (int d = 0; d < DS; ++d) {
      ur[r][d] = u[r * DS + d];
      if (BARY) pb[r][d] = sum[r * SV + 1 + d];
    }
  }
  for (int64_t j = j0; j < j1; j += L) {
    const int64_t jl = j - jz;
    const v hq = vload<v>(H + jl);
    v zq[DS], colc[DS], e[R];
#pragma GCC unroll 4
    for (int d = 0; d < DS; ++d) {
      zq[d] = vload<v>(z + d * ldz + jl);
      colc[d] = zero;
    }
    v colv = zero;
    // the R scores, then their exponentials, step by step over all rows (vexp2_n: interleaved chains)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) e[r] = hq + ar[r];
#pragma GCC unroll 4
    for (int d = 0; d < DS; ++d)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) e[r] += ur[r][d] * zq[d];
    vexp2_n<R>(e);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      sm[r] += e[r];
      colv += e[r];
      if (BARY)
#pragma GCC unroll 4
        for (int d = 0; d < DS; ++d) pb[r][d] += e[r] * zq[d];
      if (MODE == MODE_PAIRBC)
#pragma GCC unroll 4
        for (int d = 0; d < DS; ++d) colc[d] += e[r] * x[r * DS + d];
    }
    vstore(P + j, vload<v>(P + j) + colv);
    if (MODE == MODE_PAIRBC)
#pragma GCC unroll 4
      for (int d = 0; d < DS; ++d) {
        T* pc = P + (int64_t)(1 + d) * Mp + j;
        vstore(pc, vload<v>(pc) + colc[d]);
      }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    sum[r * SV] = sm[r];
    if (BARY)
      for (int d = 0; d < DS; ++d) sum[r * SV + 1 + d] = pb[r][d];
  }
}

// panel_local over nrows rows: panels of R, then of 4 (when R > 4), then single rows.
template <typename T, int R, int DS, int MODE>
static void panel_local_rows(int nrows, const T* x, const T* u, const T* A, const T* z, const T* H, int64_t ldz,
                             int64_t jz, int64_t j0, int64_t j1, typename VT<T>::v* sum, T* P, int64_t Mp) {
  constexpr int SV = MODE == MODE_PAIR ? 1 : 1 + DS;
  int r = 0;
  for (; r + R <= nrows; r += R)
    panel_local<T, R, DS, MODE>(x + r * DS, u + r * DS, A + r, z, H, ldz, jz, j0, j1, sum + r * SV, P, Mp);
  if constexpr (R > 4)
    for (; r + 4 <= nrows; r += 4)
      panel_local<T, 4, DS, MODE>(x + r * DS, u + r * DS, A + r, z, H, ldz, jz, j0, j1, sum + r * SV, P, Mp);
  for (; r < nrows; ++r)
    panel_local<T, 1, DS, MODE>(x + r * DS, u + r * DS, A + r, z, H, ldz, jz, j0, j1, sum + r * SV, P, Mp);
}

// The folded panels' row terms for nr rows x (row stride DS) with log-weights h: the origin o (their mean),
// u[r * DS + d] = 2 k (x_rd - o_d), A[r] = h_r - k |x_r - o|^2 (float64 arithmetic, rounded once).
template <typename T, int DS>
static void local_rows(const T* x, const T* h, int nr, double k, T* o, T* u, T* A) {
  for (int d = 0; d < DS; ++d) {
    double c = 0;
    for (int r = 0; r < nr; ++r) c += x[r * DS + d];
    o[d] = (T)(c / nr);
  }
  for (int r = 0; r < nr; ++r) {
    double q = 0;
    for (int d = 0; d < DS; ++d) {
      const double t = (double)x[r * DS + d] - (double)o[d];
      q += t * t;
      u[r * DS + d] = (T)(2 * k * t);
    }
    A[r] = (T)((double)h[r] - k * q);
  }
}

// The folded panels' column terms for columns [j0, j1) (padded layout yT (DS, Mp), hs): z[d * ldz + j - j0] =
// yT[d, j] - o_d, H[j - j0] = hs_j - k |z_j|^2.  Padding (hs the finite zero-weight code) stays negligible.
template <typename T, int DS>
static void local_cols(const T* yT, const T* hs, int64_t Mp, int64_t j0, int64_t j1, const T* o, T k, T* z,
                       int64_t ldz, T* H) {
  typedef typename VT<T>::v v;
  constexpr int L = VT<T>::L;
  for (int64_t j = j0; j < j1; j += L) {
    v nn = {};
#pragma GCC unroll 4
    for (int d = 0; d < DS; ++d) {
      const v zd = vload<v>(yT + (int64_t)d * Mp + j) - o[d];
      vstore(z + d * ldz + (j - j0), zd);
      nn += zd * zd;
    }
    vstore(H + (j - j0), vload<v>(hs + j) - nn * k);
  }
}

// Block-sparse softmin (the multiscale engine, B = 1): task t covers rows [tasks[3t], tasks[3t+1]) of
// row cluster k = tasks[3t+2], which sums over its kept column ranges [cr[2q], cr[2q+1]) for q in
// [cptr[k], cptr[k+1]).  Ranges are multiples of the micro-kernel's column step (the columns of each
// cluster are padded with -inf log-weights), so each range is streamed by the dense LSE panels.
// out[i] = oscale * LSE2_j (hs_j - k c_ij) over the kept columns (-inf when none).
template <typename T, int R, int NV, int KIND, int DS>
static void softmin_bs_impl(const T* x, const T* yT, const T* yy, const T* hs, T* out, const int64_t* tasks,
                            int64_t ntasks, const int64_t* cptr, const int64_t* cr, const Args& a, T oscale,
                            int nth) {
  typedef typename VT<T>::v v;
  const int D = a.D;
  constexpr int RB = R * 16;
  Tasks tq(ntasks);
  run_team(nth, [&](int tid) {
    FpScope fp(tid);
    for (int64_t t; tq.next(t);) {
      const int64_t i1 = tasks[3 * t + 1], k = tasks[3 * t + 2];
      for (int64_t i0 = tasks[3 * t]; i0 < i1; i0 += RB) {
        const int nr = (int)std::min<int64_t>(RB, i1 - i0);
        T m[RB];
        v sum[RB];
        for (int r = 0; r < nr; ++r) { m[r] = Consts<T>::SENT; sum[r] = v{}; }
        for (int64_t q = cptr[k]; q < cptr[k + 1]; ++q)
          lse_rows<T, R, NV, KIND, DS>(nr, x + i0 * D, yT, yy, hs, cr[2 * q], cr[2 * q + 1], a, m, sum);
        for (int r = 0; r < nr; ++r) {
          T lse = (m[r] == Consts<T>::SENT) ? -std::numeric_limits<T>::infinity() : m[r] + std::log2(hsum(sum[r]));
          out[i0 + r] = oscale * lse;
        }
      }
    }
  });
}

template <typename T, int KIND>
static int softmin_bs_dispatch(const T* x, const T* yT, const T* yy, const T* hs, T* out, const int64_t* tasks,
                               int64_t ntasks, const int64_t* cptr, const int64_t* cr, const Args& a, T oscale,
                               int cfg, int nth) {
  return with_lse_shape(cfg, a.D, [&](auto s) {
    using S = decltype(s);
    softmin_bs_impl<T, S::R, S::NV, KIND, S::DS>(x, yT, yy, hs, out, tasks, ntasks, cptr, cr, a, oscale, nth);
  });
}

template <typename T>
static int softmin_bs_entry(const T* x, const T* yT, const T* yy, const T* hs, T* out, int64_t Mp, int D,
                            const int64_t* tasks, int64_t ntasks, const int64_t* cptr, const int64_t* cr,
                            double kcoef, double minsq, int kind, double oscale, int cfg, int nth) {
  Args a{D, Mp, kcoef, minsq};
  if (kind == KIND_DOT)
    return softmin_bs_dispatch<T, KIND_DOT>(x, yT, yy, hs, out, tasks, ntasks, cptr, cr, a, (T)oscale, cfg, nth);
  if (kind == KIND_DIRECT)
    return softmin_bs_dispatch<T, KIND_DIRECT>(x, yT, yy, hs, out, tasks, ntasks, cptr, cr, a, (T)oscale, cfg, nth);
  return -2;
}

// Sub-tile pruning of the block-sparse pair kernels: within the kept blocks, the tiles of (a panel of up to RB
// rows) x (a chunk of TILE_COLS padded columns) are skipped where every entry E_ij = 2^(hx_i + hs_j - k c_ij)
// is negligible, by GeomLoss' truncate rule for the call's input potentials (fx, gy: f / eps, g / eps in base 2)
// or for its outputs (fxo, gyo: upper bounds of the row and column softmins over the kept blocks, same units):
//   fx_i + gy_j - k c_ij < -thr                       (E_ij < 2^-thr a_i b_j: GeomLoss' rule), or
//   fxo_i + gy_j - k c_ij < -thr and fx_i + gyo_j - k c_ij < -thr
//                                                     (E_ij < 2^-thr b_j R_i and < 2^-thr a_i C_j, R_i / C_j
//                                                      the row's / column's sum: negligible in every output).
// At a fixed point the two coincide; after a jump in the temperature (inputs several eps above the outputs)
// the second skips what the first keeps.  Each side's terms are those of the block pruning (prune.h, one packed
// row: the ball's centre and radius, the potential's maximum and, for KIND_DOT, an upper linear model fx_i <=
// base + <beta, x_i - c>, beta a least-squares slope and base the largest residual, so the bound holds whatever
// the fit); the tile's bound is flashot_prune::bound at s = k, the simple one alone for KIND_DIRECT.  Without
// the linear model the bound loses the potentials' variation across the tile (at 10^7 points, several eps).
// Rows (and the clusters' points) are in Morton order inside their cluster, so panels and chunks are compact.
constexpr int64_t TILE_COLS = 64;
constexpr int TILE_D = 3;                      // sub-tile pruning for D <= TILE_D
constexpr int TILE_STRIDE = 5 + 3 * TILE_D;    // packed row: [r, m, base, bb, bc, c (D), beta (D), u (D)]

// The packed terms of n points (coordinate d of point i: at(i, d)) with potentials f(i) (base 2; -inf: no mass,
// ignored; nan or +inf: never skipped; the columns' nan are left out by the caller) for a cost k |x - y|^2
// (linear) or the simple bound only.
template <typename At, typename F>
static void tile_terms(int n, int D, At at, F f, double k, bool linear, double* out) {
  const double INF = std::numeric_limits<double>::infinity();
  std::fill(out, out + TILE_STRIDE, 0.0);
  double* c = out + 5;
  double* beta = c + D;
  double* u = beta + D;
  double m = -INF;
  for (int i = 0; i < n; ++i) {
    for (int d = 0; d < D; ++d) c[d] += at(i, d);
    const double v = f(i);
    m = v == v ? std::max(m, v) : INF;
  }
  for (int d = 0; d < D; ++d) c[d] /= (double)std::max(n, 1);
  double r = 0;
  for (int i = 0; i < n; ++i) {
    double r2 = 0;
    for (int d = 0; d < D; ++d) r2 += (at(i, d) - c[d]) * (at(i, d) - c[d]);
    r = std::max(r, std::sqrt(r2));
  }
  out[0] = r;
  out[1] = m;
  out[2] = m;  // base without a slope; -inf or +inf pass through the bound unchanged
  for (int d = 0; d < D; ++d) u[d] = c[d];
  if (!linear || !(m > -INF && m < INF)) return;
  // least squares of f on [1, x - c] over the rows with mass (normal equations, a small ridge)
  constexpr int E = TILE_D + 1;
  double G[E][E + 1] = {};
  const int De = D + 1;
  for (int i = 0; i < n; ++i) {
    const double v = f(i);
    if (!(v > -INF)) continue;
    double a[E] = {1.0};
    for (int d = 0; d < D; ++d) a[1 + d] = at(i, d) - c[d];
    for (int p = 0; p < De; ++p) {
      for (int q = 0; q < De; ++q) G[p][q] += a[p] * a[q];
      G[p][De] += a[p] * v;
    }
  }
  for (int p = 0; p < De; ++p) G[p][p] += 1e-9 * (1.0 + G[p][p]);
  for (int p = 0; p < De; ++p) {  // Gauss-Jordan, SPD: no pivoting needed
    const double piv = G[p][p];
    if (!(piv > 0)) return;
    for (int q = p; q <= De; ++q) G[p][q] /= piv;
    for (int o = 0; o < De; ++o) {
      if (o == p) continue;
      const double w = G[o][p];
      for (int q = p; q <= De; ++q) G[o][q] -= w * G[p][q];
    }
  }
  for (int d = 0; d < D; ++d) beta[d] = G[1 + d][De];
  double base = -INF;
  for (int i = 0; i < n; ++i) {
    const double v = f(i);
    if (!(v > -INF)) continue;
    double lin = 0;
    for (int d = 0; d < D; ++d) lin += beta[d] * (at(i, d) - c[d]);
    base = std::max(base, v - lin);
  }
  out[2] = base;
  double bb = 0, bc = 0;
  for (int d = 0; d < D; ++d) {
    bb += beta[d] * beta[d];
    bc += beta[d] * c[d];
    u[d] = c[d] - beta[d] / (2 * k);
  }
  out[3] = bb;
  out[4] = bc;
}

template <typename T>
struct TileBounds {
  const T* fx = nullptr;   // (N,) f_i / eps in base 2 (nan or +inf: never skipped); null: no sub-tile pruning
  const T* fxo = nullptr;  // (N,) upper bounds of the rows' outputs, same units
  double thr = 0;
  bool linear = false;  // KIND_DOT: linear models
  int64_t nch = 0;
  // per chunk: a packed row (TILE_STRIDE) of its valid columns (m = -inf: none), from gy then from gyo
  std::vector<double> terms, terms_o;

  // chunk terms from the padded columns yT (D, Mp), gy and gyo (Mp,) (-inf on padding)
  void build(const T* yT, const T* gy, const T* gyo, int64_t Mp, int D, double k) {
    nch = (Mp + TILE_COLS - 1) / TILE_COLS;
    terms.assign((size_t)nch * TILE_STRIDE, 0.0);
    terms_o.assign((size_t)nch * TILE_STRIDE, 0.0);
    for (int64_t ch = 0; ch < nch; ++ch) {
      const int64_t j0 = ch * TILE_COLS;
      int64_t idx[TILE_COLS];
      int n = 0;
      for (int64_t j = j0; j < std::min(Mp, j0 + TILE_COLS); ++j)
        if (gy[j] > -std::numeric_limits<T>::infinity()) idx[n++] = j;  // padding, no mass (nan): out
      for (int o = 0; o < 2; ++o) {
        const T* g = o ? gyo : gy;
        double* out = (o ? terms_o : terms).data() + ch * TILE_STRIDE;
        if (n == 0) {
          std::fill(out, out + TILE_STRIDE, 0.0);
          out[1] = -std::numeric_limits<double>::infinity();
          continue;
        }
        tile_terms(n, D, [&](int i, int d) { return (double)yT[(int64_t)d * Mp + idx[i]]; },
                   [&](int i) { return (double)g[idx[i]]; }, k, linear, out);
      }
    }
  }
};

// One direction of the rule: is every entry of the tile (panel terms p, chunk terms q) below -thr?  KIND_DOT
// c = |x - y|^2, KIND_DIRECT c = max(|x - y|, sqrt(minsq)).
template <typename T, int KIND>
static inline bool tile_below(const TileBounds<T>& tb, const double* p, const double* q, int D, const Args& a) {
  if (KIND == KIND_DOT) return flashot_prune::bound(p, q, D, 1, tb.linear, a.kcoef, 0.0) > tb.thr;
  const double gap = std::max(0.0, flashot_prune::dist(p + 5, q + 5, D) - p[0] - q[0]);
  return a.kcoef * std::max(gap, std::sqrt(a.minsq)) - p[1] - q[1] > tb.thr;
}

// Is the tile (panel terms p from fx, po from fxo; chunk ch) kept?
template <typename T, int KIND>
static inline bool tile_kept(const TileBounds<T>& tb, const double* p, const double* po, int64_t ch, int D,
                             const Args& a) {
  const double* q = tb.terms.data() + ch * TILE_STRIDE;
  if (!(q[1] > -std::numeric_limits<double>::infinity())) return false;  // padding only
  const double* qo = tb.terms_o.data() + ch * TILE_STRIDE;
  if (tile_below<T, KIND>(tb, p, q, D, a)) return false;
  return !(tile_below<T, KIND>(tb, po, q, D, a) && tile_below<T, KIND>(tb, p, qo, D, a));
}

// pair_bs_impl's helpers are always inlined (FL_INLINE), so that their loops are compiled as if written in
// its body.

// pair_bs_impl's inputs and outputs, fixed for one call
template <typename T>
struct PairBs {
  const T *x, *yT, *yy, *hs, *hx;
  T *rsum, *rb;
  int64_t Mp;
  const int64_t *tasks, *cptr, *cr, *coff;
  const Args& a;
  const TileBounds<T>& tb;
  bool sym, tiles;
};

// The shape of one instantiation and a worker's scratch: the panel's tile terms from fx and fxo, its
// folded origin o and terms u, A (dot costs at a static d <= 3: panel_local, in a frame centred on each
// row panel), the folded columns' terms z (DL rows) and H.
template <typename T, int R, int NV, int KIND, int DS, int MODE>
struct PairBsWork {
  static constexpr int RB = R * FL_TILE_MULT;               // rows per panel: the tiles' height
  static constexpr int SV = MODE == MODE_PAIR ? 1 : 1 + DS;  // sum vectors per row
  // sym: panels split their diagonal block at their own rows where RB is a whole number of column steps
  static constexpr bool TRI = RB % (VT<T>::L * NV) == 0;
  static constexpr bool LOCAL = KIND == KIND_DOT && DS > 0 && NV == 1;
  static constexpr int DL = DS > 0 ? DS : 1;
  double ball[TILE_STRIDE], ball_o[TILE_STRIDE];
  T o[DL], u[LOCAL ? RB * DL : 1], A[LOCAL ? RB : 1];
  std::vector<T> zbuf;
};

// Columns [lo, hi) of a panel through eval(c0, c1): the kept chunks' runs when pruning tiles, else at once.
template <typename T, int KIND, typename E>
FL_INLINE void pair_bs_stream(const PairBs<T>& P, const double* ball, const double* ball_o, int64_t lo, int64_t hi,
                              E&& eval) {
  if (!P.tiles) {
    eval(lo, hi);
    return;
  }
  int64_t run = -1;
  for (int64_t ch = lo / TILE_COLS; ch * TILE_COLS < hi; ++ch) {
    const int64_t c0 = std::max(lo, ch * TILE_COLS), c1 = std::min(hi, (ch + 1) * TILE_COLS);
    const bool keep = tile_kept<T, KIND>(P.tb, ball, ball_o, ch, P.a.D, P.a);
    if (keep && run < 0) run = c0;
    if (run >= 0 && (!keep || c1 == hi)) {
      eval(run, keep ? c1 : c0);
      run = -1;
    }
  }
}

// One row panel [i0, i0 + nr) of task (r0, i1, k): row sums (and barycentre numerators) into rsum (rb), its
// column sums into cacc (planes of stride ld) and its own diagonal square's (sym) into scratch.
// Returns the pairs evaluated.
template <typename T, int R, int NV, int KIND, int DS, int MODE>
FL_INLINE int64_t pair_bs_panel(const PairBs<T> P, PairBsWork<T, R, NV, KIND, DS, MODE>& W, int64_t r0,
                                int64_t i0, int64_t i1, int64_t k, T* cacc, T* scratch, int64_t ld) {
  typedef PairBsWork<T, R, NV, KIND, DS, MODE> S;
  typedef typename VT<T>::v v;
  const int D = P.a.D;
  const int nr = (int)std::min<int64_t>(S::RB, i1 - i0);
  const int64_t d0 = P.sym ? P.coff[k] : 0, d1 = P.sym ? P.coff[k + 1] : 0;
  // sym: the panel's own square [p0, p1) of the diagonal block (row r of the cluster is its padded column
  // d0 + r) for the rows only, the block's columns right of it for rows and columns, none left of it
  const int64_t p0 = S::TRI ? d0 + (i0 - r0) : d0, p1 = S::TRI && i0 + nr < i1 ? d0 + (i0 + nr - r0) : d1;
  T m[S::RB];
  v sum[S::RB * S::SV];
  for (int r = 0; r < nr; ++r) {
    m[r] = P.hx[i0 + r];
    for (int u = 0; u < S::SV; ++u) sum[r * S::SV + u] = v{};
  }
  const T* xb = P.x + i0 * D;
  if constexpr (S::LOCAL) local_rows<T, S::DL>(xb, m, nr, P.a.kcoef, W.o, W.u, W.A);
  int64_t done = 0;
  T* cols = cacc;
  auto eval = [&](int64_t c0, int64_t c1) {  // the panel's rows over columns [c0, c1) into cols
    if constexpr (S::LOCAL) {
      const int64_t w = c1 - c0;
      if ((int64_t)W.zbuf.size() < (S::DL + 1) * w) W.zbuf.resize((size_t)((S::DL + 1) * w));
      T* z = W.zbuf.data();
      local_cols<T, S::DL>(P.yT, P.hs, P.Mp, c0, c1, W.o, (T)P.a.kcoef, z, w, z + S::DL * w);
      panel_local_rows<T, R, S::DL, MODE>(nr, xb, W.u, W.A, z, z + S::DL * w, w, c0, c0, c1, sum, cols, ld);
    } else {
      panel_rows<T, R, NV, KIND, DS, MODE, W_ONE>(nr, xb, P.yT, P.yy, P.hs, c0, c1, P.a, m, sum, cols, 0);
    }
    done += (int64_t)nr * (c1 - c0);
  };
  if (P.tiles) {
    tile_terms(nr, D, [&](int i, int d) { return (double)xb[i * D + d]; },
               [&](int i) { return (double)P.tb.fx[i0 + i]; }, P.a.kcoef, P.tb.linear, W.ball);
    tile_terms(nr, D, [&](int i, int d) { return (double)xb[i * D + d]; },
               [&](int i) { return (double)P.tb.fxo[i0 + i]; }, P.a.kcoef, P.tb.linear, W.ball_o);
  }
  for (int64_t q = P.cptr[k]; q < P.cptr[k + 1]; ++q) {
    int64_t lo = P.cr[2 * q];
    const int64_t hi = P.cr[2 * q + 1];
    if (P.sym) {  // the panel's square for the rows only; nothing left of it
      if (hi <= p0) continue;
      const int64_t dlo = std::max(lo, p0), dhi = std::min(hi, p1);
      cols = scratch;
      if (dlo < dhi) pair_bs_stream<T, KIND>(P, W.ball, W.ball_o, dlo, dhi, eval);
      cols = cacc;
      lo = std::max(lo, p1);
      if (lo >= hi) continue;
    }
    pair_bs_stream<T, KIND>(P, W.ball, W.ball_o, lo, hi, eval);
  }
  for (int r = 0; r < nr; ++r) {
    P.rsum[i0 + r] = hsum(sum[r * S::SV]);
    if (MODE != MODE_PAIR)  // folded: the numerators are about o
      for (int d = 0; d < DS; ++d)
        P.rb[(i0 + r) * DS + d] = hsum(sum[r * S::SV + 1 + d]) + (S::LOCAL ? W.o[d] * P.rsum[i0 + r] : (T)0);
  }
  return done;
}

// Block-sparse symmetric step (pair_impl over softmin_bs_impl's kept ranges, B = 1): rsum[i] = sum_j E_ij
// over row i's kept columns and csum[j] (padded layout) = sum_i E_ij, E_ij = 2^(hx_i + hs_j - k c_ij), one
// exponential per pair.  Column partials per group of row clusters (cluster t -> group t % G; banded: runs of
// consecutive clusters, ColSpans), combined in group order: the same bits for any thread count.  sym (y is x
// with the same clusters, a symmetric pattern, coff (Kx + 1,) the clusters' padded column offsets, one task per
// cluster): each panel of RB rows of cluster k sums its own square of the diagonal block for its rows only and
// the kept columns right of it for rows and columns, skipping those left of it (the earlier panels' and
// clusters' columns: about half the pairs); the caller adds rsum + csum.
// Barycentres (MODE_PAIRB / MODE_PAIRBC, static D = DS): rb[i * DS + d] = sum_j E_ij y_jd and, with
// MODE_PAIRBC, csum[(1 + d) Mp + j] = sum_i E_ij x_id after csum's first Mp values (the solver's gradient
// is then sum_j P_ij (x_i - y_j) = x_i - rb_i / rsum_i per unit of row mass: no plan-product pass).
// tb.fx: sub-tile pruning (TileBounds); the pairs evaluated (padded columns included) are added to *evaluated.
template <typename T, int R, int NV, int KIND, int DS, int MODE>
static void pair_bs_impl(const T* x, const T* yT, const T* yy, const T* hs, const T* hx, T* rsum, T* csum, T* rb,
                         int64_t Mp, const int64_t* tasks, int64_t ntasks, const int64_t* cptr, const int64_t* cr,
                         const int64_t* coff, const Args& a, const TileBounds<T>& tb, int64_t* evaluated, bool sym,
                         bool banded, int nth) {
  const PairBs<T> P{x, yT, yy, hs, hx, rsum, rb, Mp, tasks, cptr, cr, coff, a, tb, sym, tb.fx != nullptr && a.D <= 3};
  constexpr int planes = MODE == MODE_PAIRBC ? 1 + DS : 1;  // column sums, then the columns' numerators
  std::atomic<int64_t> count{0};
  // tasks tb0, tb0 + ts, ... < te into cacc (planes of stride ld); scratch: column sums of diagonal blocks, discarded
  auto body = [&](int64_t tb0, int64_t te, int64_t ts, T* cacc, T* scratch, int64_t ld) {
    PairBsWork<T, R, NV, KIND, DS, MODE> W;
    int64_t done = 0;
    for (int64_t t = tb0; t < te; t += ts) {
      const int64_t r0 = tasks[3 * t], i1 = tasks[3 * t + 1], k = tasks[3 * t + 2];
      for (int64_t i0 = r0; i0 < i1; i0 += W.RB)
        done += pair_bs_panel<T, R, NV, KIND, DS, MODE>(P, W, r0, i0, i1, k, cacc, scratch, ld);
    }
    count += done;
  };
  auto span = [&](int64_t t, int64_t& l, int64_t& h) {  // task t's columns (banded)
    const int64_t k = tasks[3 * t + 2];
    l = std::numeric_limits<int64_t>::max();
    h = 0;
    for (int64_t q = cptr[k]; q < cptr[k + 1]; ++q) { l = std::min(l, cr[2 * q]); h = std::max(h, cr[2 * q + 1]); }
  };
  col_pass<T>(banded, ntasks, span, planes, Mp, sym, csum, nth, body);
  if (evaluated) *evaluated += count.load();
}

// sym is a run-time flag: it changes which column ranges a row panel visits, not the inner loop.
template <typename T, int KIND>
static int pair_bs_dispatch(const T* x, const T* yT, const T* yy, const T* hs, const T* hx, T* rs, T* cs, T* rb,
                            int cb, int64_t Mp, const int64_t* tasks, int64_t ntasks, const int64_t* cptr,
                            const int64_t* cr, const int64_t* coff, const Args& a, const TileBounds<T>& tb,
                            int64_t* evaluated, bool sym, bool banded, int cfg, int nth) {
  if (rb == nullptr)
    return with_lse_shape(cfg, a.D, [&](auto s) {
      using S = decltype(s);
      pair_bs_impl<T, S::R, S::NV, KIND, S::DS, MODE_PAIR>(x, yT, yy, hs, hx, rs, cs, nullptr, Mp, tasks, ntasks,
                                                           cptr, cr, coff, a, tb, evaluated, sym, banded, nth);
    });
  // barycentres: dot costs (the only ones the engine asks them for), d <= 3, Shape::PV_R rows (their
  // accumulators: 1 + d vectors a row, as the narrow plan product's); sym with the columns' too (the entry
  // refuses the rest).  Only these variants are instantiated: the others would be compile time for nothing.
  if constexpr (KIND != KIND_DOT) {
    return -4;
  } else {
    constexpr int R = Shape::PV_R;
#define FL_BARY(DS, MODE) \
  pair_bs_impl<T, R, 1, KIND, DS, MODE>(x, yT, yy, hs, hx, rs, cs, rb, Mp, tasks, ntasks, cptr, cr, coff, a, tb, \
                                        evaluated, sym, banded, nth)
#define FL_BARY_D(DS) { if (sym || cb) FL_BARY(DS, MODE_PAIRBC); else FL_BARY(DS, MODE_PAIRB); return 0; }
    switch (a.D) {
      case 1: FL_BARY_D(1)
      case 2: FL_BARY_D(2)
      case 3: FL_BARY_D(3)
      default: return -4;
    }
#undef FL_BARY_D
#undef FL_BARY
  }
}

// rb (N, D) or null: the rows' barycentre numerators (d <= 3, else -4); cb (with rb): the columns' too, in cs
// after its first Mp values (cs then holds (1 + D) Mp).  sym needs both (-3 otherwise).  fx, fxo (N,) and gy, gyo
// (Mp,), all four or none: sub-tile pruning at the threshold thr (TileBounds; d <= 3); evaluated (or null) += pairs
// computed.
template <typename T>
static int pair_bs_entry(const T* x, const T* yT, const T* yy, const T* hs, const T* hx, T* rs, T* cs, T* rb, int cb,
                         const T* fx, const T* gy, const T* fxo, const T* gyo, double thr, int64_t* evaluated,
                         int64_t Mp, int D, const int64_t* tasks, int64_t ntasks, const int64_t* cptr,
                         const int64_t* cr, const int64_t* coff, double kcoef, double minsq, int kind, int cfg, int sym,
                         bool banded, int nth) {
  Args a{D, Mp, kcoef, minsq};
  if (sym && coff == nullptr) return -3;
  if (sym && rb != nullptr && !cb) return -3;
  const int given = (fx != nullptr) + (gy != nullptr) + (fxo != nullptr) + (gyo != nullptr);
  if (given != 0 && given != 4) return -3;
  TileBounds<T> tb;
  if (fx != nullptr && D <= 3) {
    tb.fx = fx;
    tb.fxo = fxo;
    tb.thr = thr;
    tb.linear = kind == KIND_DOT;
    tb.build(yT, gy, gyo, Mp, D, kcoef);
  }
#define FL_PAIR_BS(KD) \
  return pair_bs_dispatch<T, KD>(x, yT, yy, hs, hx, rs, cs, rb, cb, Mp, tasks, ntasks, cptr, cr, coff, a, tb, \
                                 evaluated, sym != 0, banded, cfg, nth)
  if (kind == KIND_DOT) FL_PAIR_BS(KIND_DOT);
  if (kind == KIND_DIRECT) FL_PAIR_BS(KIND_DIRECT);
#undef FL_PAIR_BS
  return -2;
}

// Block-sparse plan product with a narrow V (K <= PV_K), two passes (the multiscale engine, B = 1):
// out[i, k] = exp(alpha_i + lse_i) * wconst * sum_j 2^(hs_j - k c_ij - lse_i) W_ij VTk[k, j] over the kept
// column ranges of row i's cluster (tasks / cptr / cr as in softmin_bs_impl), lse the base-2 row LSE over
// the same columns (flashot_softmin_bs with oscale 1).
template <typename T, int KIND, int WK>
static void plan_bs_impl(const T* x, const T* yT, const T* yy, const T* hs, const T* lse, const T* alpha,
                         const T* VTk, T* out, T* mass, int single, const int64_t* tasks, int64_t ntasks,
                         const int64_t* cptr, const int64_t* cr, const Args& a, T wconst, int nth) {
  typedef typename VT<T>::v v;
  constexpr int R = Shape::PV_R;
  constexpr int RB = 64;
  const int D = a.D, K = a.K;
  Tasks tq(ntasks);
  run_team(nth, [&](int tid) {
    FpScope fp(tid);
    for (int64_t t; tq.next(t);) {
      const int64_t i1 = tasks[3 * t + 1], k = tasks[3 * t + 2];
      for (int64_t i0 = tasks[3 * t]; i0 < i1; i0 += RB) {
        const int nr = (int)std::min<int64_t>(RB, i1 - i0);
        T m[RB];
        v pa[RB * (PV_K + 1)];
        for (int r = 0; r < nr; ++r) {
          m[r] = row_shift(single, lse, alpha, i0 + r);
          for (int kk = 0; kk <= PV_K; ++kk) pa[r * (PV_K + 1) + kk] = v{};
        }
        for (int64_t q = cptr[k]; q < cptr[k + 1]; ++q)
          panel_rows<T, R, 1, KIND, 0, MODE_PV, WK>(nr, x + i0 * D, yT, yy, hs, cr[2 * q], cr[2 * q + 1], a, m, pa,
                                                     const_cast<T*>(VTk), 0);
        for (int r = 0; r < nr; ++r) {
          const T f = row_factor(single, lse, alpha, i0 + r, wconst);
          for (int kk = 0; kk < K; ++kk) out[(i0 + r) * K + kk] = f == 0 ? (T)0 : hsum(pa[r * (PV_K + 1) + kk]) * f;
          mass[i0 + r] = hsum(pa[r * (PV_K + 1) + PV_K]);
        }
      }
    }
  });
}

template <typename T>
static int plan_bs_entry(const T* x, const T* yT, const T* yy, const T* hs, const T* lse, const T* alpha,
                         const T* VTk, int K, T* out, T* mass, int single, int64_t Mp, int D, const int64_t* tasks,
                         int64_t ntasks, const int64_t* cptr, const int64_t* cr, double kcoef, double minsq, int kind,
                         int wk, double wconst, int nth) {
  if (K < 1 || K > PV_K) return -3;
  Args a{D, Mp, kcoef, minsq, K};
#define FL_PLAN_BS(KD, W) plan_bs_impl<T, KD, W>(x, yT, yy, hs, lse, alpha, VTk, out, mass, single, tasks, ntasks, \
                                                 cptr, cr, a, (T)wconst, nth)
  if (kind == KIND_DOT) {
    if (wk == W_ONE) { FL_PLAN_BS(KIND_DOT, W_ONE); return 0; }
    if (wk == W_COST) { FL_PLAN_BS(KIND_DOT, W_COST); return 0; }
  } else if (kind == KIND_DIRECT) {
    if (wk == W_ONE) { FL_PLAN_BS(KIND_DIRECT, W_ONE); return 0; }
    if (wk == W_COST) { FL_PLAN_BS(KIND_DIRECT, W_COST); return 0; }
    if (wk == W_INV) { FL_PLAN_BS(KIND_DIRECT, W_INV); return 0; }
  }
#undef FL_PLAN_BS
  return -2;
}

// ---- the entry points' bodies (abi.h): the argument structs unpacked ----
template <typename T>
static int softmin_bs_call(const flashot_lse_bs_args* p) {
  const flashot_stream& s = p->a.s;
  const flashot_blocks& b = p->b;
  const Cloud<T> c(s);
  return softmin_bs_entry<T>(c.x, c.yT, c.yy, c.hs, (T*)p->a.out, s.Mp, s.D, b.tasks, b.ntasks, b.cptr, b.cr, s.kcoef,
                             s.minsq, s.kind, p->a.oscale, s.cfg, s.nth);
}

template <typename T>
static int pair_bs_call(const flashot_pair_bs_args* p) {
  const flashot_rowcol_args& a = p->a;
  const flashot_stream& s = a.s;
  const flashot_blocks& b = p->b;
  const Cloud<T> c(s);
  return pair_bs_entry<T>(c.x, c.yT, c.yy, c.hs, (const T*)a.hx, (T*)a.rows, (T*)a.cols, (T*)p->rb, p->cb,
                          (const T*)p->fx, (const T*)p->gy, (const T*)p->fxo, (const T*)p->gyo, p->thr, p->evaluated,
                          s.Mp, s.D, b.tasks, b.ntasks, b.cptr, b.cr, b.coff, s.kcoef, s.minsq, s.kind, s.cfg, a.sym,
                          b.banded != 0, s.nth);
}

template <typename T>
static int plan_bs_call(const flashot_plan_bs_args* p) {
  const flashot_plan_args& a = p->a;
  const flashot_stream& s = a.s;
  const flashot_blocks& b = p->b;
  const Cloud<T> c(s);
  return plan_bs_entry<T>(c.x, c.yT, c.yy, c.hs, (const T*)a.lse, (const T*)a.alpha, (const T*)a.V, a.K, (T*)a.out,
                          (T*)a.mass, a.single, s.Mp, s.D, b.tasks, b.ntasks, b.cptr, b.cr, s.kcoef, s.minsq, s.kind,
                          a.wk, a.wconst, s.nth);
}

}  // namespace

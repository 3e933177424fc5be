// flashot CPU kernels: the streaming panels (register-blocked scores, fused with the exponentials and
// the running LogSumExp or the plan weights) and the micro-kernel shapes.
//
// Streaming kernels never hold more than an (R rows x 16*NV columns) block of
// scores, in registers: dot products (register-blocked over R rows and NV
// vectors of columns), cost, bias, exp and the running LogSumExp are fused.
//
// Online LogSumExp with a lazy maximum: each row keeps a scalar m and a vector
// of partial sums of 2^(s - m).  A block of scores is checked once (one max,
// compare and mask test) against m + TH; only when some score exceeds it is m
// raised, to that score + H (headroom: a later score must beat the largest seen
// by H + TH to trigger again, so after the first block this almost never
// happens), and the sums rescaled.  Terms are therefore at most 2^TH (float:
// 2^60, sums of up to 2^26 of them stay finite) and m exceeds the largest score
// by at most H (float: 30; terms down to 2^-96 of the largest stay normal floats,
// far below what float32 sums can resolve).
#pragma once
#include "abi.h"
#include "vecmath.h"

namespace {

enum { KIND_DOT = 0, KIND_DIRECT = 1 };
enum { MODE_LSE = 0, MODE_P = 1, MODE_PAIR = 2, MODE_PV = 3, MODE_PAIRB = 4, MODE_PAIRBC = 5 };
constexpr int PV_K = 4;  // MODE_PV: up to this many columns of V
enum { W_ONE = 0, W_COST = 1, W_INV = 2 };

struct Args {
  int D;
  int64_t Mp;        // padded column stride of yT / VT / yy / hs
  double kcoef;      // scale/eps (dot) or 1/eps (direct)
  double minsq;      // direct: clamp of squared distance before sqrt
  int K = 0;         // MODE_PV: number of columns of V (<= PV_K)
};

// One panel of R rows (x: R consecutive rows, row stride D) over columns [j0, j1), NV vectors of columns
// per step: the R x NV block of costs (FL_PANEL_COSTS), then the mode's step.
// MODE_PV: m[r] is the row's base-2 shift; sum holds R * (PV_K + 1) vectors: sum[r * (PV_K + 1) + k]
// += 2^(hs_j - k c - m[r]) W_rj VT[k, j] (VT: K rows of stride Mp, passed as P), vectorised over j,
// and sum[r * (PV_K + 1) + PV_K] += 2^(hs_j - k c - m[r]) (the row's plan mass, before W).
// MODE_P also adds the plan mass to sum[r] when sum is not null.
// MODE_PAIR: m[r] is the row's log-weight hx_r (base 2); adds E = 2^(hx_r + hs_j - k c) to the
// row sums sum[r] and, summed over the R rows, to the column sums P[j] (P spans all columns).
// MODE_PAIRB (static D = DS): MODE_PAIR plus the rows' barycentre numerators: sum holds R * (1 + DS)
// vectors, sum[r * (1 + DS)] the row sum and sum[r * (1 + DS) + 1 + d] += E y_jd.  MODE_PAIRBC also adds
// the columns' numerators: P[(1 + d) Mp + j] += sum_r E x_rd (P then spans (1 + DS) Mp values).
// MODE_LSE: updates (m[r], sum[r]).  MODE_P: writes P[r*ldp + (j - j0)] =
// exp(s - m[r]) * W  (m[r] = normalising LSE of the row, given).
//
// Why the steps are macros: a panel's state (R rows of maxima and sums, the R x NV costs and scores) must
// live in registers, and GCC keeps such arrays there only while their address is never taken.  Written as
// helper functions, even always inlined ones taking the arrays by reference or by value, or as one function
// per mode, the steps compiled to different register allocations and made the streamed softmin or the plan
// product slower (BENCHMARKS.md, "C++ function length against kernel speed").  As macros expanded in the
// one body of panel (below), they give exactly the code of that body written out, while each reads on its
// own.  Each step sees the panel's template parameters and arguments, the set-up's names and the column j.

// The panel's set-up: the constants, the rows' squared norms xx (dot costs), their maxima or shifts mr
// (from m), their sums sm and, for the barycentre and narrow-V modes, their extra accumulators pb, pa.
#define FL_PANEL_SETUP()                                                                                      \
  typedef typename VT<T>::v v;                                                                                \
  constexpr int L = VT<T>::L;                                                                                 \
  const int D = DS > 0 ? DS : a.D;                                                                            \
  const int64_t Mp = a.Mp;                                                                                    \
  const T k = (T)a.kcoef;                                                                                     \
  const v minsq = vset<v>((T)a.minsq);                                                                        \
  const v wthr = vset<v>((T)(a.minsq > 0 ? 1.001 * std::sqrt(a.minsq) : 0.0));                                \
  const v zero = {};                                                                                          \
  T xx[R];                                                                                                    \
  v sm[R];                                                                                                    \
  T mr[R];                                                                                                    \
  constexpr bool BARY = MODE == MODE_PAIRB || MODE == MODE_PAIRBC;                                            \
  constexpr int DB = DS > 0 ? DS : 1;  /* MODE_PAIRB(C): coordinates per point (static) */                    \
  constexpr int SV = 1 + DB;  /* and sum vectors per row */                                                   \
  v pa[MODE == MODE_PV ? R : 1][PV_K];                                                                        \
  v pb[BARY ? R : 1][DB];                                                                                     \
  if (BARY)                                                                                                   \
    for (int r = 0; r < R; ++r)                                                                               \
      for (int d = 0; d < DB; ++d) pb[r][d] = sum[r * SV + 1 + d];                                            \
  if (MODE == MODE_PV)                                                                                        \
    for (int r = 0; r < R; ++r)                                                                               \
      for (int kk = 0; kk < PV_K; ++kk) pa[r][kk] = sum[r * (PV_K + 1) + kk];                                 \
  _Pragma("GCC unroll 16")                                                                                    \
  for (int r = 0; r < R; ++r) {                                                                               \
    T s = 0;                                                                                                  \
    if (KIND == KIND_DOT) for (int d = 0; d < D; ++d) s += x[r * D + d] * x[r * D + d];                       \
    xx[r] = s;                                                                                                \
    mr[r] = m[r];                                                                                             \
    if (MODE == MODE_LSE || MODE == MODE_PAIR) sm[r] = sum[r];                                                \
    if (MODE == MODE_P) sm[r] = sum ? sum[r] : zero;                                                          \
    if (MODE == MODE_PV) sm[r] = sum[r * (PV_K + 1) + PV_K];                                                  \
    if (BARY) sm[r] = sum[r * SV];                                                                            \
  }

// The R x NV block of costs at column j, as acc[r][q].
// dot costs: acc ends as |x|^2 + |y|^2 - 2<x, y> (the explicit cost, formed before
// 1/eps).  For d <= 3 acc starts at |x_r|^2 + |y_j|^2 (no extra add in the exp-bound
// kernels); for larger d it accumulates -2<x, y> from zero and the norms come last:
// starting at the norms puts each of the d roundings at the scale |x|^2 + |y|^2
// instead of that of the partial dot products (at large d in float32 that halves the softmin's
// error; at d <= 3 it makes no difference).
#define FL_PANEL_COSTS()                                                                                      \
  const bool norms_first = KIND == KIND_DOT && (DS > 0 || D <= 3);                                            \
  v acc[R][NV];                                                                                               \
  _Pragma("GCC unroll 8")                                                                                     \
  for (int q = 0; q < NV; ++q) {                                                                              \
    v init = zero;                                                                                            \
    if (norms_first) init = vload<v>(yy + j + q * L);                                                         \
    _Pragma("GCC unroll 16")                                                                                  \
    for (int r = 0; r < R; ++r) acc[r][q] = norms_first ? init + xx[r] : zero;                                \
  }                                                                                                           \
  const T* yp = yT + j;                                                                                       \
  _Pragma("GCC unroll 4")                                                                                     \
  for (int d = 0; d < D; ++d) {                                                                               \
    v yv[NV];                                                                                                 \
    _Pragma("GCC unroll 8")                                                                                   \
    for (int q = 0; q < NV; ++q) yv[q] = vload<v>(yp + (int64_t)d * Mp + q * L);                              \
    _Pragma("GCC unroll 16")                                                                                  \
    for (int r = 0; r < R; ++r) {                                                                             \
      const T xs = KIND == KIND_DOT ? (T)-2 * x[r * D + d] : x[r * D + d];                                    \
      _Pragma("GCC unroll 8")                                                                                 \
      for (int q = 0; q < NV; ++q) {                                                                          \
        if (KIND == KIND_DOT) {                                                                               \
          acc[r][q] += xs * yv[q];                                                                            \
        } else {                                                                                              \
          v df = yv[q] - xs;                                                                                  \
          acc[r][q] += df * df;                                                                               \
        }                                                                                                     \
      }                                                                                                       \
    }                                                                                                         \
  }                                                                                                           \
  if (KIND == KIND_DOT && !norms_first) {                                                                     \
    _Pragma("GCC unroll 8")                                                                                   \
    for (int q = 0; q < NV; ++q) {                                                                            \
      const v yq = vload<v>(yy + j + q * L);                                                                  \
      _Pragma("GCC unroll 16")                                                                                \
      for (int r = 0; r < R; ++r) acc[r][q] += yq + xx[r];                                                    \
    }                                                                                                         \
  }

// MODE_PV: plan times a narrow V (K <= 4): vectorised over 16 columns, K FMAs per 16 pairs
// (the general path broadcasts one weight per pair over the K lanes of V)
#define FL_PANEL_PV_STEP()                                                                                    \
  if (MODE == MODE_PV) {                                                                                      \
    _Pragma("GCC unroll 8")                                                                                   \
    for (int q = 0; q < NV; ++q) {                                                                            \
      const v hq = vload<v>(hs + j + q * L);                                                                  \
      v vk[PV_K];                                                                                             \
      _Pragma("GCC unroll 4")                                                                                 \
      for (int kk = 0; kk < PV_K; ++kk) vk[kk] = kk < a.K ? vload<v>(P + (int64_t)kk * Mp + j + q * L) : zero; \
      /* the exponentials of G rows at a time interleaved (vexp2_n, independent chains hide their latency):   \
         all R rows for double; one by one for float, where interleaving would spill the rows' K accumulators */ \
      constexpr int G = sizeof(T) == 8 ? R : 1;                                                               \
      _Pragma("GCC unroll 16")                                                                                \
      for (int r0 = 0; r0 < R; r0 += G) {                                                                     \
        v e[G];                                                                                               \
        _Pragma("GCC unroll 16")                                                                              \
        for (int g = 0; g < G; ++g) {                                                                         \
          v c = acc[r0 + g][q];                                                                               \
          if (KIND == KIND_DOT) {                                                                             \
            c = c < zero ? zero : c;  /* c is a weight here */                                                \
          } else {                                                                                            \
            c = c < minsq ? minsq : c;                                                                        \
            c = vsqrt(c);                                                                                     \
          }                                                                                                   \
          acc[r0 + g][q] = c;                                                                                 \
          e[g] = (hq - mr[r0 + g]) - c * k;                                                                   \
        }                                                                                                     \
        vexp2_n<G>(e);                                                                                        \
        _Pragma("GCC unroll 16")                                                                              \
        for (int g = 0; g < G; ++g) {                                                                         \
          const int r = r0 + g;                                                                               \
          const v c = acc[r][q];                                                                              \
          v p = e[g];                                                                                         \
          sm[r] += p;                                                                                         \
          if (WK == W_COST) p *= c;                                                                           \
          if (WK == W_INV) p = c > wthr ? p / c : zero;                                                       \
          _Pragma("GCC unroll 4")                                                                             \
          for (int kk = 0; kk < PV_K; ++kk) pa[r][kk] += p * vk[kk];                                          \
        }                                                                                                     \
      }                                                                                                       \
    }                                                                                                         \
    continue;                                                                                                 \
  }

// MODE_PAIR(B, BC): one exponential per pair feeds both the row and the column sum (no max: the caller
// checks the sums and recomputes rows / columns that under- or overflowed); MODE_PAIRB(C) also weight the
// other side's coordinates with it (DS FMAs per side)
#define FL_PANEL_PAIR_STEP()                                                                                  \
  if (MODE == MODE_PAIR || BARY) {                                                                            \
    constexpr int NB = BARY ? DB : 0;                                                                         \
    _Pragma("GCC unroll 8")                                                                                   \
    for (int q = 0; q < NV; ++q) {                                                                            \
      const v hq = vload<v>(hs + j + q * L);                                                                  \
      v yq[DB], colc[DB];                                                                                     \
      _Pragma("GCC unroll 4")                                                                                 \
      for (int d = 0; d < NB; ++d) {                                                                          \
        yq[d] = vload<v>(yT + (int64_t)d * Mp + j + q * L);                                                   \
        colc[d] = zero;                                                                                       \
      }                                                                                                       \
      v colv = zero;                                                                                          \
      _Pragma("GCC unroll 16")                                                                                \
      for (int r = 0; r < R; ++r) {                                                                           \
        v c = acc[r][q];                                                                                      \
        if (KIND == KIND_DIRECT) {                                                                            \
          c = c < minsq ? minsq : c;                                                                          \
          c = vsqrt(c);                                                                                       \
        }                                                                                                     \
        const v e = vexp2((hq + mr[r]) - c * k);                                                              \
        sm[r] += e;                                                                                           \
        _Pragma("GCC unroll 4")                                                                               \
        for (int d = 0; d < NB; ++d) pb[r][d] += e * yq[d];                                                   \
        colv += e;                                                                                            \
        if (MODE == MODE_PAIRBC)                                                                              \
          _Pragma("GCC unroll 4")                                                                             \
          for (int d = 0; d < NB; ++d) colc[d] += e * x[r * DB + d];                                          \
      }                                                                                                       \
      vstore(P + j + q * L, vload<v>(P + j + q * L) + colv);                                                  \
      if (MODE == MODE_PAIRBC) {                                                                              \
        _Pragma("GCC unroll 4")                                                                               \
        for (int d = 0; d < NB; ++d) {                                                                        \
          T* pc = P + (int64_t)(1 + d) * Mp + j + q * L;                                                      \
          vstore(pc, vload<v>(pc) + colc[d]);                                                                 \
        }                                                                                                     \
      }                                                                                                       \
    }                                                                                                         \
    continue;                                                                                                 \
  }

// MODE_LSE, rare (O(log M) times per row): raise the running max of the rows that
// need it, from the absolute scores s = h - k c (m may still be the sentinel).  Then
// s - m is recomputed as (h - m) - k c (more accurate: h - m is exact for h near m),
// unless that disagrees with the maximum by more than rounding: when h and k c are so
// large that their ulp exceeds the headroom (float32 with |h| ~ 1e9, e.g. eps ~ 1e-10),
// it could exceed TH (exp2 overflow: inf, then NaN) or fall far below (every term 0,
// +inf out) where dense is finite; the row then uses s - m from the same s as the max.
#define FL_PANEL_LSE_RAISE()                                                                                  \
  if (CK && __builtin_expect(any_gt(mx, vset<v>(Consts<T>::TH)), 0)) {                                        \
    _Pragma("GCC unroll 16")                                                                                  \
    for (int r = 0; r < R; ++r) {                                                                             \
      v sc[NV];                                                                                               \
      T nm = Consts<T>::SENT;                                                                                 \
      for (int q = 0; q < NV; ++q) {                                                                          \
        sc[q] = vload<v>(hs + j + q * L) - acc[r][q] * k;                                                     \
        nm = std::max(nm, hmax(sc[q]));                                                                       \
      }                                                                                                       \
      if (nm > mr[r] + Consts<T>::TH) {                                                                       \
        sm[r] *= (T)std::exp2(mr[r] - (nm + Consts<T>::H));                                                   \
        mr[r] = nm + Consts<T>::H;                                                                            \
      }                                                                                                       \
      T amax = Consts<T>::SENT;                                                                               \
      for (int q = 0; q < NV; ++q) {                                                                          \
        am[r][q] = (vload<v>(hs + j + q * L) - mr[r]) - acc[r][q] * k;                                        \
        amax = std::max(amax, hmax(am[r][q]));                                                                \
      }                                                                                                       \
      if (!(amax <= Consts<T>::TH && amax >= (nm - mr[r]) - 1))                                               \
        for (int q = 0; q < NV; ++q) am[r][q] = sc[q] - mr[r];                                                \
    }                                                                                                         \
  }

// MODE_LSE: s - m for the whole R x NV block first, then ONE check of its maximum
// against TH (one compare and one mask test per block instead of per
// vector: a sizeable share of the d = 3 kernel's time), then the exponentials.
#define FL_PANEL_LSE_STEP()                                                                                   \
  if (MODE == MODE_LSE) {                                                                                     \
    v am[R][NV];                                                                                              \
    v mx = vset<v>(Consts<T>::SENT);  /* unused (optimised away) when !CK */                                  \
    _Pragma("GCC unroll 8")                                                                                   \
    for (int q = 0; q < NV; ++q) {                                                                            \
      const v hq = vload<v>(hs + j + q * L);                                                                  \
      _Pragma("GCC unroll 16")                                                                                \
      for (int r = 0; r < R; ++r) {                                                                           \
        /* dot costs: a rounding-level negative c changes s by k * O(ulp(|x|^2)),                             \
           like the rounding itself, so no clamp in the exponent */                                           \
        if (KIND == KIND_DIRECT) {                                                                            \
          v c = acc[r][q];                                                                                    \
          c = c < minsq ? minsq : c;                                                                          \
          acc[r][q] = vsqrt(c);                                                                               \
        }                                                                                                     \
        am[r][q] = (hq - mr[r]) - acc[r][q] * k;  /* s - m: one sub + one fnmadd */                           \
        if (CK) mx = am[r][q] > mx ? am[r][q] : mx;                                                           \
      }                                                                                                       \
    }                                                                                                         \
    if (P) {  /* fused alternating step: keep the costs for the column pass (alt_impl) */                     \
      _Pragma("GCC unroll 8")                                                                                 \
      for (int q = 0; q < NV; ++q)                                                                            \
        _Pragma("GCC unroll 16")                                                                              \
        for (int r = 0; r < R; ++r) vstore(P + r * ldp + (j - j0) + q * L, acc[r][q]);                        \
    }                                                                                                         \
    FL_PANEL_LSE_RAISE()                                                                                      \
    _Pragma("GCC unroll 8")                                                                                   \
    for (int q = 0; q < NV; ++q) {                                                                            \
      v e[R];  /* the rows' exponentials interleaved (vexp2_n: independent chains hide their latency) */      \
      _Pragma("GCC unroll 16")                                                                                \
      for (int r = 0; r < R; ++r) e[r] = am[r][q];                                                            \
      vexp2_n<R>(e);                                                                                          \
      _Pragma("GCC unroll 16")                                                                                \
      for (int r = 0; r < R; ++r) sm[r] += e[r];                                                              \
    }                                                                                                         \
    continue;                                                                                                 \
  }

// MODE_P (the step the other modes skip: each of theirs ends with continue): the plan's entries times W,
// row after row into P.
#define FL_PANEL_PLAN_STEP()                                                                                  \
  _Pragma("GCC unroll 8")                                                                                     \
  for (int q = 0; q < NV; ++q) {                                                                              \
    const v hq = vload<v>(hs + j + q * L);                                                                    \
    _Pragma("GCC unroll 16")                                                                                  \
    for (int r = 0; r < R; ++r) {                                                                             \
      v c;                                                                                                    \
      if (KIND == KIND_DOT) {                                                                                 \
        c = acc[r][q];                                                                                        \
        c = c < zero ? zero : c;  /* c is a weight here */                                                    \
      } else {                                                                                                \
        c = acc[r][q];                                                                                        \
        c = c < minsq ? minsq : c;                                                                            \
        c = vsqrt(c);                                                                                         \
      }                                                                                                       \
      v s = hq - c * k;                                                                                       \
      v p = vexp2(s - mr[r]);                                                                                 \
      sm[r] += p;                                                                                             \
      if (WK == W_COST) p *= c;                                                                               \
      /* dcost of |x - y|: 1/C, zero where C = 0 or where the clamp sqrt(minsq)                               \
         is active (the clamp kills the gradient; 1.001 absorbs float rounding) */                            \
      if (WK == W_INV) p = c > wthr ? p / c : zero;                                                           \
      vstore(P + r * ldp + (j - j0) + q * L, p);                                                              \
    }                                                                                                         \
  }

// The rows' state written back (m, sum and the extra accumulators, per mode).
#define FL_PANEL_STORE()                                                                                      \
  if (MODE == MODE_LSE || MODE == MODE_PAIR) {                                                                \
    _Pragma("GCC unroll 16")                                                                                  \
    for (int r = 0; r < R; ++r) { m[r] = mr[r]; sum[r] = sm[r]; }                                             \
  }                                                                                                           \
  if (MODE == MODE_P && sum)                                                                                  \
    for (int r = 0; r < R; ++r) sum[r] = sm[r];                                                               \
  if (BARY)                                                                                                   \
    for (int r = 0; r < R; ++r) {                                                                             \
      sum[r * SV] = sm[r];                                                                                    \
      for (int d = 0; d < DB; ++d) sum[r * SV + 1 + d] = pb[r][d];                                            \
    }                                                                                                         \
  if (MODE == MODE_PV)                                                                                        \
    for (int r = 0; r < R; ++r) {                                                                             \
      for (int kk = 0; kk < PV_K; ++kk) sum[r * (PV_K + 1) + kk] = pa[r][kk];                                 \
      sum[r * (PV_K + 1) + PV_K] = sm[r];                                                                     \
    }

// One panel (see the top of this section).
template <typename T, int R, int NV, int KIND, int DS, int MODE, int WK, bool CK = true>
static inline void panel(const T* __restrict x, const T* __restrict yT, const T* __restrict yy,
                         const T* __restrict hs, int64_t j0, int64_t j1, const Args& a,
                         T* __restrict m, typename VT<T>::v* __restrict sum, T* __restrict P, int64_t ldp) {
  FL_PANEL_SETUP()
  for (int64_t j = j0; j < j1; j += L * NV) {
    FL_PANEL_COSTS()
    FL_PANEL_PV_STEP()
    FL_PANEL_PAIR_STEP()
    FL_PANEL_LSE_STEP()
    FL_PANEL_PLAN_STEP()
  }
  FL_PANEL_STORE()
}
#undef FL_PANEL_SETUP
#undef FL_PANEL_COSTS
#undef FL_PANEL_PV_STEP
#undef FL_PANEL_PAIR_STEP
#undef FL_PANEL_LSE_RAISE
#undef FL_PANEL_LSE_STEP
#undef FL_PANEL_PLAN_STEP
#undef FL_PANEL_STORE

template <typename T, int R, int NV, int KIND, int DS, int MODE, int WK>
static void panel_rows(int nrows, const T* x, const T* yT, const T* yy, const T* hs, int64_t j0, int64_t j1,
                       const Args& a, T* m, typename VT<T>::v* sum, T* P, int64_t ldp) {
  int r = 0;
  const int sv = MODE == MODE_PV ? PV_K + 1 : (MODE == MODE_PAIRB || MODE == MODE_PAIRBC) ? 1 + DS : 1;  // per row
  for (; r + R <= nrows; r += R)
    panel<T, R, NV, KIND, DS, MODE, WK>(x + (int64_t)r * a.D, yT, yy, hs, j0, j1, a, m + r, sum ? sum + r * sv : nullptr,
                                        P ? P + r * ldp : nullptr, ldp);
  for (; r < nrows; ++r)
    panel<T, 1, NV, KIND, DS, MODE, WK>(x + (int64_t)r * a.D, yT, yy, hs, j0, j1, a, m + r, sum ? sum + r * sv : nullptr,
                                        P ? P + r * ldp : nullptr, ldp);
}

// LSE panels of RR rows over columns [j0, j1) with the overflow check skipped where it
// provably cannot fire.  Scores are s_ij = h_j - k c_ij with c_ij >= 0 up to rounding, so
// s_ij - m_r <= hmax - m_r + slack (slack bounds k times the rounding of a negative c); when
// that is <= TH for every row of the group, no score can exceed m_r + TH and the unchecked
// panel is exact.  The first vector block of a row (m still the sentinel) is always checked.
template <typename T, int RR, int NV, int KIND, int DS>
static inline void lse_group(const T* x, const T* yT, const T* yy, const T* hs, int64_t j0, int64_t j1,
                             const Args& a, T* m, typename VT<T>::v* sum, T hmax, T yymax, T* P = nullptr,
                             int64_t ldp = 0) {
  constexpr int L = VT<T>::L;
  int64_t js = j0;
  bool fresh = false;
  for (int r = 0; r < RR; ++r) fresh |= m[r] == Consts<T>::SENT;
  if (fresh) {
    js = std::min<int64_t>(j1, j0 + (int64_t)L * NV);
    panel<T, RR, NV, KIND, DS, MODE_LSE, W_ONE, true>(x, yT, yy, hs, j0, js, a, m, sum, P ? P + j0 : P, ldp);
    if (js >= j1) return;
  }
  const int D = DS > 0 ? DS : a.D;
  T mmin = m[0], xxmax = 0;
  for (int r = 0; r < RR; ++r) {
    mmin = std::min(mmin, m[r]);
    T s = 0;
    if (KIND == KIND_DOT) for (int d = 0; d < D; ++d) s += x[r * D + d] * x[r * D + d];
    xxmax = std::max(xxmax, s);
  }
  const T ulp = std::numeric_limits<T>::epsilon();
  const T slack = KIND == KIND_DOT ? (T)a.kcoef * (xxmax + yymax) * (T)(4 * (D + 2)) * ulp + (T)1 : (T)1;
  if (hmax - mmin + slack <= Consts<T>::TH)
    panel<T, RR, NV, KIND, DS, MODE_LSE, W_ONE, false>(x, yT, yy, hs, js, j1, a, m, sum, P ? P + js : P, ldp);
  else
    panel<T, RR, NV, KIND, DS, MODE_LSE, W_ONE, true>(x, yT, yy, hs, js, j1, a, m, sum, P ? P + js : P, ldp);
}

template <typename T, int R, int NV, int KIND, int DS>
static void lse_rows(int nrows, const T* x, const T* yT, const T* yy, const T* hs, int64_t j0, int64_t j1,
                     const Args& a, T* m, typename VT<T>::v* sum, T* P = nullptr, int64_t ldp = 0) {
  T hmax = -std::numeric_limits<T>::infinity(), yymax = 0;
  for (int64_t j = j0; j < j1; ++j) {
    hmax = std::max(hmax, hs[j]);
    if (KIND == KIND_DOT) yymax = std::max(yymax, yy[j]);
  }
  int r = 0;
  for (; r + R <= nrows; r += R)
    lse_group<T, R, NV, KIND, DS>(x + (int64_t)r * a.D, yT, yy, hs, j0, j1, a, m + r, sum + r, hmax, yymax,
                                  P ? P + r * ldp : P, ldp);
  for (; r < nrows; ++r)
    lse_group<T, 1, NV, KIND, DS>(x + (int64_t)r * a.D, yT, yy, hs, j0, j1, a, m + r, sum + r, hmax, yymax,
                                  P ? P + r * ldp : P, ldp);
}

static int64_t col_chunk(int D, int extra, int64_t Mp, int64_t step, int64_t l2, size_t esz) {
  int64_t bm = l2 / ((int64_t)(D + extra) * (int64_t)esz);
  bm = (bm / step) * step;
  if (bm < step) bm = step;
  if (bm > Mp) bm = Mp;
  return bm;
}

// Plan products in two modes.  Two passes (single = 0): the row's base-2 shift is its LSE from a
// first pass (lse), so every weight is <= 1, and the output is scaled by exp(alpha_i) 2^lse_i.
// One pass (single = 1): the shift is -alpha_i log2(e), i.e. the weights ARE the plan entries
// exp(alpha_i + beta_j - C_ij / eps) (no LSE pass); the caller checks the returned row masses and
// redoes unusable rows with two passes.  Rows with alpha_i = -inf give exact zeros either way.
template <typename T>
static inline T row_shift(int single, const T* lse, const T* alpha, int64_t i) {
  if (single) return std::isfinite(alpha[i]) ? -alpha[i] * (T)1.4426950408889634 : (T)0;
  return std::isfinite(lse[i]) ? lse[i] : (T)0;
}
template <typename T>
static inline T row_factor(int single, const T* lse, const T* alpha, int64_t i, T wconst) {
  if (single) return std::isfinite(alpha[i]) ? wconst : (T)0;
  return std::isfinite(lse[i]) ? (T)std::exp2(alpha[i] * (T)1.4426950408889634 + lse[i]) * wconst : (T)0;
}

// The LSE micro-kernel shape (rows R, vectors NV, static D or 0) for (cfg, D): cfg 0 (d <= 32): 12 rows x
// 1 vector with a static D for d <= 3 (best of 4x2, 6x2, 8x2, 8x1, 12x1, 16x1 at d = 3: 5% over 4x2),
// 4 rows x 2 vectors for 4 <= d <= 32; cfg 3 (larger d): 4 rows x 4 vectors (best of 4x2, 6x2, 8x2,
// 4x4, 8x3 at d = 64).  Calls run(LseShape<R, NV, DS>{}); -1 for an unknown cfg.
template <int R_, int NV_, int DS_> struct LseShape { static constexpr int R = R_, NV = NV_, DS = DS_; };
template <typename F>
static int with_lse_shape(int cfg, int D, F&& run) {
  if (cfg == 0) {
    switch (D) {
      case 1: run(LseShape<Shape::SMALL_R, 1, 1>{}); return 0;
      case 2: run(LseShape<Shape::SMALL_R, 1, 2>{}); return 0;
      case 3: run(LseShape<Shape::SMALL_R, 1, 3>{}); return 0;
      default: run(LseShape<Shape::MID_R, Shape::MID_NV, 0>{}); return 0;
    }
  }
  if (cfg == 3) { run(LseShape<Shape::BIG_R, Shape::BIG_NV, 0>{}); return 0; }
  return -1;
}

// The point clouds of an argument struct (abi.h), typed.
template <typename T>
struct Cloud {
  const T *x, *yT, *yy, *hs;
  explicit Cloud(const flashot_stream& s)
      : x((const T*)s.x), yT((const T*)s.yT), yy((const T*)s.yy), hs((const T*)s.hs) {}
};

}  // namespace

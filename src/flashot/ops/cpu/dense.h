// flashot CPU kernels: the dense streamed kernels (softmin, symmetric pair step, fused alternating step,
// plan products) and their dispatch from the argument structs (abi.h).
#pragma once
#include "abi.h"
#include "colsum.h"
#include "fpenv.h"
#include "panel.h"
#include "parallel.h"

namespace {

// out[b, i] = oscale * LSE_j (hs_j - C_ij / eps) (+inf/-inf handled), x (B,N,D), yT (B,D,Mp)
template <typename T, int R, int NV, int KIND, int DS>
static void softmin_impl(const T* x, const T* yT, const T* yy, const T* hs, T* out, int B, int64_t N,
                         int64_t Mp, const Args& a, T oscale, int64_t l2, int nth) {
  typedef typename VT<T>::v v;
  constexpr int L = VT<T>::L;
  const int D = a.D;
  const int RB = R * 16;
  const int64_t nb = (N + RB - 1) / RB;
  const int64_t bm = col_chunk(D, 2, Mp, (int64_t)L * NV, l2, sizeof(T));
  Tasks tasks((int64_t)B * nb);
  run_team(nth, [&](int tid) {
    FpScope fp(tid);
    for (int64_t t; tasks.next(t);) {
      const int64_t b = t / nb, i0 = (t % nb) * RB;
      const int nr = (int)std::min<int64_t>(RB, N - i0);
      T m[RB];
      v sum[RB];
      for (int r = 0; r < nr; ++r) { m[r] = Consts<T>::SENT; sum[r] = v{}; }
      const T* xb = x + (b * N + i0) * D;
      const T* yTb = yT + b * (int64_t)D * Mp;
      const T* yyb = yy + b * Mp;
      const T* hb = hs + b * Mp;
      for (int64_t j0 = 0; j0 < Mp; j0 += bm) {
        const int64_t j1 = std::min(Mp, j0 + bm);
        lse_rows<T, R, NV, KIND, DS>(nr, xb, yTb, yyb, hb, j0, j1, a, m, sum);
      }
      for (int r = 0; r < nr; ++r) {
        T lse = (m[r] == Consts<T>::SENT) ? -std::numeric_limits<T>::infinity() : m[r] + std::log2(hsum(sum[r]));
        out[b * N + i0 + r] = oscale * lse;
      }
    }
  });
}

// Symmetric Sinkhorn step in one pass: rsum[b, i] = sum_j E_ij and csum[b, j] = sum_i E_ij with
// E_ij = 2^(hx_i + hs_j - k c_ij) (base-2 log-weights, no running max).  Column sums: per group of
// row blocks, combined in group order (col_groups: the same bits for any thread count).
// sym (y is x, hs is hx padded): E is symmetric, so only the upper triangle is computed, by
// blocks: a row block takes its diagonal block (row sums only) and the columns right of it
// (row and column sums); the full row sum is then rsum + csum: half the exponentials.
template <typename T, int R, int NV, int KIND, int DS>
static void pair_impl(const T* x, const T* yT, const T* yy, const T* hs, const T* hx, T* rsum, T* csum, int B,
                      int64_t N, int64_t Mp, const Args& a, bool sym, int64_t l2, int nth) {
  typedef typename VT<T>::v v;
  const int D = a.D;
  const int RB = R * 16;
  const int64_t nb = (N + RB - 1) / RB;
  const int64_t bm = col_chunk(D, 3, Mp, (int64_t)VT<T>::L * NV, l2, sizeof(T));
  const int64_t nt = (int64_t)B * nb;
  const size_t per = (size_t)B * Mp;
  const int64_t G = col_groups(nt, (int64_t)(per * sizeof(T)));
  // scratch: column sums of diagonal blocks, discarded
  col_group_pass<T>(G, per, sym ? (size_t)Mp : 0, csum, nth, [&](int64_t g, T* cacc, T* scratch) {
    for (int64_t t = g; t < nt; t += G) {
      const int64_t b = t / nb, i0 = (t % nb) * RB;
      const int nr = (int)std::min<int64_t>(RB, N - i0);
      T m[RB];
      v sum[RB];
      for (int r = 0; r < nr; ++r) { m[r] = hx[b * N + i0 + r]; sum[r] = v{}; }
      const T* xb = x + (b * N + i0) * D;
      const T* yTb = yT + b * (int64_t)D * Mp;
      const T* yyb = yy + b * Mp;
      const T* hb = hs + b * Mp;
      int64_t jstart = 0;
      if (sym) {
        jstart = std::min<int64_t>(Mp, i0 + RB);
        panel_rows<T, R, NV, KIND, DS, MODE_PAIR, W_ONE>(nr, xb, yTb, yyb, hb, i0, jstart, a, m, sum, scratch, 0);
      }
      for (int64_t j0 = jstart; j0 < Mp; j0 += bm) {
        const int64_t j1 = std::min(Mp, j0 + bm);
        panel_rows<T, R, NV, KIND, DS, MODE_PAIR, W_ONE>(nr, xb, yTb, yyb, hb, j0, j1, a, m, sum, cacc + b * Mp, 0);
      }
      for (int r = 0; r < nr; ++r) rsum[b * N + i0 + r] = hsum(sum[r]);
    }
  });
}

// acc[r, :] += sum_j P[r, j] V[j, :] for RR rows; V (w, K) row-major, K a multiple of L.
template <typename T, int RR>
static inline void mgemm_rows(const T* __restrict P, int64_t ldp, const T* __restrict V, int K, int64_t w,
                              T* __restrict acc) {
  typedef typename VT<T>::v v;
  constexpr int L = VT<T>::L;
  constexpr int KV = 4;
  int k0 = 0;
  for (; k0 + KV * L <= K; k0 += KV * L) {
    v a[RR][KV];
#pragma GCC unroll 4
    for (int r = 0; r < RR; ++r)
#pragma GCC unroll 4
      for (int q = 0; q < KV; ++q) a[r][q] = vload<v>(acc + (int64_t)r * K + k0 + q * L);
    for (int64_t j = 0; j < w; ++j) {
      v vv[KV];
#pragma GCC unroll 4
      for (int q = 0; q < KV; ++q) vv[q] = vload<v>(V + j * K + k0 + q * L);
#pragma GCC unroll 4
      for (int r = 0; r < RR; ++r) {
        const T pj = P[r * ldp + j];
#pragma GCC unroll 4
        for (int q = 0; q < KV; ++q) a[r][q] += pj * vv[q];
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RR; ++r)
#pragma GCC unroll 4
      for (int q = 0; q < KV; ++q) vstore(acc + (int64_t)r * K + k0 + q * L, a[r][q]);
  }
  for (; k0 < K; k0 += L) {
    v a[RR];
#pragma GCC unroll 4
    for (int r = 0; r < RR; ++r) a[r] = vload<v>(acc + (int64_t)r * K + k0);
    for (int64_t j = 0; j < w; ++j) {
      const v vv = vload<v>(V + j * K + k0);
#pragma GCC unroll 4
      for (int r = 0; r < RR; ++r) a[r] += P[r * ldp + j] * vv;
    }
#pragma GCC unroll 4
    for (int r = 0; r < RR; ++r) vstore(acc + (int64_t)r * K + k0, a[r]);
  }
}

// out[b,i,:] = exp(alpha_i + lse_i) * wconst * sum_j exp(hs_j - C_ij/eps - lse_i) W_ij V[j, :]
// (V: (B, Mp, K) row-major with K padded to a multiple of the vector width; out (B, N, K))
template <typename T, int NV, int KIND, int WK>
static void plan_impl(const T* x, const T* yT, const T* yy, const T* hs, const T* lse, const T* alpha,
                      const T* VTm, int K, T* out, T* mass, int single, int B, int64_t N, int64_t Mp, const Args& a,
                      T wconst, int64_t l2, int nth) {
  typedef typename VT<T>::v v;
  constexpr int L = VT<T>::L;
  constexpr int R = 4;
  const int D = a.D;
  const int RB = 32;
  const int64_t nb = (N + RB - 1) / RB;
  const int64_t bm = col_chunk(D + K, 2, Mp, (int64_t)L * NV, l2, sizeof(T));
  Tasks tasks((int64_t)B * nb);
  run_team(nth, [&](int tid) {
    FpScope fp(tid);
    std::vector<T> Pbuf((size_t)RB * bm), acc((size_t)RB * K);
    for (int64_t t; tasks.next(t);) {
      const int64_t b = t / nb, i0 = (t % nb) * RB;
      const int nr = (int)std::min<int64_t>(RB, N - i0);
      T m[RB];
      v msum[RB];
      for (int r = 0; r < nr; ++r) {
        m[r] = row_shift(single, lse, alpha, b * N + i0 + r);
        msum[r] = v{};
      }
      std::fill(acc.begin(), acc.end(), (T)0);
      const T* xb = x + (b * N + i0) * D;
      const T* yTb = yT + b * (int64_t)D * Mp;
      const T* yyb = yy + b * Mp;
      const T* hb = hs + b * Mp;
      const T* Vb = VTm + b * (int64_t)K * Mp;  // (Mp, K) row-major, K = padded width
      for (int64_t j0 = 0; j0 < Mp; j0 += bm) {
        const int64_t j1 = std::min(Mp, j0 + bm), w = j1 - j0;
        panel_rows<T, R, NV, KIND, 0, MODE_P, WK>(nr, xb, yTb, yyb, hb, j0, j1, a, m, msum, Pbuf.data(), bm);
        // acc (nr x Kp) += P (nr x w) @ V[j0:j1] (w x Kp): register-blocked, 4 rows x 4 vectors
        int r = 0;
        for (; r + Shape::MG_R <= nr; r += Shape::MG_R)
          mgemm_rows<T, Shape::MG_R>(Pbuf.data() + (int64_t)r * bm, bm, Vb + j0 * K, K, w, acc.data() + (size_t)r * K);
        for (; r < nr; ++r) mgemm_rows<T, 1>(Pbuf.data() + (int64_t)r * bm, bm, Vb + j0 * K, K, w, acc.data() + (size_t)r * K);
      }
      for (int r = 0; r < nr; ++r) {
        const T f = row_factor(single, lse, alpha, b * N + i0 + r, wconst);
        T* o = out + (b * N + i0 + r) * K;
        for (int kk = 0; kk < K; ++kk) o[kk] = f == 0 ? (T)0 : acc[(size_t)r * K + kk] * f;
        mass[b * N + i0 + r] = hsum(msum[r]);
      }
    }
  });
}

template <typename T, int KIND>
static int softmin_dispatch(const T* x, const T* yT, const T* yy, const T* hs, T* out, int B, int64_t N,
                            int64_t Mp, const Args& a, T oscale, int cfg, int64_t l2, int nth) {
  return with_lse_shape(cfg, a.D, [&](auto s) {
    using S = decltype(s);
    softmin_impl<T, S::R, S::NV, KIND, S::DS>(x, yT, yy, hs, out, B, N, Mp, a, oscale, l2, nth);
  });
}

// Fused alternating Sinkhorn step: rlse[b, i] = LSE2_j (hs_j - k c_ij) (the softmin onto x) and
// clse[b, j] = LSE2_i (w_i - k c_ij) with the rows' NEW weights w_i = ha_i - lam rlse_i (the softmin
// onto y that follows it), from ONE computation of the costs.  Per block of rows, pass A runs the
// streaming LSE and stores the block's costs in a per-thread scratch (RB x Mp, in L2/L3); pass B
// reads them back into per-thread column (max, sum) states, merged at the end.  All base 2.
constexpr size_t ALT_SCRATCH_BYTES = 1280 * 1024;

template <typename T, int R, int NV, int KIND>
static void alt_impl(const T* x, const T* yT, const T* yy, const T* hs, const T* ha, T lam, T* rlse, T* clse,
                     int B, int64_t N, int64_t Mp, const Args& a, int64_t l2, int nth) {
  typedef typename VT<T>::v v;
  constexpr int L = VT<T>::L;
  const int D = a.D;
  // rows per block: the block's costs (RB x Mp) should stay near the core (L2 / nearby L3):
  // measured at n = m = 20,000, d = 64: 16 rows 0.40 s, 64 rows 0.53 s, 128 rows 0.54 s
  const int64_t fit = (int64_t)(ALT_SCRATCH_BYTES / ((size_t)Mp * sizeof(T)));
  const int RB = (int)std::max<int64_t>(2 * R, std::min<int64_t>(16 * R, fit / R * R));
  const int64_t nb = (N + RB - 1) / RB;
  const int64_t bm = col_chunk(D, 2, Mp, (int64_t)L * NV, l2, sizeof(T));
  const T k = (T)a.kcoef;
  const int64_t nt = (int64_t)B * nb;
  const size_t per = (size_t)B * Mp;
  const int64_t G = col_groups(nt, (int64_t)(2 * per * sizeof(T)));  // column states per group (col_groups)
  std::unique_ptr<T[]> cmax(new T[(size_t)G * per]), csum(new T[(size_t)G * per]);
  Tasks tasks(G);
  run_team(nth, [&](int tid) {
    FpScope fp(tid);
    std::vector<T> scratch((size_t)RB * Mp);
    T* P = scratch.data();
    for (int64_t g; tasks.next(g);) {
      T* cm_g = cmax.get() + (size_t)g * per;
      T* cs_g = csum.get() + (size_t)g * per;
      std::fill(cm_g, cm_g + per, Consts<T>::SENT);
      std::fill(cs_g, cs_g + per, (T)0);
      for (int64_t t = g; t < nt; t += G) {
        const int64_t b = t / nb, i0 = (t % nb) * RB;
        const int nr = (int)std::min<int64_t>(RB, N - i0);
        T m[16 * R], w[16 * R];
        v sum[16 * R];
        for (int r = 0; r < nr; ++r) { m[r] = Consts<T>::SENT; sum[r] = v{}; }
        const T* xb = x + (b * N + i0) * D;
        const T* yTb = yT + b * (int64_t)D * Mp;
        const T* yyb = yy + b * Mp;
        const T* hb = hs + b * Mp;
        for (int64_t j0 = 0; j0 < Mp; j0 += bm) {  // pass A: row LSEs, costs kept
          const int64_t j1 = std::min(Mp, j0 + bm);
          lse_rows<T, R, NV, KIND, 0>(nr, xb, yTb, yyb, hb, j0, j1, a, m, sum, P, Mp);
        }
        for (int r = 0; r < nr; ++r) {
          const int64_t i = b * N + i0 + r;
          const T lse = (m[r] == Consts<T>::SENT) ? -std::numeric_limits<T>::infinity() : m[r] + std::log2(hsum(sum[r]));
          rlse[i] = lse;
          w[r] = alt_row_weight(ha[i], lse, lam);
        }
        col_states(P, Mp, nr, w, k, Mp, cm_g + b * Mp, cs_g + b * Mp);  // pass B
      }
    }
  });
  merge_col_states(cmax.get(), csum.get(), G, per, clse, nth);
}

template <typename T>
static int alt_entry(const T* x, const T* yT, const T* yy, const T* hs, const T* ha, double lam, T* rlse, T* clse,
                     int B, int64_t N, int64_t Mp, int D, double kcoef, double minsq, int kind, int cfg, int64_t l2,
                     int nth) {
  Args a{D, Mp, kcoef, minsq};
  if (cfg != 0 && cfg != 3) return -1;
  if (kind == KIND_DOT) {
    if (cfg == 0) alt_impl<T, Shape::MID_R, Shape::MID_NV, KIND_DOT>(x, yT, yy, hs, ha, (T)lam, rlse, clse, B, N, Mp, a, l2, nth);
    else alt_impl<T, Shape::BIG_R, Shape::BIG_NV, KIND_DOT>(x, yT, yy, hs, ha, (T)lam, rlse, clse, B, N, Mp, a, l2, nth);
    return 0;
  }
  if (kind == KIND_DIRECT) {
    if (cfg == 0) alt_impl<T, Shape::MID_R, Shape::MID_NV, KIND_DIRECT>(x, yT, yy, hs, ha, (T)lam, rlse, clse, B, N, Mp, a, l2, nth);
    else alt_impl<T, Shape::BIG_R, Shape::BIG_NV, KIND_DIRECT>(x, yT, yy, hs, ha, (T)lam, rlse, clse, B, N, Mp, a, l2, nth);
    return 0;
  }
  return -2;
}

template <typename T, int KIND>
static int pair_dispatch(const T* x, const T* yT, const T* yy, const T* hs, const T* hx, T* rs, T* cs, int B,
                         int64_t N, int64_t Mp, const Args& a, bool sym, int cfg, int64_t l2, int nth) {
  return with_lse_shape(cfg, a.D, [&](auto s) {
    using S = decltype(s);
    pair_impl<T, S::R, S::NV, KIND, S::DS>(x, yT, yy, hs, hx, rs, cs, B, N, Mp, a, sym, l2, nth);
  });
}

template <typename T>
static int pair_entry(const T* x, const T* yT, const T* yy, const T* hs, const T* hx, T* rs, T* cs, int B, int64_t N,
                      int64_t Mp, int D, double kcoef, double minsq, int kind, int cfg, int sym, int64_t l2,
                      int nth) {
  Args a{D, Mp, kcoef, minsq};
  // sym is a run-time flag: it changes which column ranges a row block visits, not the inner loop
  if (kind == KIND_DOT) return pair_dispatch<T, KIND_DOT>(x, yT, yy, hs, hx, rs, cs, B, N, Mp, a, sym, cfg, l2, nth);
  if (kind == KIND_DIRECT)
    return pair_dispatch<T, KIND_DIRECT>(x, yT, yy, hs, hx, rs, cs, B, N, Mp, a, sym, cfg, l2, nth);
  return -2;
}

template <typename T>
static int softmin_entry(const T* x, const T* yT, const T* yy, const T* hs, T* out, int B, int64_t N, int64_t Mp,
                         int D, double kcoef, double minsq, int kind, double oscale, int cfg, int64_t l2, int nth) {
  Args a{D, Mp, kcoef, minsq};
  if (kind == KIND_DOT) return softmin_dispatch<T, KIND_DOT>(x, yT, yy, hs, out, B, N, Mp, a, (T)oscale, cfg, l2, nth);
  if (kind == KIND_DIRECT) return softmin_dispatch<T, KIND_DIRECT>(x, yT, yy, hs, out, B, N, Mp, a, (T)oscale, cfg, l2, nth);
  return -2;
}

// Narrow V (K <= PV_K): out[b,i,k] = exp(alpha_i + lse_i) * wconst * sum_j 2^(hs_j - k c_ij - lse2_i) W_ij V[j,k]
// in one pass after the LSE pass, V given transposed (B, K, Mp), zero-padded columns.
template <typename T, int NV, int KIND, int WK>
static void plan_pv_impl(const T* x, const T* yT, const T* yy, const T* hs, const T* lse, const T* alpha,
                         const T* VTk, T* out, T* mass, int single, int B, int64_t N, int64_t Mp, const Args& a,
                         T wconst, int64_t l2, int nth) {
  typedef typename VT<T>::v v;
  constexpr int R = Shape::PV_R;
  const int D = a.D, K = a.K;
  const int RB = 64;
  const int64_t nb = (N + RB - 1) / RB;
  const int64_t bm = col_chunk(D + K, 2, Mp, (int64_t)VT<T>::L * NV, l2, sizeof(T));
  Tasks tasks((int64_t)B * nb);
  run_team(nth, [&](int tid) {
    FpScope fp(tid);
    for (int64_t t; tasks.next(t);) {
      const int64_t b = t / nb, i0 = (t % nb) * RB;
      const int nr = (int)std::min<int64_t>(RB, N - i0);
      T m[RB];
      v pa[RB * (PV_K + 1)];
      for (int r = 0; r < nr; ++r) {
        m[r] = row_shift(single, lse, alpha, b * N + i0 + r);
        for (int kk = 0; kk <= PV_K; ++kk) pa[r * (PV_K + 1) + kk] = v{};
      }
      const T* xb = x + (b * N + i0) * D;
      const T* yTb = yT + b * (int64_t)D * Mp;
      const T* yyb = yy + b * Mp;
      const T* hb = hs + b * Mp;
      const T* Vb = VTk + b * (int64_t)K * Mp;
      for (int64_t j0 = 0; j0 < Mp; j0 += bm) {
        const int64_t j1 = std::min(Mp, j0 + bm);
        panel_rows<T, R, NV, KIND, 0, MODE_PV, WK>(nr, xb, yTb, yyb, hb, j0, j1, a, m, pa, const_cast<T*>(Vb), 0);
      }
      for (int r = 0; r < nr; ++r) {
        const T f = row_factor(single, lse, alpha, b * N + i0 + r, wconst);
        T* o = out + (b * N + i0 + r) * K;
        for (int kk = 0; kk < K; ++kk) o[kk] = f == 0 ? (T)0 : hsum(pa[r * (PV_K + 1) + kk]) * f;
        mass[b * N + i0 + r] = hsum(pa[r * (PV_K + 1) + PV_K]);
      }
    }
  });
}

template <typename T>
static int plan_entry(const T* x, const T* yT, const T* yy, const T* hs, const T* lse, const T* alpha, const T* VTm,
                      int K, T* out, T* mass, int single, int B, int64_t N, int64_t Mp, int D, double kcoef,
                      double minsq, int kind, int wk, double wconst, int narrow, int64_t l2, int nth) {
  Args a{D, Mp, kcoef, minsq, K};
  if (narrow && K > PV_K) return -3;
#define FL_PLAN(KD, W) (narrow ? plan_pv_impl<T, 1, KD, W>(x, yT, yy, hs, lse, alpha, VTm, out, mass, single, B, N, Mp, a, \
                                                         (T)wconst, l2, nth) \
                           : plan_impl<T, 2, KD, W>(x, yT, yy, hs, lse, alpha, VTm, K, out, mass, single, B, N, Mp, a, \
                                                    (T)wconst, l2, nth))
  if (kind == KIND_DOT) {
    if (wk == W_ONE) { FL_PLAN(KIND_DOT, W_ONE); return 0; }
    if (wk == W_COST) { FL_PLAN(KIND_DOT, W_COST); return 0; }
  } else if (kind == KIND_DIRECT) {
    if (wk == W_ONE) { FL_PLAN(KIND_DIRECT, W_ONE); return 0; }
    if (wk == W_COST) { FL_PLAN(KIND_DIRECT, W_COST); return 0; }
    if (wk == W_INV) { FL_PLAN(KIND_DIRECT, W_INV); return 0; }
  }
#undef FL_PLAN
  return -2;
}

// ---- the entry points' bodies (abi.h): the argument structs unpacked ----
template <typename T>
static int softmin_call(const flashot_lse_args* p) {
  const flashot_stream& s = p->s;
  const Cloud<T> c(s);
  return softmin_entry<T>(c.x, c.yT, c.yy, c.hs, (T*)p->out, s.B, s.N, s.Mp, s.D, s.kcoef, s.minsq, s.kind, p->oscale,
                          s.cfg, s.l2, s.nth);
}

template <typename T>
static int pair_call(const flashot_rowcol_args* p) {
  const flashot_stream& s = p->s;
  const Cloud<T> c(s);
  return pair_entry<T>(c.x, c.yT, c.yy, c.hs, (const T*)p->hx, (T*)p->rows, (T*)p->cols, s.B, s.N, s.Mp, s.D, s.kcoef,
                       s.minsq, s.kind, s.cfg, p->sym, s.l2, s.nth);
}

template <typename T>
static int alt_call(const flashot_rowcol_args* p) {
  const flashot_stream& s = p->s;
  const Cloud<T> c(s);
  return alt_entry<T>(c.x, c.yT, c.yy, c.hs, (const T*)p->hx, p->lam, (T*)p->rows, (T*)p->cols, s.B, s.N, s.Mp, s.D,
                      s.kcoef, s.minsq, s.kind, s.cfg, s.l2, s.nth);
}

template <typename T>
static int plan_call(const flashot_plan_args* p) {
  const flashot_stream& s = p->s;
  const Cloud<T> c(s);
  return plan_entry<T>(c.x, c.yT, c.yy, c.hs, (const T*)p->lse, (const T*)p->alpha, (const T*)p->V, p->K, (T*)p->out,
                       (T*)p->mass, p->single, s.B, s.N, s.Mp, s.D, s.kcoef, s.minsq, s.kind, p->wk, p->wconst,
                       p->narrow, s.l2, s.nth);
}

}  // namespace

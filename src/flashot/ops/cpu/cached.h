// flashot CPU kernels: the cached cost matrix path (row / column LogSumExp, the alternating step and
// the plan weights over a cost matrix C held in memory).
#pragma once
#include "abi.h"
#include "colsum.h"
#include "fpenv.h"
#include "panel.h"
#include "parallel.h"
#include "vecmath.h"

namespace {

// ---- cached-cost passes: C (B, N, M) row-major --------------------------------
// Row-wise: out[b,i] = oscale * LSE_j (h_j - C_ij / eps)
template <typename T>
static inline T row_lse2(const T* c, const T* hb, int64_t M, T inv_eps) {
  typedef typename VT<T>::v v;
  constexpr int L = VT<T>::L;
  T m = Consts<T>::SENT;
  v s0 = {}, s1 = {};
  int64_t j = 0;
  for (; j + 2 * L <= M; j += 2 * L) {
    v a0 = vload<v>(hb + j) - vload<v>(c + j) * inv_eps;
    v a1 = vload<v>(hb + j + L) - vload<v>(c + j + L) * inv_eps;
    v thr = vset<v>(m + Consts<T>::TH);
    if (__builtin_expect(any_gt(a0, thr) || any_gt(a1, thr), 0)) {
      T nm = std::max(hmax(a0), hmax(a1));
      if (nm > m + Consts<T>::TH) { T f = std::exp2(m - (nm + Consts<T>::H)); s0 *= f; s1 *= f; m = nm + Consts<T>::H; }
    }
    s0 += vexp2(a0 - m);
    s1 += vexp2(a1 - m);
  }
  T s = hsum(s0 + s1);
  for (; j < M; ++j) {
    T a = hb[j] - c[j] * inv_eps;
    if (a > m + Consts<T>::TH) { s *= std::exp2(m - (a + Consts<T>::H)); m = a + Consts<T>::H; }
    if (a - m > Consts<T>::LO) s += std::exp2(a - m);
  }
  return (m == Consts<T>::SENT) ? -std::numeric_limits<T>::infinity() : m + std::log2(s);
}

template <typename T>
static void rows_lse(const T* C, const T* h, T* out, int B, int64_t N, int64_t M, T inv_eps, T oscale, int nth) {
  Tasks tasks((int64_t)B * N, std::max<int64_t>(1, ((int64_t)B * N) / (8 * (int64_t)nth)));
  run_team(nth, [&](int tid) {
    FpScope fp(tid);
    for (int64_t b_, e_; tasks.next(b_, e_);)
      for (int64_t t = b_; t < e_; ++t) out[t] = oscale * row_lse2(C + t * M, h + (t / N) * M, M, inv_eps);
  });
}

// out[j] = oscale * LSE2_i (h_i - C_ij / eps) for the stripe of w columns at C (rows of stride M):
// nv vector states then a scalar tail of w - nv L columns.  Rows go two per sweep: half the state traffic.
// Always inlined into cols_lse's task loop, the loop it was written in: a call boundary there changes the
// generated loop (slower).
template <typename T>
FL_INLINE void cols_lse_stripe(const T* C, const T* hb, T* out, int64_t N, int64_t M, int64_t w, T inv_eps,
                               T oscale) {
  typedef typename VT<T>::v v;
  constexpr int L = VT<T>::L;
  const int64_t nv = w / L;
  std::vector<v> mvec(nv + 1), svec(nv + 1);
  v* __restrict mv = mvec.data();
  v* __restrict sv = svec.data();
  T ms[16], ss[16];
  for (int64_t q = 0; q < nv; ++q) { mv[q] = vset<v>(Consts<T>::SENT); sv[q] = v{}; }
  for (int64_t q = nv * L; q < w; ++q) { ms[q - nv * L] = Consts<T>::SENT; ss[q - nv * L] = 0; }
  int64_t i = 0;
  for (; i + 2 <= N; i += 2) {
    const T* c0 = C + i * M;
    const T* c1 = c0 + M;
    const T h0 = hb[i], h1 = hb[i + 1];
    for (int64_t q = 0; q < nv; ++q) {
      v a0 = h0 - vload<v>(c0 + q * L) * inv_eps;
      v a1 = h1 - vload<v>(c1 + q * L) * inv_eps;
      v mq = mv[q];
      v amax = a0 > a1 ? a0 : a1;
      if (__builtin_expect(any_gt(amax, mq + Consts<T>::TH), 0)) {
        v up = amax + Consts<T>::H;  // raise every lane that trails the block by H
        v nm = up > mq ? up : mq;
        sv[q] *= vexp2(mq - nm);
        mv[q] = mq = nm;
      }
      sv[q] += vexp2(a0 - mq) + vexp2(a1 - mq);
    }
    for (int64_t q = nv * L; q < w; ++q) {
      col_push(ms[q - nv * L], ss[q - nv * L], h0 - c0[q] * inv_eps);
      col_push(ms[q - nv * L], ss[q - nv * L], h1 - c1[q] * inv_eps);
    }
  }
  for (; i < N; ++i) {
    const T* c = C + i * M;
    const T hi = hb[i];
    for (int64_t q = 0; q < nv; ++q) {
      v a = hi - vload<v>(c + q * L) * inv_eps;
      if (__builtin_expect(any_gt(a, mv[q] + Consts<T>::TH), 0)) {
        v up = a + Consts<T>::H;
        v nm = up > mv[q] ? up : mv[q];
        sv[q] *= vexp2(mv[q] - nm);
        mv[q] = nm;
      }
      sv[q] += vexp2(a - mv[q]);
    }
    for (int64_t q = nv * L; q < w; ++q) col_push(ms[q - nv * L], ss[q - nv * L], hi - c[q] * inv_eps);
  }
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t q = 0; q < nv; ++q)
    for (int l = 0; l < L; ++l) {
      const T mm = mv[q][l];
      out[q * L + l] = oscale * (mm == Consts<T>::SENT ? ninf : mm + std::log2(sv[q][l]));
    }
  for (int64_t q = nv * L; q < w; ++q) {
    const int64_t u = q - nv * L;
    out[q] = oscale * (ms[u] == Consts<T>::SENT ? ninf : ms[u] + std::log2(ss[u]));
  }
}

// Column-wise (the transposed problem): out[b,j] = oscale * LSE_i (h_i - C_ij / eps)
template <typename T>
static void cols_lse(const T* C, const T* h, T* out, int B, int64_t N, int64_t M, T inv_eps, T oscale, int nth) {
  constexpr int L = VT<T>::L;
  // Each task owns a wide stripe of columns (long contiguous reads of every
  // row, friendly to the prefetchers); per-column state lives in L1/L2.
  int64_t CB = (M + nth - 1) / nth;
  CB = std::max<int64_t>(4 * L, ((CB + L - 1) / L) * L);
  const int64_t nb = (M + CB - 1) / CB;
  Tasks tasks((int64_t)B * nb);
  run_team(nth, [&](int tid) {
    FpScope fp(tid);
    for (int64_t t; tasks.next(t);) {
      const int64_t b = t / nb, j0 = (t % nb) * CB, w = std::min(CB, M - j0);
      cols_lse_stripe(C + b * N * M + j0, h + b * N, out + b * M + j0, N, M, w, inv_eps, oscale);
    }
  });
}

// Cached alternating step over C (B, N, M): rlse[b, i] = LSE2_j (hs_j - k C_ij), then
// clse[b, j] = LSE2_i (ha_i - lam rlse_i - k C_ij), reading C from memory once: each block of
// rows is read for its row LSEs and again, from L2, for the column states.
template <typename T>
static void cached_alt(const T* C, const T* hs, const T* ha, T lam, T k, T* rlse, T* clse, int B, int64_t N,
                       int64_t M, int nth) {
  const int RB = (int)std::max<int64_t>(1, std::min<int64_t>(32, (int64_t)(512 * 1024) / (M * (int64_t)sizeof(T))));
  const int64_t nb = (N + RB - 1) / RB;
  const int64_t nt = (int64_t)B * nb;
  const size_t per = (size_t)B * M;
  const int64_t G = col_groups(nt, (int64_t)(2 * per * sizeof(T)));  // column states per group (col_groups)
  std::unique_ptr<T[]> cmax(new T[(size_t)G * per]), csum(new T[(size_t)G * per]);
  Tasks tasks(G);
  run_team(nth, [&](int tid) {
    FpScope fp(tid);
    std::vector<T> w(RB);
    for (int64_t g; tasks.next(g);) {
      T* cm_g = cmax.get() + (size_t)g * per;
      T* cs_g = csum.get() + (size_t)g * per;
      std::fill(cm_g, cm_g + per, Consts<T>::SENT);
      std::fill(cs_g, cs_g + per, (T)0);
      for (int64_t t = g; t < nt; t += G) {
        const int64_t b = t / nb, i0 = (t % nb) * RB;
        const int nr = (int)std::min<int64_t>(RB, N - i0);
        const T* Cb = C + (b * N + i0) * M;
        for (int r = 0; r < nr; ++r) {
          const int64_t i = b * N + i0 + r;
          const T lse = row_lse2(Cb + (int64_t)r * M, hs + b * M, M, k);
          rlse[i] = lse;
          w[r] = alt_row_weight(ha[i], lse, lam);
        }
        col_states(Cb, M, nr, w.data(), k, M, cm_g + b * M, cs_g + b * M);
      }
    }
  });
  merge_col_states(cmax.get(), csum.get(), G, per, clse, nth);
}

// Cached-cost plan weights for R rows of C (row-major, M columns):
// P[r, j] = exp2(rb[r] + cb[j] - k C[r, j]) * W(C[r, j]), W = 1 (W_ONE), C (W_COST) or
// 1/C where C > wthr, else 0 (W_INV).  The caller passes shifts (minus a row or column
// LSE) that keep every argument <= 0 up to rounding, and finite (zero weights: a large
// negative finite value).  Same score arithmetic as rows_lse / cols_lse: (cb - C k) + rb.
template <typename T, int WK>
static void cached_weights(const T* C, int64_t R, int64_t M, const T* rb, const T* cb, T k, T wthr, T* P,
                           int nth) {
  typedef typename VT<T>::v v;
  constexpr int L = VT<T>::L;
  const v zero = {};
  const v vthr = vset<v>(wthr);
  Tasks tasks(R, std::max<int64_t>(1, (R) / (8 * (int64_t)nth)));
  run_team(nth, [&](int tid) {
    FpScope fp(tid);
    for (int64_t b_, e_; tasks.next(b_, e_);)
      for (int64_t r = b_; r < e_; ++r) {
      const T* c = C + r * M;
      T* p = P + r * M;
      const T s = rb[r];
      int64_t j = 0;
      for (; j + L <= M; j += L) {
        const v cv = vload<v>(c + j);
        v e = vexp2((vload<v>(cb + j) - cv * k) + s);
        if (WK == W_COST) e *= cv;
        if (WK == W_INV) e = cv > vthr ? e / cv : zero;
        vstore(p + j, e);
      }
      for (; j < M; ++j) {
        T e = std::exp2((cb[j] - c[j] * k) + s);
        if (WK == W_COST) e *= c[j];
        if (WK == W_INV) e = c[j] > wthr ? e / c[j] : (T)0;
        p[j] = e;
      }
    }
  });
}

template <typename T>
static int cached_weights_entry(const T* C, int64_t R, int64_t M, const T* rb, const T* cb, double k, int wk,
                                double wthr, T* P, int nth) {
  if (wk == W_ONE) { cached_weights<T, W_ONE>(C, R, M, rb, cb, (T)k, (T)wthr, P, nth); return 0; }
  if (wk == W_COST) { cached_weights<T, W_COST>(C, R, M, rb, cb, (T)k, (T)wthr, P, nth); return 0; }
  if (wk == W_INV) { cached_weights<T, W_INV>(C, R, M, rb, cb, (T)k, (T)wthr, P, nth); return 0; }
  return -2;
}

// ---- the entry points' bodies (abi.h): the argument structs unpacked ----
template <typename T>
static int rows_lse_call(const flashot_cached_args* p) {
  rows_lse<T>((const T*)p->C, (const T*)p->h, (T*)p->out, p->B, p->N, p->M, (T)p->k, (T)p->oscale, p->nth);
  return 0;
}

template <typename T>
static int cols_lse_call(const flashot_cached_args* p) {
  cols_lse<T>((const T*)p->C, (const T*)p->h, (T*)p->out, p->B, p->N, p->M, (T)p->k, (T)p->oscale, p->nth);
  return 0;
}

template <typename T>
static int cached_alt_call(const flashot_cached_args* p) {
  cached_alt<T>((const T*)p->C, (const T*)p->h, (const T*)p->ha, (T)p->lam, (T)p->k, (T*)p->out, (T*)p->cols, p->B,
                p->N, p->M, p->nth);
  return 0;
}

template <typename T>
static int cached_weights_call(const flashot_weights_args* p) {
  return cached_weights_entry<T>((const T*)p->C, p->R, p->M, (const T*)p->rb, (const T*)p->cb, p->k, p->wk, p->wthr,
                                 (T*)p->P, p->nth);
}

}  // namespace

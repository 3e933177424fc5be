// flashot CPU kernels: block pruning of the multiscale solver (flashot/multiscale.py, BlockBounds).
//
// For the fine blocks (i, j) inside the kept coarse blocks, a lower bound of C(x, y) - f(x) - g(y)
// over the block (x in cluster i, y in cluster j):
//
//   simple = cost(max(0, |c_i - c_j| - r_i - r_j)) - m_i - m_j      (m: maxima of the potentials)
//   linear = -base_i - base_j + max(t1, t2)                        (dot costs s |x - y|^2 only;
//            t1 = s gap1^2 + bc_i - <beta_i, c_j> - bb_i / 4s - |beta_i + beta_j| r_j,
//                 gap1 = max(0, |u_i - c_j| - r_i - r_j), u = c - beta / 2s, and t2 the same with
//                 the roles swapped; see _linear_dense in multiscale.py for the derivation)
//   bound  = max(simple, linear)
//
// keep[i * Ky + j] = 1 where bound <= margin, and for every fine row and column its best candidate.
// Terms per cluster, float64, one row each: [r, m, base, bb, bc, c (D), beta (D), u (D)].
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.h"

namespace flashot_prune {

struct Side {
  const double* t;
  int D;
  int64_t stride() const { return 5 + 3 * (int64_t)D; }
  const double* row(int64_t k) const { return t + k * stride(); }
};

inline double dist(const double* a, const double* b, int D) {
  double s = 0;
  for (int d = 0; d < D; ++d) s += (a[d] - b[d]) * (a[d] - b[d]);
  return std::sqrt(s);
}

inline double dot(const double* a, const double* b, int D) {
  double s = 0;
  for (int d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

// kind 1: cost = s * gap^2 (dot costs; linear = 1 adds the linear-model bound); kind 0: sqrt(max(gap^2, minsq)).
inline double bound(const double* a, const double* b, int D, int kind, int linear, double s, double minsq) {
  const double ra = a[0], rb = b[0], rr = ra + rb;
  const double* ca = a + 5;
  const double* cb = b + 5;
  const double g = std::max(0.0, dist(ca, cb, D) - rr);
  const double cost = kind == 1 ? s * g * g : std::sqrt(std::max(g * g, minsq));
  double out = cost - a[1] - b[1];
  if (!linear) return out;
  const double *ba = ca + D, *bb_ = cb + D, *ua = ba + D, *ub = bb_ + D;
  double bg = 0;
  for (int d = 0; d < D; ++d) bg += (ba[d] + bb_[d]) * (ba[d] + bb_[d]);
  bg = std::sqrt(bg);
  const double g1 = std::max(0.0, dist(ua, cb, D) - rr);
  const double t1 = s * g1 * g1 + a[4] - dot(ba, cb, D) - a[3] / (4 * s) - bg * rb;
  const double g2 = std::max(0.0, dist(ca, ub, D) - rr);
  const double t2 = s * g2 * g2 + b[4] - dot(ca, bb_, D) - b[3] / (4 * s) - bg * ra;
  return std::max(out, -a[2] - b[2] + std::max(t1, t2));
}

// Coarse rows Ic in [0, Kcx) with kept coarse columns ccols[cptr[Ic] .. cptr[Ic + 1]); the fine clusters of
// coarse row Ic are [px[Ic], px[Ic + 1]), of coarse column Jc [py[Jc], py[Jc + 1]).
inline int block_keep(const Side& X, const Side& Y, int64_t Ky, int64_t Kcx, const int64_t* cptr, const int64_t* ccols,
                      const int64_t* px, const int64_t* py, int kind, int linear, double s, double minsq,
                      double margin, uint8_t* keep, int nth) {
  nth = std::max(1, std::min(nth, flashot_par::MAX_THREADS));
  const double INF = std::numeric_limits<double>::infinity();
  std::vector<double> cbest((size_t)nth * Ky, INF);
  std::vector<int64_t> carg((size_t)nth * Ky, -1);
  Tasks tasks(Kcx);
  const int used = run_team(nth, [&](int tid) {
    double* cb = cbest.data() + (size_t)tid * Ky;
    int64_t* ca = carg.data() + (size_t)tid * Ky;
    for (int64_t Ic; tasks.next(Ic);) {
      for (int64_t i = px[Ic]; i < px[Ic + 1]; ++i) {
        const double* a = X.row(i);
        double rbest = INF;
        int64_t rarg = -1;
        for (int64_t q = cptr[Ic]; q < cptr[Ic + 1]; ++q) {
          const int64_t Jc = ccols[q];
          for (int64_t j = py[Jc]; j < py[Jc + 1]; ++j) {
            const double v = bound(a, Y.row(j), X.D, kind, linear, s, minsq);
            if (v <= margin) keep[i * Ky + j] = 1;
            if (v < rbest) { rbest = v; rarg = j; }
            if (v < cb[j]) { cb[j] = v; ca[j] = i; }
          }
        }
        if (rarg >= 0) keep[i * Ky + rarg] = 1;
      }
    }
  });
  for (int64_t j = 0; j < Ky; ++j) {  // each column's best over the threads' candidates
    double v = INF;
    int64_t arg = -1;
    for (int t = 0; t < used; ++t)
      if (cbest[(size_t)t * Ky + j] < v) { v = cbest[(size_t)t * Ky + j]; arg = carg[(size_t)t * Ky + j]; }
    if (arg >= 0) keep[arg * Ky + j] = 1;
  }
  return 0;
}

}  // namespace flashot_prune

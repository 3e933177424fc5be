// flashot CPU kernels: column sums and column LogSumExp states in a fixed order (the same bits for
// any thread count), shared by the pair, alternating and cached kernels.
#pragma once
#include "fpenv.h"
#include "parallel.h"
#include "vecmath.h"

namespace {

// Column partials in a fixed order (results independent of the thread count and of scheduling):
// the flat row blocks t in [0, nt) are dealt into G groups (block t -> group t % G; strided, so a
// triangle's heavy and light blocks mix); one task is one group, whose blocks are processed in
// ascending order into the group's own column buffer, and the buffers are then combined in group
// order.  G depends on the problem only, never on nth: at most COL_GROUPS, at most nt, and the
// buffers within COL_GROUP_BYTES (at least COL_GROUPS_MIN groups).  Per-thread buffers (the
// previous scheme) gave column sums that changed with the thread count and, under dynamic
// scheduling, from run to run (float32 ~1e-7 relative).  Cost: benchmarks/CPU_ENGINE.md,
// "Determinism" (-DFL_COL_GROUPS=16 or 256 measured no faster than 64; the value changes the bits).
#ifndef FL_COL_GROUPS
#define FL_COL_GROUPS 64
#endif
constexpr int64_t COL_GROUPS = FL_COL_GROUPS, COL_GROUPS_MIN = 4;
constexpr int64_t COL_GROUP_BYTES = (int64_t)64 << 20;
static inline int64_t col_groups(int64_t nt, int64_t group_bytes) {
  int64_t g = std::min<int64_t>(COL_GROUPS, std::max<int64_t>(COL_GROUPS_MIN, COL_GROUP_BYTES / std::max<int64_t>(1, group_bytes)));
  return std::max<int64_t>(1, std::min<int64_t>(g, nt));
}
constexpr int64_t MERGE_CHUNK = 2048;  // columns per merge task (a multiple of every vector width)

// out[u] = sum_g parts[g * per + u] in group order, u < per, in parallel over columns.
template <typename T>
static void merge_col_sums(const T* parts, int64_t G, size_t per, T* out, int nth) {
  const int64_t nc = ((int64_t)per + MERGE_CHUNK - 1) / MERGE_CHUNK;
  Tasks tasks(nc);
  run_team((int)std::min<int64_t>(nth, nc), [&](int tid) {
    FpScope fp(tid);
    for (int64_t c; tasks.next(c);) {
      const size_t u0 = (size_t)c * MERGE_CHUNK, u1 = std::min(per, u0 + MERGE_CHUNK);
      std::copy(parts + u0, parts + u1, out + u0);
      for (int64_t g = 1; g < G; ++g) {
        const T* pg = parts + (size_t)g * per;
        for (size_t u = u0; u < u1; ++u) out[u] += pg[u];
      }
    }
  });
}

// Column sums in a fixed order: G groups, one task each, each with its own zeroed buffer of `per` columns;
// body(g, cacc, scratch) adds group g's rows into cacc (scratch: a per-thread buffer of scratch_n, for
// sums to discard); the buffers are then added into csum in group order.
template <typename T, typename F>
static void col_group_pass(int64_t G, size_t per, size_t scratch_n, T* csum, int nth, F&& body) {
  std::unique_ptr<T[]> parts(new T[(size_t)G * per]);  // zeroed by each group's task
  Tasks tasks(G);
  run_team(nth, [&](int tid) {
    FpScope fp(tid);
    std::vector<T> scratch(scratch_n);
    for (int64_t g; tasks.next(g);) {
      T* cacc = parts.get() + (size_t)g * per;
      std::fill(cacc, cacc + per, (T)0);
      body(g, cacc, scratch.data());
    }
  });
  merge_col_sums(parts.get(), G, per, csum, nth);
}

// Column sums of a banded block pattern (a ragged batch's block-diagonal one: the row tasks' column ranges move
// right with the task) in a fixed order: the tasks are cut into G runs of consecutive tasks (G from the number of
// tasks only, never from nth), and group g's buffer spans only the columns [lo[g], hi[g]) its tasks touch, so the
// buffers hold about the columns once instead of G times (col_group_pass zeroes and merges G full rows of Mp).
// Each buffer holds `planes` rows of width hi[g] - lo[g]; columns no group touches sum to zero.
struct ColSpans {
  int64_t G = 0;
  std::vector<int64_t> t0, lo, hi, off;  // group g: tasks [t0[g], t0[g + 1]), columns [lo, hi), buffer offset
  int64_t wmax = 0;                      // the widest span
  // span(t, lo, hi): task t's columns (lo <= hi)
  template <typename S>
  ColSpans(int64_t nt, S&& span) : G(std::max<int64_t>(1, std::min<int64_t>(COL_GROUPS, nt))) {
    t0.resize(G + 1);
    lo.assign(G, 0);
    hi.assign(G, 0);
    off.assign(G + 1, 0);
    for (int64_t g = 0; g <= G; ++g) t0[g] = g * nt / G;
    for (int64_t g = 0; g < G; ++g) {
      int64_t a = std::numeric_limits<int64_t>::max(), b = 0;
      for (int64_t t = t0[g]; t < t0[g + 1]; ++t) {
        int64_t l, h;
        span(t, l, h);
        if (l < h) { a = std::min(a, l); b = std::max(b, h); }
      }
      lo[g] = a < b ? a : 0;
      hi[g] = a < b ? b : 0;
      off[g + 1] = off[g] + (hi[g] - lo[g]);
      wmax = std::max(wmax, hi[g] - lo[g]);
    }
  }
};

// out[p * ld + u] (p < planes, u < Mp) = sum over the groups g whose span holds u, in group order, of their
// buffer's column u (parts + planes * off[g], rows of width hi[g] - lo[g]); in parallel over columns.
template <typename T>
static void merge_span_sums(const T* parts, const ColSpans& sp, int planes, int64_t Mp, T* out, int nth) {
  const int64_t nc = (Mp + MERGE_CHUNK - 1) / MERGE_CHUNK;
  Tasks tasks(nc);
  run_team((int)std::min<int64_t>(nth, nc), [&](int tid) {
    FpScope fp(tid);
    for (int64_t c; tasks.next(c);) {
      const int64_t u0 = c * MERGE_CHUNK, u1 = std::min(Mp, u0 + MERGE_CHUNK);
      for (int p = 0; p < planes; ++p) std::fill(out + p * Mp + u0, out + p * Mp + u1, (T)0);
      for (int64_t g = 0; g < sp.G; ++g) {
        const int64_t a = std::max(u0, sp.lo[g]), b = std::min(u1, sp.hi[g]), w = sp.hi[g] - sp.lo[g];
        for (int p = 0; p < planes; ++p) {
          const T* src = parts + planes * sp.off[g] + p * w - sp.lo[g];
          T* dst = out + p * Mp;
          for (int64_t u = a; u < b; ++u) dst[u] += src[u];
        }
      }
    }
  });
}

// col_group_pass for a banded pattern (ColSpans): body(g, cacc, scratch, ld) adds group g's tasks into cacc,
// where cacc[p * ld + j] is column j of plane p for j in [lo[g], hi[g]) (the pointer is shifted by lo[g]; only
// those columns are addressed); scratch (per thread, for sums to discard) is shifted alike, or null without
// `scratch`.  The buffers are then merged into csum (planes rows of Mp) by merge_span_sums.
template <typename T, typename F>
static void col_span_pass(const ColSpans& sp, int planes, int64_t Mp, bool scratch, T* csum, int nth, F&& body) {
  std::unique_ptr<T[]> parts(new T[(size_t)std::max<int64_t>(1, planes * sp.off[sp.G])]);
  Tasks tasks(sp.G);
  run_team(nth, [&](int tid) {
    FpScope fp(tid);
    std::vector<T> sbuf(scratch ? (size_t)(planes * sp.wmax) : 0);
    for (int64_t g; tasks.next(g);) {
      const int64_t w = sp.hi[g] - sp.lo[g];
      T* buf = parts.get() + planes * sp.off[g];
      std::fill(buf, buf + planes * w, (T)0);
      body(g, buf - sp.lo[g], scratch ? sbuf.data() - sp.lo[g] : nullptr, w);
    }
  });
  merge_span_sums(parts.get(), sp, planes, Mp, csum, nth);
}

// Column sums in a fixed order by either scheme: body(t0, t1, ts, cacc, scratch, ld) adds the tasks t0, t0 + ts,
// ... < t1 into cacc (planes of stride ld; scratch alike, for sums to discard, when `scratch`): banded,
// col_span_pass over ColSpans(nt, span); else col_group_pass (task t -> group t % G, planes rows of Mp).
template <typename T, typename S, typename F>
static void col_pass(bool banded, int64_t nt, S&& span, int planes, int64_t Mp, bool scratch, T* csum, int nth,
                     F&& body) {
  if (banded) {
    const ColSpans sp(nt, span);
    col_span_pass<T>(sp, planes, Mp, scratch, csum, nth,
                     [&](int64_t g, T* cacc, T* s, int64_t ld) { body(sp.t0[g], sp.t0[g + 1], 1, cacc, s, ld); });
    return;
  }
  const int64_t per = planes * Mp, G = col_groups(nt, per * (int64_t)sizeof(T));
  col_group_pass<T>(G, (size_t)per, scratch ? (size_t)per : 0, csum, nth,
                    [&](int64_t g, T* cacc, T* s) { body(g, nt, G, cacc, s, Mp); });
}

// One scalar column state (running maximum ms, scaled sum ss) takes the score a.
template <typename T>
static inline void col_push(T& ms, T& ss, T a) {
  if (a > ms + Consts<T>::TH) { ss *= std::exp2(ms - (a + Consts<T>::H)); ms = a + Consts<T>::H; }
  if (a - ms > Consts<T>::LO) ss += std::exp2(a - ms);
}

// Running column LSE states (base 2, lazy maximum as in cols_lse) += rows r < nr of P (costs,
// row stride ldp) with row log-weights w[r]: score w_r - k P[r, j], j < M.
template <typename T>
static inline void col_states(const T* P, int64_t ldp, int nr, const T* w, T k, int64_t M, T* cm, T* cs) {
  typedef typename VT<T>::v v;
  constexpr int L = VT<T>::L;
  int64_t j = 0;
  for (; j + L <= M; j += L) {
    v mq = vload<v>(cm + j), sq = vload<v>(cs + j);
    for (int r = 0; r < nr; ++r) {
      const v sc = w[r] - vload<v>(P + (int64_t)r * ldp + j) * k;
      if (__builtin_expect(any_gt(sc, mq + Consts<T>::TH), 0)) {
        const v up = sc + Consts<T>::H;
        const v nm = up > mq ? up : mq;
        sq *= vexp2(mq - nm);
        mq = nm;
      }
      sq += vexp2(sc - mq);
    }
    vstore(cm + j, mq);
    vstore(cs + j, sq);
  }
  for (; j < M; ++j)
    for (int r = 0; r < nr; ++r) col_push(cm[j], cs[j], w[r] - P[(int64_t)r * ldp + j] * k);
}

// clse[u] = LSE2 over the groups' column states (G copies of `per` values each, combined in group
// order), in parallel over columns, vectorised (a column's bits do not depend on the thread count).
template <typename T>
static void merge_col_states(const T* cmax, const T* csum, int64_t G, size_t per, T* clse, int nth) {
  typedef typename VT<T>::v v;
  constexpr int L = VT<T>::L;
  const int64_t nc = ((int64_t)per + MERGE_CHUNK - 1) / MERGE_CHUNK;
  const T ninf = -std::numeric_limits<T>::infinity();
  Tasks tasks(nc);
  run_team((int)std::min<int64_t>(nth, nc), [&](int tid) {
    FpScope fp(tid);
    for (int64_t c; tasks.next(c);) {
      const size_t u0 = (size_t)c * MERGE_CHUNK, u1 = std::min(per, u0 + MERGE_CHUNK);
      size_t u = u0;
      for (; u + L <= u1; u += L) {
        v mx = vset<v>(Consts<T>::SENT);
        for (int64_t g = 0; g < G; ++g) {
          const v cm = vload<v>(cmax + (size_t)g * per + u);
          mx = cm > mx ? cm : mx;
        }
        v sm = {};
        for (int64_t g = 0; g < G; ++g)
          sm += vload<v>(csum + (size_t)g * per + u) * vexp2(vload<v>(cmax + (size_t)g * per + u) - mx);
        for (int l = 0; l < L; ++l)
          clse[u + l] = (mx[l] == Consts<T>::SENT || !(sm[l] > 0)) ? ninf : mx[l] + std::log2(sm[l]);
      }
      for (; u < u1; ++u) {  // the last per % L columns (the same ones for any thread count)
        T mx = Consts<T>::SENT;
        for (int64_t g = 0; g < G; ++g) mx = std::max(mx, cmax[(size_t)g * per + u]);
        T sm = 0;
        for (int64_t g = 0; g < G; ++g) sm += csum[(size_t)g * per + u] * std::exp2(cmax[(size_t)g * per + u] - mx);
        clse[u] = (mx == Consts<T>::SENT || !(sm > 0)) ? ninf : mx + std::log2(sm);
      }
    }
  });
}

// Row weight of the column pass after a row LSE: ha_i - lam lse_i, or the finite "zero weight"
// when the row has no mass (lse = -inf, or ha is a zero weight).
template <typename T>
static inline T alt_row_weight(T ha, T lse, T lam) {
  const T zero_w = std::is_same<T, float>::value ? (T)-1e38 : (T)-1e300;
  const T wi = ha - lam * lse;
  return (std::isfinite(lse) && std::isfinite(wi) && ha > zero_w) ? wi : zero_w;
}

}  // namespace

// Standalone check of the compiled CPU kernels (src/flashot/ops/cpu/*.cpp, build.py LIBRARIES) against
// naive double-precision references computed here with plain loops, std::exp and std::log.
//
// No Python, no torch: it is compiled together with the kernels' translation units, natively or for
// another architecture (tests/native/run_arm64.sh cross-compiles it for aarch64 and runs it under
// qemu-user), e.g.
//   g++ -O2 -std=c++17 -pthread -DFLASHOT_ABI_VERSION=<python -c 'from flashot.ops.cpu import abi;
//       print(abi.abi_version())'> -I src/flashot/ops/cpu tests/native/kernel_check.cpp
//       src/flashot/ops/cpu/core_*.cpp src/flashot/ops/cpu/bs_*.cpp -o kc && ./kc
// (the driver and the kernels must be compiled with the same -march: it checks flashot_isa()
// and flashot_vector_bytes() against its own predefined macros).
// It prints one line per check and ends with the line "N passed, M failed"; the exit status is
// 1 when a check failed.
//
// Conventions of the exported functions (see engine.py, which calls them through ctypes):
//   * every exponent is base 2: the kernels take log-weights as hs = h * log2(e) and the cost
//     coefficient kcoef = scale * log2(e) / eps (here scale = 1: cost C = |x - y|^2, kind 0);
//   * y is passed transposed, yT (B, D, Mp), with its squared norms yy (B, Mp) and log-weights
//     hs (B, Mp); the columns are padded to Mp, a multiple of PAD = 64, with y = 0, yy = 0 and a
//     zero weight (-inf; float32: the finite -1e38, since the float exp2 needs finite input);
//   * x is (B, N, D) row-major; per-row outputs are (B, N), per-column outputs (B, Mp).
// The problems are small (N, M in 37..131, B = 2) so that padding, vector tails and row tails
// are all exercised and the whole run takes seconds even under an emulator.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

// ---- the exported C ABI under test (abi.h: one argument struct per kernel entry point) ----
#include "abi.h"

namespace {

// Positional adapters: each fills its entry point's argument struct (abi.h) and calls the float or double
// entry point (T from the first pointer; the other pointers may be null).
template <typename T> struct Id { typedef T type; };
template <typename T> using P = const typename Id<T>::type*;
template <typename T> using W = typename Id<T>::type*;

flashot_stream stream(const void* x, const void* yT, const void* yy, const void* hs, int B, int64_t N, int64_t Mp,
                      int D, double kcoef, double minsq, int kind, int cfg, int64_t l2, int nth) {
  flashot_stream s{};
  s.x = x, s.yT = yT, s.yy = yy, s.hs = hs, s.B = B, s.N = N, s.Mp = Mp, s.D = D, s.kcoef = kcoef;
  s.minsq = minsq, s.kind = kind, s.cfg = cfg, s.l2 = l2, s.nth = nth;
  return s;
}
flashot_blocks blocks(const int64_t* tasks, int64_t ntasks, const int64_t* cptr, const int64_t* cr,
                      const int64_t* coff) {
  flashot_blocks b{};
  b.tasks = tasks, b.ntasks = ntasks, b.cptr = cptr, b.cr = cr, b.coff = coff;
  return b;
}
template <typename T> constexpr bool F32 = std::is_same<T, float>::value;

template <typename T>
int pos_softmin(const T* x, P<T> yT, P<T> yy, P<T> hs, W<T> out, int B, int64_t N, int64_t Mp, int D, double kcoef,
                double minsq, int kind, double oscale, int cfg, int64_t l2, int nth) {
  flashot_lse_args a{stream(x, yT, yy, hs, B, N, Mp, D, kcoef, minsq, kind, cfg, l2, nth), out, oscale};
  return F32<T> ? flashot_softmin_f32(&a) : flashot_softmin_f64(&a);
}
template <typename T>
int pos_pair(const T* x, P<T> yT, P<T> yy, P<T> hs, P<T> hx, W<T> rs, W<T> cs, int B, int64_t N, int64_t Mp, int D,
             double kcoef, double minsq, int kind, int cfg, int sym, int64_t l2, int nth) {
  flashot_rowcol_args a{stream(x, yT, yy, hs, B, N, Mp, D, kcoef, minsq, kind, cfg, l2, nth), hx, rs, cs, 0.0, sym, 0};
  return F32<T> ? flashot_pair_f32(&a) : flashot_pair_f64(&a);
}
template <typename T>
int pos_alt(const T* x, P<T> yT, P<T> yy, P<T> hs, P<T> ha, double lam, W<T> rlse, W<T> clse, int B, int64_t N,
            int64_t Mp, int D, double kcoef, double minsq, int kind, int cfg, int64_t l2, int nth) {
  flashot_rowcol_args a{stream(x, yT, yy, hs, B, N, Mp, D, kcoef, minsq, kind, cfg, l2, nth), ha, rlse, clse, lam, 0, 0};
  return F32<T> ? flashot_alt_f32(&a) : flashot_alt_f64(&a);
}
template <typename T>
int pos_plan(const T* x, P<T> yT, P<T> yy, P<T> hs, P<T> lse, P<T> alpha, P<T> V, int K, W<T> out, W<T> mass,
             int single, int B, int64_t N, int64_t Mp, int D, double kcoef, double minsq, int kind, int wk, double wconst,
             int narrow, int64_t l2, int nth) {
  flashot_plan_args a{stream(x, yT, yy, hs, B, N, Mp, D, kcoef, minsq, kind, 0, l2, nth), lse, alpha, V, out, mass,
                      wconst, K, single, wk, narrow};
  return F32<T> ? flashot_plan_f32(&a) : flashot_plan_f64(&a);
}
template <typename T>
int pos_rows_lse(const T* C, P<T> h, W<T> out, int B, int64_t N, int64_t M, double k, double oscale, int nth) {
  flashot_cached_args a{C, h, nullptr, out, nullptr, N, M, k, oscale, 0.0, B, nth};
  return F32<T> ? flashot_rows_lse_f32(&a) : flashot_rows_lse_f64(&a);
}
template <typename T>
int pos_cols_lse(const T* C, P<T> h, W<T> out, int B, int64_t N, int64_t M, double k, double oscale, int nth) {
  flashot_cached_args a{C, h, nullptr, out, nullptr, N, M, k, oscale, 0.0, B, nth};
  return F32<T> ? flashot_cols_lse_f32(&a) : flashot_cols_lse_f64(&a);
}
template <typename T>
int pos_softmin_bs(const T* x, P<T> yT, P<T> yy, P<T> hs, W<T> out, int64_t Mp, int D, const int64_t* tasks,
                   int64_t ntasks, const int64_t* cptr, const int64_t* cr, double kcoef, double minsq, int kind,
                   double oscale, int cfg, int nth) {
  flashot_lse_bs_args a{{stream(x, yT, yy, hs, 1, 0, Mp, D, kcoef, minsq, kind, cfg, 0, nth), out, oscale},
                        blocks(tasks, ntasks, cptr, cr, nullptr)};
  return F32<T> ? flashot_softmin_bs_f32(&a) : flashot_softmin_bs_f64(&a);
}
template <typename T>
int pos_plan_bs(const T* x, P<T> yT, P<T> yy, P<T> hs, P<T> lse, P<T> alpha, P<T> V, int K, W<T> out, W<T> mass,
                int single, int64_t Mp, int D, const int64_t* tasks, int64_t ntasks, const int64_t* cptr,
                const int64_t* cr, double kcoef, double minsq, int kind, int wk, double wconst, int nth) {
  flashot_plan_bs_args a{{stream(x, yT, yy, hs, 1, 0, Mp, D, kcoef, minsq, kind, 0, 0, nth), lse, alpha, V, out, mass,
                          wconst, K, single, wk, 1},
                         blocks(tasks, ntasks, cptr, cr, nullptr)};
  return F32<T> ? flashot_plan_bs_f32(&a) : flashot_plan_bs_f64(&a);
}
template <typename T>
int pos_pair_bs(const T* x, P<T> yT, P<T> yy, P<T> hs, P<T> hx, W<T> rs, W<T> cs, W<T> rb, int cb, P<T> fx, P<T> gy,
                P<T> fxo, P<T> gyo, double thr, int64_t* evaluated, int64_t Mp, int D, const int64_t* tasks,
                int64_t ntasks, const int64_t* cptr, const int64_t* cr, const int64_t* coff, double kcoef, double minsq,
                int kind, int cfg, int sym, int nth) {
  flashot_pair_bs_args a{};
  a.a = flashot_rowcol_args{stream(x, yT, yy, hs, 1, 0, Mp, D, kcoef, minsq, kind, cfg, 0, nth), hx, rs, cs, 0.0, sym,
                            0};
  a.b = blocks(tasks, ntasks, cptr, cr, coff);
  a.rb = rb, a.cb = cb, a.fx = fx, a.gy = gy, a.fxo = fxo, a.gyo = gyo, a.thr = thr, a.evaluated = evaluated;
  return F32<T> ? flashot_pair_bs_f32(&a) : flashot_pair_bs_f64(&a);
}
int pos_block_keep(const double* X, const double* Y, int D, int64_t Ky, int64_t Kcx, const int64_t* cptr,
                   const int64_t* ccols, const int64_t* px, const int64_t* py, int kind, int linear, double s,
                   double minsq, double margin, uint8_t* keep, int nth) {
  flashot_prune_args a{X, Y, cptr, ccols, px, py, keep, Ky, Kcx, s, minsq, margin, D, kind, linear, nth};
  return flashot_block_keep(&a);
}

}  // namespace

namespace {

constexpr double LOG2E = 1.4426950408889634, LN2 = 0.6931471805599453;
constexpr int64_t PAD = 64;           // engine.py PAD
constexpr int64_t L2 = 512 * 1024;    // engine.py L2_BYTES: one column chunk at these sizes
constexpr int NTH = 2;                // threads per kernel call
constexpr int KIND_DOT = 0;           // cost |x - y|^2, formed as |x|^2 + |y|^2 - 2 <x, y>
constexpr int W_ONE = 0, W_COST = 1;  // plan weights: 1, or the cost c_ij
constexpr double INF = std::numeric_limits<double>::infinity();

// ---- tolerances -------------------------------------------------------------------------
// Every result is a function of exponents s_ij = a_i + h_j - C_ij / eps (natural units) that
// the kernel forms in T arithmetic from terms of magnitude up to
//   E = max C / eps + 1 + max |h| + max |a|      (Problem::expo_scale),
// so we bound the error of an exponent by TOL<T> * E, where TOL covers the D + 2 roundings of
// the dot product and norms, the exp2 polynomial (1.85e-7 float, 4.4e-16 double, relative) and
// the rounding of sums of up to 131 terms: float 2e-5 (~170 float ulps, so not flaky across
// vector widths and FMA contraction), double 1e-10 (~5e5 ulps: catches wrong arithmetic,
// which is what this driver is for, without grading last-bit rounding).  Then
//   a softmin -eps LSE_j s_ij errs by at most eps TOL E = TOL (max C + eps (1 + max|h| + max|a|));
//   a base-2 LSE (alt, cols_lse) by TOL E log2(e);
//   a sum of positive weights (pair sums, plan row mass) by TOL E relative (e^d - 1 ~ d);
//   a signed sum sum_j P_ij V_jk (plan product) by TOL E sum_j P_ij |V_jk|.
template <typename T> constexpr double TOL = 0;
template <> constexpr double TOL<float> = 2e-5;
template <> constexpr double TOL<double> = 1e-10;

template <typename T> const char* tname() { return sizeof(T) == 4 ? "f32" : "f64"; }

// The log-weight of a padded (absent) column: -inf, or -1e38 for the float kernels (engine.py
// ZERO_W_F32: their exp2 takes finite arguments; exp2(-1e38 - ...) is exactly 0).
template <typename T> T zero_weight() { return sizeof(T) == 4 ? (T)-1e38 : -std::numeric_limits<T>::infinity(); }

// ---- results -----------------------------------------------------------------------------
struct Tally {
  int passed = 0, failed = 0;
  // One line per check: the worst error (in units of the check's scale) against the tolerance.
  void report(bool ok, const std::string& what, const std::string& detail) {
    (ok ? passed : failed) += 1;
    std::printf("%s %s: %s\n", ok ? "PASS" : "FAIL", what.c_str(), detail.c_str());
    std::fflush(stdout);
  }
  void error_check(const std::string& what, int rc, double err, double tol) {
    const bool ok = rc == 0 && err <= tol;
    char buf[160];
    if (rc != 0) std::snprintf(buf, sizeof buf, "kernel returned %d", rc);
    else std::snprintf(buf, sizeof buf, "max err %.3g %s tol %.3g", err, ok ? "<=" : ">", tol);
    report(ok, what, buf);
  }
};

// Largest |got - ref| / scale; a NaN or an infinity that the reference does not have counts as +inf.
struct MaxErr {
  double worst = 0;
  void add(double got, double ref, double scale) {
    double e = got == ref ? 0.0 : std::fabs(got - ref) / scale;
    if (!(e == e)) e = INF;
    worst = std::max(worst, e);
  }
};

// Deterministic pseudo-random numbers (splitmix64): the same problems on every platform.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform(double lo, double hi) { return lo + (hi - lo) * (double)(next() >> 11) * 0x1.0p-53; }
};

// log(sum_j e^{t(j)}) for j < n, in double (max-shifted); -inf when every term is -inf.
template <typename F> double ref_lse(int n, F t) {
  double m = -INF;
  for (int j = 0; j < n; ++j) m = std::max(m, t(j));
  if (m == -INF) return -INF;
  double s = 0;
  for (int j = 0; j < n; ++j) s += std::exp(t(j) - m);
  return m + std::log(s);
}

// ---- problems ----------------------------------------------------------------------------
// Points x (B, N, D), y (B, M, D) uniform in [-1, 1]^D (y shifted by 0.25), natural log-weights
// h on the columns and a on the rows uniform in [-3, 1], and eps = eps_rel * max C.
template <typename T> struct Problem {
  int B, N, M, D;
  int64_t Mp;
  double eps, k;          // k = log2(e) / eps: the kernels' kcoef for cost scale 1
  std::vector<T> x, y;    // row-major points
  std::vector<T> h, a;    // (B, M), (B, N) natural log-weights
  std::vector<double> C;  // (B, N, M) |x_i - y_j|^2 of the T-rounded points, in double
  double maxC = 0, hmax = 0, amax = 0;
  std::vector<T> yT, yy, hs;  // the kernels' layout of y (engine.py _prep_y)

  double c(int b, int i, int j) const { return C[((size_t)b * N + i) * M + j]; }
  double expo_scale() const { return maxC / eps + 1 + hmax + amax; }
  // natural exponent s_ij of the plan / pair weights (row log-weight a_i, column h_j)
  double s(int b, int i, int j) const { return a[(size_t)b * N + i] + h[(size_t)b * M + j] - c(b, i, j) / eps; }
};

template <typename T> void fill(std::vector<T>& v, size_t n, Rng& g, double lo, double hi) {
  v.resize(n);
  for (auto& e : v) e = (T)g.uniform(lo, hi);
}

template <typename T> void exact_costs(Problem<T>& p) {
  p.C.assign((size_t)p.B * p.N * p.M, 0.0);
  for (int b = 0; b < p.B; ++b)
    for (int i = 0; i < p.N; ++i)
      for (int j = 0; j < p.M; ++j) {
        double s = 0;
        for (int d = 0; d < p.D; ++d) {
          const double df = (double)p.x[((size_t)b * p.N + i) * p.D + d] - (double)p.y[((size_t)b * p.M + j) * p.D + d];
          s += df * df;
        }
        p.C[((size_t)b * p.N + i) * p.M + j] = s;
        p.maxC = std::max(p.maxC, s);
      }
}

// yT[b, d, j] = y[b, j, d]; yy[b, j] = |y_j|^2; hs[b, j] = h_j log2(e); zero padding past M.
template <typename T> void kernel_layout(Problem<T>& p) {
  p.yT.assign((size_t)p.B * p.D * p.Mp, (T)0);
  p.yy.assign((size_t)p.B * p.Mp, (T)0);
  p.hs.assign((size_t)p.B * p.Mp, zero_weight<T>());
  for (int b = 0; b < p.B; ++b)
    for (int j = 0; j < p.M; ++j) {
      double n2 = 0;
      for (int d = 0; d < p.D; ++d) {
        const T v = p.y[((size_t)b * p.M + j) * p.D + d];
        p.yT[((size_t)b * p.D + d) * p.Mp + j] = v;
        n2 += (double)v * v;
      }
      p.yy[(size_t)b * p.Mp + j] = (T)n2;
      p.hs[(size_t)b * p.Mp + j] = (T)(p.h[(size_t)b * p.M + j] * LOG2E);
    }
}

template <typename T> Problem<T> make_problem(uint64_t seed, int N, int M, int D, double eps_rel) {
  Problem<T> p;
  p.B = 2, p.N = N, p.M = M, p.D = D;
  p.Mp = (M + PAD - 1) / PAD * PAD;
  Rng g(seed);
  fill(p.x, (size_t)p.B * N * D, g, -1.0, 1.0);
  fill(p.y, (size_t)p.B * M * D, g, -0.75, 1.25);
  fill(p.h, (size_t)p.B * M, g, -3.0, 1.0);
  fill(p.a, (size_t)p.B * N, g, -3.0, 1.0);
  for (T v : p.h) p.hmax = std::max(p.hmax, std::fabs((double)v));
  for (T v : p.a) p.amax = std::max(p.amax, std::fabs((double)v));
  exact_costs(p);
  p.eps = eps_rel * p.maxC;
  p.k = LOG2E / p.eps;
  kernel_layout(p);
  return p;
}

std::string describe(const char* fn, const char* t, int D, int N, int M, double eps_rel, const char* extra = "") {
  char buf[200];
  std::snprintf(buf, sizeof buf, "%s %s D=%d N=%d M=%d eps=%g*maxC%s", fn, t, D, N, M, eps_rel, extra);
  return buf;
}

// ---- typed entry points (float / double overloads of the C functions) -----------------------
int softmin(const Problem<float>& p, float* out, double oscale, int cfg, int64_t l2) {
  return pos_softmin(p.x.data(), p.yT.data(), p.yy.data(), p.hs.data(), out, p.B, p.N, p.Mp, p.D, p.k, 0.0,
                             KIND_DOT, oscale, cfg, l2, NTH);
}
int softmin(const Problem<double>& p, double* out, double oscale, int cfg, int64_t l2) {
  return pos_softmin(p.x.data(), p.yT.data(), p.yy.data(), p.hs.data(), out, p.B, p.N, p.Mp, p.D, p.k, 0.0,
                             KIND_DOT, oscale, cfg, l2, NTH);
}
int pair(const Problem<float>& p, const float* hx, float* rs, float* cs, int cfg) {
  return pos_pair(p.x.data(), p.yT.data(), p.yy.data(), p.hs.data(), hx, rs, cs, p.B, p.N, p.Mp, p.D, p.k,
                          0.0, KIND_DOT, cfg, 0, L2, NTH);
}
int pair(const Problem<double>& p, const double* hx, double* rs, double* cs, int cfg) {
  return pos_pair(p.x.data(), p.yT.data(), p.yy.data(), p.hs.data(), hx, rs, cs, p.B, p.N, p.Mp, p.D, p.k,
                          0.0, KIND_DOT, cfg, 0, L2, NTH);
}
int plan(const Problem<float>& p, const float* lse, const float* alpha, const float* V, int K, float* out,
         float* mass, int single, int wk, int narrow) {
  return pos_plan(p.x.data(), p.yT.data(), p.yy.data(), p.hs.data(), lse, alpha, V, K, out, mass, single,
                          p.B, p.N, p.Mp, p.D, p.k, 0.0, KIND_DOT, wk, 1.0, narrow, L2, NTH);
}
int plan(const Problem<double>& p, const double* lse, const double* alpha, const double* V, int K, double* out,
         double* mass, int single, int wk, int narrow) {
  return pos_plan(p.x.data(), p.yT.data(), p.yy.data(), p.hs.data(), lse, alpha, V, K, out, mass, single,
                          p.B, p.N, p.Mp, p.D, p.k, 0.0, KIND_DOT, wk, 1.0, narrow, L2, NTH);
}
int rows_lse(const float* C, const float* h, float* o, int B, int N, int M, double k, double os) {
  return pos_rows_lse(C, h, o, B, N, M, k, os, NTH);
}
int rows_lse(const double* C, const double* h, double* o, int B, int N, int M, double k, double os) {
  return pos_rows_lse(C, h, o, B, N, M, k, os, NTH);
}
int cols_lse(const float* C, const float* h, float* o, int B, int N, int M, double k, double os) {
  return pos_cols_lse(C, h, o, B, N, M, k, os, NTH);
}
int cols_lse(const double* C, const double* h, double* o, int B, int N, int M, double k, double os) {
  return pos_cols_lse(C, h, o, B, N, M, k, os, NTH);
}
int vexp(const float* a, float* o, int64_t n) { return flashot_vexp_f32(a, o, n, NTH); }
int vexp(const double* a, double* o, int64_t n) { return flashot_vexp_f64(a, o, n, NTH); }

// Softmin configuration as engine.py picks it: cfg 0 for D <= 32 (SMALL_D), cfg 3 above.
int cfg_for(int D) { return D <= 32 ? 0 : 3; }

// ---- softmin: out_i = -eps LSE_j (h_j - C_ij / eps) ----------------------------------------
// Kernel: oscale * LSE2_j (hs_j - kcoef c_ij) with oscale = -eps ln 2 (engine.py _stream_lse).
// With eps_rel 0.05 the scores of a row span ~30 (base 2), under the kernels' lazy-maximum
// threshold (TH = 60 float, 200 double): after the first block the unchecked panels run.  The
// second case passes an l2 that makes the column chunks 64 wide (the running state carried
// across chunks) and eps_rel 0.002, which spreads the scores over ~700, so rows whose first
// block is far from their best columns raise the maximum mid-row (the checked panels).
template <typename T> void check_softmin(Tally& t, int D, int N, int M, double eps_rel, int64_t l2, uint64_t seed) {
  const Problem<T> p = make_problem<T>(seed, N, M, D, eps_rel);
  std::vector<T> out((size_t)p.B * N);
  const int rc = softmin(p, out.data(), -p.eps * LN2, cfg_for(D), l2);
  MaxErr e;
  for (int b = 0; b < p.B; ++b)
    for (int i = 0; i < N; ++i) {
      const double ref = -p.eps * ref_lse(M, [&](int j) { return p.h[(size_t)b * M + j] - p.c(b, i, j) / p.eps; });
      e.add(out[(size_t)b * N + i], ref, p.eps * p.expo_scale());
    }
  const std::string extra = l2 < L2 ? " cfg=" + std::to_string(cfg_for(D)) + " chunks=64" : " cfg=" + std::to_string(cfg_for(D));
  t.error_check(describe("softmin", tname<T>(), D, N, M, eps_rel, extra.c_str()), rc, e.worst, TOL<T>);
}

// ---- block-sparse softmin (multiscale engine): each row cluster sums over its kept column clusters --
// Columns of problem b = 0 are cut into clusters of 1..150 points, each padded to a multiple of PAD
// with zero-weight slots (engine: blocksparse.py's padded layout); rows into clusters of 1..40 rows;
// each row cluster keeps a random subset of the column clusters (at least one).  Reference: the LSE
// over the kept columns only.
int softmin_bs(const Problem<float>& p, const std::vector<float>& yT, const std::vector<float>& yy,
               const std::vector<float>& hs, int64_t Mp, float* out, const std::vector<int64_t>& tasks,
               const std::vector<int64_t>& cptr, const std::vector<int64_t>& cr, double oscale, int cfg) {
  return pos_softmin_bs(p.x.data(), yT.data(), yy.data(), hs.data(), out, Mp, p.D, tasks.data(),
                                (int64_t)tasks.size() / 3, cptr.data(), cr.data(), p.k, 0.0, KIND_DOT, oscale, cfg, NTH);
}
int softmin_bs(const Problem<double>& p, const std::vector<double>& yT, const std::vector<double>& yy,
               const std::vector<double>& hs, int64_t Mp, double* out, const std::vector<int64_t>& tasks,
               const std::vector<int64_t>& cptr, const std::vector<int64_t>& cr, double oscale, int cfg) {
  return pos_softmin_bs(p.x.data(), yT.data(), yy.data(), hs.data(), out, Mp, p.D, tasks.data(),
                                (int64_t)tasks.size() / 3, cptr.data(), cr.data(), p.k, 0.0, KIND_DOT, oscale, cfg, NTH);
}

// lse == nullptr: the one-pass mode (weights e^{a_i + h_j - C_ij/eps} themselves); mass: the rows' plan mass.
int plan_bs(const Problem<float>& p, const std::vector<float>& yT, const std::vector<float>& yy,
            const std::vector<float>& hs, const float* lse, const std::vector<float>& VTk, int K, float* out, float* mass,
            int64_t Mp, const std::vector<int64_t>& tasks, const std::vector<int64_t>& cptr,
            const std::vector<int64_t>& cr) {
  return pos_plan_bs(p.x.data(), yT.data(), yy.data(), hs.data(), lse ? lse : p.a.data(), p.a.data(), VTk.data(),
                             K, out, mass, lse == nullptr, Mp, p.D, tasks.data(), (int64_t)tasks.size() / 3, cptr.data(),
                             cr.data(), p.k, 0.0, KIND_DOT, 0, 1.0, NTH);
}
int plan_bs(const Problem<double>& p, const std::vector<double>& yT, const std::vector<double>& yy,
            const std::vector<double>& hs, const double* lse, const std::vector<double>& VTk, int K, double* out,
            double* mass, int64_t Mp, const std::vector<int64_t>& tasks, const std::vector<int64_t>& cptr,
            const std::vector<int64_t>& cr) {
  return pos_plan_bs(p.x.data(), yT.data(), yy.data(), hs.data(), lse ? lse : p.a.data(), p.a.data(),
                             VTk.data(), K, out, mass, lse == nullptr, Mp, p.D, tasks.data(), (int64_t)tasks.size() / 3,
                             cptr.data(), cr.data(), p.k, 0.0, KIND_DOT, 0, 1.0, NTH);
}

// The padded column layout of blocksparse.py for problem b = 0: column j of cluster c (points [coff[c],
// coff[c + 1])) at pos[j] = poff[c] + j - coff[c]; the padding slots have zero weight.
template <typename T>
void padded_columns(const Problem<T>& p, const std::vector<int64_t>& coff, const std::vector<int64_t>& poff,
                    std::vector<T>& yT, std::vector<T>& yy, std::vector<T>& hs, std::vector<int64_t>& pos) {
  const int64_t Mp = poff.back();
  yT.assign((size_t)p.D * Mp, (T)0), yy.assign((size_t)Mp, (T)0), hs.assign((size_t)Mp, zero_weight<T>());
  pos.assign(p.M, -1);
  for (size_t c = 0; c + 1 < coff.size(); ++c)
    for (int64_t j = coff[c]; j < coff[c + 1]; ++j) {
      const int64_t q = poff[c] + (j - coff[c]);
      for (int d = 0; d < p.D; ++d) yT[(size_t)d * Mp + q] = p.yT[(size_t)d * p.Mp + j];
      yy[q] = p.yy[j];
      hs[q] = p.hs[j];
      pos[j] = q;
    }
}

// Also the block-sparse plan product (K = 3 columns of V, W = 1): out_i = sum_{kept j} e^{a_i + h_j - C_ij/eps} V_jk,
// after the base-2 row LSE pass (softmin_bs with oscale 1), against a double reference (relative to its row scale).
template <typename T> void check_softmin_bs(Tally& t, int D, int N, int M, double eps_rel, uint64_t seed) {
  const Problem<T> p = make_problem<T>(seed, N, M, D, eps_rel);
  Rng g(seed + 7);
  std::vector<int64_t> coff{0}, poff{0};  // column clusters: point offsets, padded offsets
  while (coff.back() < M) {
    const int64_t n = std::min<int64_t>(M - coff.back(), 1 + (int64_t)(g.next() % 150));
    coff.push_back(coff.back() + n);
    poff.push_back(poff.back() + (n + PAD - 1) / PAD * PAD);
  }
  const int64_t Kc = (int64_t)coff.size() - 1, Mp = poff.back();
  std::vector<T> yT, yy, hs;
  std::vector<int64_t> pos, col_of(Mp, -1);
  padded_columns(p, coff, poff, yT, yy, hs, pos);
  for (int64_t j = 0; j < M; ++j) col_of[pos[j]] = j;
  std::vector<int64_t> tasks, cptr{0}, cr;
  std::vector<std::vector<char>> kept;
  for (int64_t i0 = 0, k = 0; i0 < N; ++k) {
    const int64_t i1 = std::min<int64_t>(N, i0 + 1 + (int64_t)(g.next() % 40));
    tasks.insert(tasks.end(), {i0, i1, k});
    std::vector<char> kk(Kc, 0);
    kk[g.next() % Kc] = 1;
    for (int64_t c = 0; c < Kc; ++c) kk[c] |= (g.next() % 3) == 0;
    for (int64_t c = 0; c < Kc; ++c)
      if (kk[c]) cr.insert(cr.end(), {poff[c], poff[c + 1]});
    cptr.push_back((int64_t)cr.size() / 2);
    kept.push_back(kk);
    i0 = i1;
  }
  std::vector<T> out((size_t)N);
  const int rc = softmin_bs(p, yT, yy, hs, Mp, out.data(), tasks, cptr, cr, -p.eps * LN2, cfg_for(D));
  MaxErr e;
  for (size_t u = 0; u < tasks.size() / 3; ++u)
    for (int64_t i = tasks[3 * u]; i < tasks[3 * u + 1]; ++i) {
      const auto& kk = kept[tasks[3 * u + 2]];
      const double ref = -p.eps * ref_lse(M, [&](int j) {
        int64_t c = 0;
        while (coff[c + 1] <= j) ++c;
        return kk[c] ? p.h[j] - p.c(0, (int)i, j) / p.eps : -INF;
      });
      e.add(out[(size_t)i], ref, p.eps * p.expo_scale());
    }
  t.error_check(describe("softmin_bs", tname<T>(), D, N, M, eps_rel, (" clusters=" + std::to_string(Kc)).c_str()),
                rc, e.worst, TOL<T>);
  const int K = 3;
  std::vector<T> lse2((size_t)N), VTk((size_t)K * Mp, (T)0), po((size_t)N * K);
  std::vector<double> V((size_t)M * K);
  for (int64_t q = 0; q < Mp; ++q)
    if (col_of[q] >= 0)
      for (int kk = 0; kk < K; ++kk) {
        const T v = (T)g.uniform(-1.0, 1.0);
        VTk[(size_t)kk * Mp + q] = v;
        V[(size_t)col_of[q] * K + kk] = (double)v;
      }
  const int rc1 = softmin_bs(p, yT, yy, hs, Mp, lse2.data(), tasks, cptr, cr, 1.0, cfg_for(D));
  std::vector<T> mass((size_t)N), po1((size_t)N * K);
  const int rc2 = plan_bs(p, yT, yy, hs, lse2.data(), VTk, K, po.data(), mass.data(), Mp, tasks, cptr, cr);
  const int rc3 = plan_bs(p, yT, yy, hs, nullptr, VTk, K, po1.data(), mass.data(), Mp, tasks, cptr, cr);
  MaxErr ep, e1, em;
  for (size_t u = 0; u < tasks.size() / 3; ++u)
    for (int64_t i = tasks[3 * u]; i < tasks[3 * u + 1]; ++i) {
      const auto& kk = kept[tasks[3 * u + 2]];
      auto s_ij = [&](int j) {
        int64_t c = 0;
        while (coff[c + 1] <= j) ++c;
        return kk[c] ? p.s(0, (int)i, j) : -INF;
      };
      const double lse = ref_lse(M, s_ij);
      for (int q = 0; q < K; ++q) {
        double ref = 0;
        for (int j = 0; j < M; ++j) ref += std::exp(s_ij(j) - lse) * V[(size_t)j * K + q];
        ep.add((double)po[(size_t)i * K + q] * std::exp(-lse), ref, 1.0);
        e1.add((double)po1[(size_t)i * K + q] * std::exp(-lse), ref, 1.0);
      }
      em.add((double)mass[(size_t)i] * std::exp(-lse), 1.0, 1.0);
    }
  t.error_check(describe("plan_bs", tname<T>(), D, N, M, eps_rel, (" clusters=" + std::to_string(Kc)).c_str()),
                rc1 | rc2, ep.worst, TOL<T> * 10);
  t.error_check(describe("plan_bs one-pass", tname<T>(), D, N, M, eps_rel,
                         (" clusters=" + std::to_string(Kc) + " (out and plan mass)").c_str()),
                rc3, std::max(e1.worst, em.worst), TOL<T> * 10);
}

// ---- block-sparse pair (flashot_pair_bs): row and column sums of E_ij = e^{a_i + h_j - C_ij / eps} over
// the kept blocks (clusters of 1..40 points, columns padded per cluster as in check_softmin_bs).  sym: y = x
// and h = a, the same clusters on both sides and a symmetric pattern; the kernel sums the blocks on and right
// of the diagonal only and the full row sums are rs_i + cs_i.  Reference: double sums over the kept pairs.
// tiles: sub-tile pruning with a threshold no tile reaches (fx = fxo = 0 per row, gy = gyo = hs on the padded
// columns): the same sums as without, through the chunked column loop.
template <typename T, typename F>
int pair_bs_call(F fn, const T* x, const std::vector<T>& yT, const std::vector<T>& yy, const std::vector<T>& hs,
                 const T* hx, T* rs, T* cs, T* rb, int cb, int64_t Mp, int D, const std::vector<int64_t>& tasks,
                 const std::vector<int64_t>& cptr, const std::vector<int64_t>& cr, const std::vector<int64_t>& poff,
                 double k, int cfg, int sym, bool tiles, int N) {
  std::vector<T> fx((size_t)N, (T)0), gy(hs);
  for (auto& v : gy) if (v < (T)-1e30) v = -std::numeric_limits<T>::infinity();  // the padding
  int64_t evaluated = 0;
  return fn(x, yT.data(), yy.data(), hs.data(), hx, rs, cs, rb, cb, tiles ? fx.data() : nullptr,
            tiles ? gy.data() : nullptr, tiles ? fx.data() : nullptr, tiles ? gy.data() : nullptr, 1e300, &evaluated, Mp,
            D, tasks.data(), (int64_t)tasks.size() / 3, cptr.data(), cr.data(), poff.data(), k, 0.0, KIND_DOT, cfg, sym,
            NTH);
}
template <typename T> int pair_bs(const T* x, const std::vector<T>& yT, const std::vector<T>& yy,
                                  const std::vector<T>& hs, const T* hx, T* rs, T* cs, T* rb, int cb, int64_t Mp, int D,
                                  const std::vector<int64_t>& tasks, const std::vector<int64_t>& cptr,
                                  const std::vector<int64_t>& cr, const std::vector<int64_t>& poff, double k, int cfg,
                                  int sym, bool tiles, int N) {
  if constexpr (std::is_same<T, float>::value)
    return pair_bs_call(pos_pair_bs<T>, x, yT, yy, hs, hx, rs, cs, rb, cb, Mp, D, tasks, cptr, cr, poff, k, cfg,
                        sym, tiles, N);
  else
    return pair_bs_call(pos_pair_bs<T>, x, yT, yy, hs, hx, rs, cs, rb, cb, Mp, D, tasks, cptr, cr, poff, k, cfg,
                        sym, tiles, N);
}

std::vector<int64_t> random_clusters(Rng& g, int64_t n) {
  std::vector<int64_t> off{0};
  while (off.back() < n) off.push_back(off.back() + std::min<int64_t>(n - off.back(), 1 + (int64_t)(g.next() % 40)));
  return off;
}

// bary (D <= 3): 1, also the rows' numerators rb_i = sum_j E_ij y_j; 2, also the columns' sum_i E_ij x_i (in cs
// after its first Mp values).  sym needs 2; then the full numerators are rb_i + cs[(1 + d) Mp + pos_i].
template <typename T> void check_pair_bs(Tally& t, int D, int N, int M, bool sym, uint64_t seed, int bary = 0,
                                         bool tiles = false) {
  const double eps_rel = 0.05;
  Problem<T> p = make_problem<T>(seed, N, sym ? N : M, D, eps_rel);
  if (sym) {  // y = x, h = a
    p.y = p.x;
    p.h = p.a;
    exact_costs(p);
    kernel_layout(p);
  }
  M = p.M;
  Rng g(seed + 11);
  const std::vector<int64_t> roff = random_clusters(g, N), coff = sym ? roff : random_clusters(g, M);
  const int64_t Kr = (int64_t)roff.size() - 1, Kc = (int64_t)coff.size() - 1;
  std::vector<int64_t> poff{0}, pos;
  for (int64_t c = 0; c < Kc; ++c) poff.push_back(poff.back() + (coff[c + 1] - coff[c] + PAD - 1) / PAD * PAD);
  const int64_t Mp = poff.back();
  std::vector<T> yT, yy, hs;
  padded_columns(p, coff, poff, yT, yy, hs, pos);
  std::vector<std::vector<char>> kept(Kr, std::vector<char>(Kc, 0));
  for (int64_t r = 0; r < Kr; ++r) {
    kept[r][sym ? r : g.next() % Kc] = 1;
    for (int64_t c = sym ? r + 1 : 0; c < Kc; ++c) kept[r][c] |= (g.next() % 3) == 0;
  }
  if (sym)
    for (int64_t r = 0; r < Kr; ++r)
      for (int64_t c = 0; c < r; ++c) kept[r][c] = kept[c][r];
  std::vector<int64_t> tasks, cptr{0}, cr;
  for (int64_t r = 0; r < Kr; ++r) {
    tasks.insert(tasks.end(), {roff[r], roff[r + 1], r});
    for (int64_t c = 0; c < Kc; ++c)  // runs of kept clusters as one range, as blocksparse.py builds them
      if (kept[r][c]) {
        if (!cr.empty() && (int64_t)cr.size() / 2 > cptr.back() && cr.back() == poff[c]) cr.back() = poff[c + 1];
        else cr.insert(cr.end(), {poff[c], poff[c + 1]});
      }
    cptr.push_back((int64_t)cr.size() / 2);
  }
  std::vector<T> hx((size_t)N), rs((size_t)N), cs((size_t)Mp * (bary == 2 ? 1 + D : 1)), rb((size_t)N * D);
  for (int i = 0; i < N; ++i) hx[i] = (T)(p.a[i] * LOG2E);
  const int rc = pair_bs(p.x.data(), yT, yy, hs, hx.data(), rs.data(), cs.data(), bary ? rb.data() : nullptr,
                         (int)(bary == 2), Mp, D, tasks, cptr, cr, poff, p.k, cfg_for(D), (int)sym, tiles, N);
  auto cl = [](const std::vector<int64_t>& off, int64_t i) {
    int64_t c = 0;
    while (off[c + 1] <= i) ++c;
    return c;
  };
  MaxErr e;
  for (int i = 0; i < N; ++i) {
    double r = 0;
    for (int j = 0; j < M; ++j) r += kept[cl(roff, i)][cl(coff, j)] ? std::exp(p.s(0, i, j)) : 0.0;
    const double got = sym ? (double)rs[i] + (double)cs[pos[i]] : (double)rs[i];
    e.add(got, r, r * p.expo_scale());
  }
  if (!sym)
    for (int j = 0; j < M; ++j) {
      double c = 0;
      for (int i = 0; i < N; ++i) c += kept[cl(roff, i)][cl(coff, j)] ? std::exp(p.s(0, i, j)) : 0.0;
      e.add(cs[pos[j]], c, c * p.expo_scale());
    }
  for (int d = 0; bary && d < D; ++d) {  // numerators, scaled by sum E |coordinate|
    for (int i = 0; i < N; ++i) {
      double r = 0, sc = 0;
      for (int j = 0; j < M; ++j) {
        const double w = kept[cl(roff, i)][cl(coff, j)] ? std::exp(p.s(0, i, j)) : 0.0, v = p.y[(size_t)j * D + d];
        r += w * v;
        sc += w * std::fabs(v);
      }
      const double got = (double)rb[(size_t)i * D + d] + (sym ? (double)cs[(size_t)(1 + d) * Mp + pos[i]] : 0.0);
      e.add(got, r, sc * p.expo_scale() + 1e-300);
    }
    for (int j = 0; bary == 2 && !sym && j < M; ++j) {
      double c = 0, sc = 0;
      for (int i = 0; i < N; ++i) {
        const double w = kept[cl(roff, i)][cl(coff, j)] ? std::exp(p.s(0, i, j)) : 0.0, v = p.x[(size_t)i * D + d];
        c += w * v;
        sc += w * std::fabs(v);
      }
      e.add(cs[(size_t)(1 + d) * Mp + pos[j]], c, sc * p.expo_scale() + 1e-300);
    }
  }
  t.error_check(describe("pair_bs", tname<T>(), D, N, M, eps_rel,
                         ((sym ? " sym=1 rows" : " sym=0 rows+cols") + std::string(" bary=") +
                          std::to_string(bary) + " tiles=" + std::to_string((int)tiles) + " clusters=" +
                          std::to_string(Kr) + "x" + std::to_string(Kc)).c_str()),
                rc, e.worst, TOL<T>);
}

// ---- pair (sym = 0): rs_i = sum_j E_ij, cs_j = sum_i E_ij, E_ij = e^{a_i + h_j - C_ij / eps} --
// Kernel: E = 2^(hx_i + hs_j - kcoef c_ij) with hx = a log2(e); no running maximum, so eps is
// moderate (C / eps <= 20: no under- or overflow).
template <typename T> void check_pair(Tally& t, int D, int N, int M, uint64_t seed) {
  const double eps_rel = 0.05;
  const Problem<T> p = make_problem<T>(seed, N, M, D, eps_rel);
  std::vector<T> hx((size_t)p.B * N), rs((size_t)p.B * N), cs((size_t)p.B * p.Mp);
  for (size_t i = 0; i < hx.size(); ++i) hx[i] = (T)(p.a[i] * LOG2E);
  const int rc = pair(p, hx.data(), rs.data(), cs.data(), cfg_for(D));
  MaxErr e;
  for (int b = 0; b < p.B; ++b) {
    for (int i = 0; i < N; ++i) {
      double r = 0;
      for (int j = 0; j < M; ++j) r += std::exp(p.s(b, i, j));
      e.add(rs[(size_t)b * N + i], r, r * p.expo_scale());
    }
    for (int j = 0; j < M; ++j) {
      double c = 0;
      for (int i = 0; i < N; ++i) c += std::exp(p.s(b, i, j));
      e.add(cs[(size_t)b * p.Mp + j], c, c * p.expo_scale());
    }
  }
  t.error_check(describe("pair", tname<T>(), D, N, M, eps_rel, " sym=0 rows+cols"), rc, e.worst, TOL<T>);
}

// ---- plan products: out_ik = sum_j P_ij W_ij V_jk, P_ij = e^{a_i + h_j - C_ij / eps} --------
// W = 1 (W_ONE) or C_ij (W_COST), wconst = 1.  One pass (single = 1): the kernel's row shift is
// -a_i log2(e) and mass_i = sum_j P_ij.  Two passes (single = 0): the caller gives the row's
// base-2 LSE L_i of hs_j - kcoef c_ij; the weights are 2^(hs_j - kcoef c_ij - L_i), mass_i is
// their sum (about 1) and the output is scaled by 2^(a_i log2(e) + L_i).
// Narrow (K <= 4): V given transposed (B, K, Mp).  Wide: V (B, Mp, Kp) row-major, K padded to
// Kp, a multiple of the vector width; out is (B, N, Kp) and its padding columns must be 0.
struct PlanCase {
  int D, N, M, K, wk, single, narrow;
};

template <typename T> std::vector<T> plan_input_v(const Problem<T>& p, const PlanCase& c, int Kp,
                                                  std::vector<double>& V) {
  Rng g(7 + c.K);
  V.resize((size_t)p.B * p.M * c.K);
  for (auto& v : V) v = (double)(T)g.uniform(-1.0, 1.0);
  std::vector<T> Vk(c.narrow ? (size_t)p.B * c.K * p.Mp : (size_t)p.B * p.Mp * Kp, (T)0);
  for (int b = 0; b < p.B; ++b)
    for (int j = 0; j < p.M; ++j)
      for (int k = 0; k < c.K; ++k) {
        const T v = (T)V[((size_t)b * p.M + j) * c.K + k];
        if (c.narrow) Vk[((size_t)b * c.K + k) * p.Mp + j] = v;
        else Vk[((size_t)b * p.Mp + j) * Kp + k] = v;
      }
  return Vk;
}

template <typename T> std::vector<T> base2_row_lse(const Problem<T>& p) {
  std::vector<T> lse((size_t)p.B * p.N);
  for (int b = 0; b < p.B; ++b)
    for (int i = 0; i < p.N; ++i)
      lse[(size_t)b * p.N + i] =
          (T)(LOG2E * ref_lse(p.M, [&](int j) { return p.h[(size_t)b * p.M + j] - p.c(b, i, j) / p.eps; }));
  return lse;
}

template <typename T> void check_plan(Tally& t, const PlanCase& c, uint64_t seed) {
  const double eps_rel = 0.05;
  const Problem<T> p = make_problem<T>(seed, c.N, c.M, c.D, eps_rel);
  const int lanes = flashot_vector_bytes() / (int)sizeof(T);
  const int Kp = c.narrow ? c.K : (c.K + lanes - 1) / lanes * lanes;
  std::vector<double> V;
  const std::vector<T> Vk = plan_input_v(p, c, Kp, V);
  const std::vector<T> lse = base2_row_lse(p);
  std::vector<T> out((size_t)p.B * p.N * Kp, (T)-7), mass((size_t)p.B * p.N);
  const int rc = plan(p, lse.data(), p.a.data(), Vk.data(), Kp, out.data(), mass.data(), c.single, c.wk, c.narrow);
  MaxErr e;
  for (int b = 0; b < p.B; ++b)
    for (int i = 0; i < p.N; ++i) {
      const double shift = c.single ? 0.0 : (double)lse[(size_t)b * p.N + i] * LN2 + p.a[(size_t)b * p.N + i];
      std::vector<double> o(c.K, 0.0), mag(c.K, 0.0);
      double m = 0;
      for (int j = 0; j < p.M; ++j) {
        const double P = std::exp(p.s(b, i, j));
        const double W = c.wk == W_COST ? p.c(b, i, j) : 1.0;
        m += std::exp(p.s(b, i, j) - shift);
        for (int k = 0; k < c.K; ++k) {
          o[k] += P * W * V[((size_t)b * p.M + j) * c.K + k];
          mag[k] += P * W * std::fabs(V[((size_t)b * p.M + j) * c.K + k]);
        }
      }
      const T* row = out.data() + ((size_t)b * p.N + i) * Kp;
      for (int k = 0; k < c.K; ++k) e.add(row[k], o[k], mag[k] * p.expo_scale());
      for (int k = c.K; k < Kp; ++k) e.add(row[k], 0.0, 1.0);  // padding columns of a wide V
      e.add(mass[(size_t)b * p.N + i], m, m * p.expo_scale());
    }
  char extra[96];
  std::snprintf(extra, sizeof extra, " K=%d%s %s %s +mass", c.K, c.narrow ? " narrow" : " wide",
                c.wk == W_COST ? "W_COST" : "W_ONE", c.single ? "one-pass" : "two-pass");
  t.error_check(describe("plan", tname<T>(), c.D, c.N, c.M, eps_rel, extra), rc, e.worst, TOL<T>);
}

// ---- fused alternating step (float, cfg 0) --------------------------------------------------
// rlse_i = LSE2_j (hs_j - kcoef c_ij); clse_j = LSE2_i (w_i - kcoef c_ij) with the rows' new
// weights w_i = ha_i - lam rlse_i (ha = a log2(e)): the softmin onto x, then the one onto y.
// The column LSE inherits lam times the row error, hence its tolerance (1 + lam) TOL E log2(e).
void check_alt(Tally& t, int D, int N, int M, uint64_t seed) {
  const double eps_rel = 0.02, lam = 0.75;
  const Problem<float> p = make_problem<float>(seed, N, M, D, eps_rel);
  std::vector<float> ha((size_t)p.B * N), rl((size_t)p.B * N), cl((size_t)p.B * p.Mp);
  for (size_t i = 0; i < ha.size(); ++i) ha[i] = (float)(p.a[i] * LOG2E);
  const int rc = pos_alt(p.x.data(), p.yT.data(), p.yy.data(), p.hs.data(), ha.data(), lam, rl.data(),
                                 cl.data(), p.B, N, p.Mp, D, p.k, 0.0, KIND_DOT, 0, L2, NTH);
  MaxErr e;
  const double unit = p.expo_scale() * LOG2E;
  for (int b = 0; b < p.B; ++b) {
    std::vector<double> w(N);
    for (int i = 0; i < N; ++i) {
      const double r = LOG2E * ref_lse(M, [&](int j) { return p.h[(size_t)b * M + j] - p.c(b, i, j) / p.eps; });
      e.add(rl[(size_t)b * N + i], r, unit);
      w[i] = ha[(size_t)b * N + i] - lam * r;
    }
    for (int j = 0; j < M; ++j) {
      const double r = LOG2E * ref_lse(N, [&](int i) { return w[i] * LN2 - p.c(b, i, j) / p.eps; });
      e.add(cl[(size_t)b * p.Mp + j], r, (1 + lam) * unit);
    }
  }
  t.error_check(describe("alt", "f32", D, N, M, eps_rel, " cfg=0 lam=0.75 rows+cols"), rc, e.worst, TOL<float>);
}

// ---- cached-cost passes over a given matrix C (B, N, M), no padding ---------------------------
// rows_lse: out_i = oscale LSE2_j (hb_j - k C_ij), hb (B, M); oscale = -eps ln 2 (a softmin).
// cols_lse: out_j = oscale LSE2_i (hb_i - k C_ij), hb (B, N); oscale = 1 (the base-2 LSE).
// C is the exact cost rounded to T, and the reference uses that rounded C.  One weight of each
// batch is zero (-inf; float: -1e38) to exercise the skipped terms.
template <typename T> void check_cached(Tally& t, int N, int M, uint64_t seed) {
  const double eps_rel = 0.01;
  const Problem<T> p = make_problem<T>(seed, N, M, 3, eps_rel);
  std::vector<T> C(p.C.size()), hr(p.h), hc(p.a), o1((size_t)p.B * N), o2((size_t)p.B * M);
  for (size_t u = 0; u < C.size(); ++u) C[u] = (T)p.C[u];
  for (int b = 0; b < p.B; ++b) {
    hr[(size_t)b * M + 1] = zero_weight<T>();
    hc[(size_t)b * N + 2] = zero_weight<T>();
  }
  std::vector<T> hr2(hr), hc2(hc);  // base 2
  for (auto& v : hr2) v = (T)(v * LOG2E);
  for (auto& v : hc2) v = (T)(v * LOG2E);
  const int rc1 = rows_lse(C.data(), hr2.data(), o1.data(), p.B, N, M, p.k, -p.eps * LN2);
  const int rc2 = cols_lse(C.data(), hc2.data(), o2.data(), p.B, N, M, p.k, 1.0);
  auto cc = [&](int b, int i, int j) { return (double)C[((size_t)b * N + i) * M + j]; };
  MaxErr e1, e2;
  for (int b = 0; b < p.B; ++b) {
    for (int i = 0; i < N; ++i) {
      const double r = -p.eps * ref_lse(M, [&](int j) { return (double)hr[(size_t)b * M + j] - cc(b, i, j) / p.eps; });
      e1.add(o1[(size_t)b * N + i], r, p.eps * p.expo_scale());
    }
    for (int j = 0; j < M; ++j) {
      const double r = LOG2E * ref_lse(N, [&](int i) { return (double)hc[(size_t)b * N + i] - cc(b, i, j) / p.eps; });
      e2.add(o2[(size_t)b * M + j], r, p.expo_scale() * LOG2E);
    }
  }
  t.error_check(describe("rows_lse", tname<T>(), 3, N, M, eps_rel), rc1, e1.worst, TOL<T>);
  t.error_check(describe("cols_lse", tname<T>(), 3, N, M, eps_rel), rc2, e2.worst, TOL<T>);
}

// ---- vexp: out = 2^a ----------------------------------------------------------------------
// n = 1003 (a vector tail) arguments spread over [LO - 16, HI] (HI = 126 / 1000: the kernels'
// documented argument bound): relative error <= 4 ulps (the polynomials: 1.6 / 2 ulps) where
// 2^a is a normal number above the kernels' cut-off LO (float -124, double -1009); below it the
// result must be in [0, 2^(LO+1)] (exact 0 by mask, or a tiny value flushed or not by FTZ,
// depending on the instruction set), and exactly 0 far below it (-151 / -1100, and the zero-weight
// code -1e38 / -1e300).  Arguments >= 128 (float) / 1024 (double) give +inf.
template <typename T> void check_vexp(Tally& t) {
  const bool f32 = sizeof(T) == 4;
  const double lo = f32 ? -124.0 : -1009.0, hi = f32 ? 126.0 : 1000.0, ulp = std::numeric_limits<T>::epsilon();
  const int64_t n = 1003;
  std::vector<T> a(n), out(n, (T)-1);
  for (int64_t i = 0; i < n; ++i) a[i] = (T)(lo - 16 + (hi - lo + 16) * (double)i / (double)(n - 1));
  a[n / 2] = (T)(f32 ? 128.0 : 1024.0), a[n / 3] = (T)(f32 ? 200.0 : 5000.0), a[n - 1] = (T)(f32 ? 1e30 : 1e300);
  const double far = f32 ? -151.0 : -1100.0;
  a[1] = (T)(f32 ? -1e38 : -1e300), a[2] = (T)far, a[n - 2] = (T)far;  // a[n - 2]: in the vector tail
  const int rc = vexp(a.data(), out.data(), n);
  MaxErr e;
  int bad_small = 0, bad_inf = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double ai = a[i], o = out[i];
    if (ai >= (f32 ? 128.0 : 1024.0)) bad_inf += !(o == INF);
    else if (ai <= far) bad_small += !(o == 0);
    else if (ai < lo) bad_small += !(o >= 0 && o <= std::exp2(lo + 1));
    else e.add(o, std::exp2(ai), std::exp2(ai) * ulp);
  }
  char buf[160];
  std::snprintf(buf, sizeof buf, "max rel err %.3g ulp (tol 4); %d bad below cut-off; %d not +inf on overflow%s",
                e.worst, bad_small, bad_inf, rc ? " (kernel returned non-zero)" : "");
  t.report(rc == 0 && e.worst <= 4 && bad_small == 0 && bad_inf == 0,
           std::string("vexp ") + tname<T>() + " n=1003", buf);
}

// ---- floating-point environment ---------------------------------------------------------------
// With the probe armed, every thread that ran a kernel scope (team index = slot) records its
// bits (FTZ 1 | DAZ 2 | seen 4) after setting them: all must be FTZ | DAZ, as many threads as
// requested.  Afterwards the calling thread's bits and those of the team's workers (read by
// flashot_fp_bits_workers in a run without a scope) must be
// what they were before: this is the first kernel call of the process, so the workers are
// created during it, and a worker created while its creator flushed would keep flushing.
std::string probe_slots(const int* slots, int n, int& listed, int& flushing) {
  std::string s;
  listed = flushing = 0;
  for (int u = 0; u < n; ++u)
    if (slots[u] & 4) {
      ++listed;
      flushing += (slots[u] & 3) == 3;
      s += " t" + std::to_string(u) + "=" + std::to_string(slots[u] & 3);
    }
  return s;
}

void check_fp_probe(Tally& t) {
  const Problem<float> p = make_problem<float>(99, 131, 131, 3, 0.05);
  std::vector<float> out((size_t)p.B * p.N);
  const int before = flashot_fp_bits();
  flashot_fp_probe(1);
  const int rc = softmin(p, out.data(), -p.eps * LN2, 0, L2);
  const int after = flashot_fp_bits();
  int slots[256] = {0};
  const int seen = flashot_fp_probe_read(slots, 256);
  flashot_fp_probe(0);
  int listed = 0, flushing = 0;
  const std::string bits = probe_slots(slots, 256, listed, flushing);
  const int want = (flashot_isa() & 64) ? NTH : 1;
  char buf[200];
  std::snprintf(buf, sizeof buf, "%d threads seen (want %d), FTZ|DAZ in %d:%s; caller bits %d before, %d after",
                seen, want, flushing, bits.c_str(), before, after);
  t.report(rc == 0 && seen == want && listed == seen && flushing == seen && after == before,
           "fp probe softmin f32 nth=2", buf);
  int wb[NTH] = {0};
  const int team = flashot_fp_bits_workers(wb, NTH);
  bool same = team == want;
  std::string ws;
  for (int u = 0; u < std::min(team, NTH); ++u) {
    same &= wb[u] == before;
    ws += " t" + std::to_string(u) + "=" + std::to_string(wb[u]);
  }
  t.report(same, "fp workers after kernel", std::to_string(team) + " threads:" + ws + " (want all " +
                                                std::to_string(before) + ")");
}

// ---- build facts: ABI version, instruction set and vector width as this compiler sees them ----
void check_build_facts(Tally& t) {
  const int abi = flashot_abi_version();
  t.report(flashot_bs_abi_version() == abi && flashot_bs_vector_bytes() == flashot_vector_bytes(), "bs_build_facts",
           "the blocksparse library's ABI version and vector width equal the core's");
  t.report(abi == FLASHOT_ABI_VERSION && abi != 0, "abi_version", std::to_string(abi) + " (driver compiled with " +
                                                   std::to_string(FLASHOT_ABI_VERSION) + ")");
  const std::string layout = flashot_layout_text();
  t.report(layout == flashot_abi_layout() && layout == flashot_bs_abi_layout(), "abi_layout",
           "both libraries' argument structs laid out as the driver's abi.h");
  int want = 0;  // flashot_isa() bits: 1 SSE4.2, 2 AVX, 4 AVX2, 8 FMA, 16 AVX-512F, 32 AArch64, 64 threads
#if defined(__SSE4_2__)
  want |= 1;
#endif
#if defined(__AVX__)
  want |= 2;
#endif
#if defined(__AVX2__)
  want |= 4;
#endif
#if defined(__FMA__)
  want |= 8;
#endif
#if defined(__AVX512F__)
  want |= 16;
#endif
#if defined(__aarch64__)
  want |= 32;
#endif
  want |= 64;  // always multi-threaded (parallel.h)
  const int isa = flashot_isa();
  t.report(isa == want, "isa", std::to_string(isa) + " (driver compiled with " + std::to_string(want) + ")");
#if defined(__AVX512F__)
  const int vb = 64;
#elif defined(__AVX__)
  const int vb = 32;
#else
  const int vb = 16;  // SSE2, NEON and anything else
#endif
  t.report(flashot_vector_bytes() == vb, "vector_bytes", std::to_string(flashot_vector_bytes()) + " (want " +
                                                             std::to_string(vb) + ")");
}

// ---- block_keep (multiscale pruning, prune.h): the kept fine blocks against a naive reference --------
// Per cluster (float64 rows of 5 + 3 D): radius r, potential maximum m, base, bb, bc, centre c, slope
// beta, u = c - beta / 2s.  The lower bound of C - f - g over a block, written again here from the
// formulas of prune.h's header: simple = cost(max(0, |c_i - c_j| - r_i - r_j)) - m_i - m_j; with the
// linear model (dot costs) also -base_i - base_j + max(t1, t2).  Kept: bound <= margin, plus each fine
// row's and column's best candidate.  Decisions within 1e-9 of the margin are not graded (rounding).
double ref_keep_bound(const double* a, const double* b, int D, int kind, int linear, double s, double minsq) {
  auto norm = [&](auto f) { double q = 0; for (int d = 0; d < D; ++d) q += f(d) * f(d); return std::sqrt(q); };
  const double rr = a[0] + b[0];
  const double* ca = a + 5; const double* cb = b + 5;
  const double* ba = ca + D; const double* bb = cb + D;
  const double* ua = ba + D; const double* ub = bb + D;
  const double gap = std::max(0.0, norm([&](int d) { return ca[d] - cb[d]; }) - rr);
  const double cost = kind == 1 ? s * gap * gap : std::sqrt(std::max(gap * gap, minsq));
  const double simple = cost - a[1] - b[1];
  if (!linear) return simple;
  const double nb = norm([&](int d) { return ba[d] + bb[d]; });
  double dab = 0, dba = 0;
  for (int d = 0; d < D; ++d) { dab += ba[d] * cb[d]; dba += ca[d] * bb[d]; }
  const double g1 = std::max(0.0, norm([&](int d) { return ua[d] - cb[d]; }) - rr);
  const double g2 = std::max(0.0, norm([&](int d) { return ca[d] - ub[d]; }) - rr);
  const double t1 = s * g1 * g1 + a[4] - dab - a[3] / (4 * s) - nb * b[0];
  const double t2 = s * g2 * g2 + b[4] - dba - b[3] / (4 * s) - nb * a[0];
  return std::max(simple, -a[2] - b[2] + std::max(t1, t2));
}

void check_block_keep(Tally& t, int D, int kind, int linear, uint64_t seed) {
  Rng g(seed);
  const int64_t Kx = 23, Ky = 19, Kcx = 5, Kcy = 4;
  const double s = 1.0, minsq = 1e-12, margin = 0.3;
  auto terms = [&](int64_t K) {
    std::vector<double> T((size_t)K * (5 + 3 * D));
    for (int64_t k = 0; k < K; ++k) {
      double* r = T.data() + k * (5 + 3 * D);
      r[0] = g.uniform(0.0, 0.1); r[1] = g.uniform(-0.5, 0.5); r[2] = g.uniform(-0.3, 0.3);
      r[3] = g.uniform(0.0, 0.2); r[4] = g.uniform(-0.3, 0.3);
      for (int d = 0; d < D; ++d) {
        r[5 + d] = g.uniform(0.0, 1.0);
        r[5 + D + d] = g.uniform(-0.3, 0.3);
        r[5 + 2 * D + d] = r[5 + d] - r[5 + D + d] / (2 * s);
      }
    }
    return T;
  };
  const std::vector<double> X = terms(Kx), Y = terms(Ky);
  const std::vector<int64_t> px{0, 4, 9, 15, 20, 23}, py{0, 6, 10, 13, 19};
  std::vector<int64_t> cptr{0}, ccols;
  for (int64_t I = 0; I < Kcx; ++I) {
    for (int64_t J = 0; J < Kcy; ++J)
      if (J == I % Kcy || g.next() % 2) ccols.push_back(J);
    cptr.push_back((int64_t)ccols.size());
  }
  std::vector<uint8_t> keep((size_t)(Kx * Ky), 0);
  const int rc = pos_block_keep(X.data(), Y.data(), D, Ky, Kcx, cptr.data(), ccols.data(), px.data(), py.data(),
                                    kind, linear, s, minsq, margin, keep.data(), NTH);
  std::vector<double> bound((size_t)(Kx * Ky), INF);
  for (int64_t I = 0; I < Kcx; ++I)
    for (int64_t q = cptr[I]; q < cptr[I + 1]; ++q)
      for (int64_t i = px[I]; i < px[I + 1]; ++i)
        for (int64_t j = py[ccols[q]]; j < py[ccols[q] + 1]; ++j)
          bound[i * Ky + j] = ref_keep_bound(X.data() + i * (5 + 3 * D), Y.data() + j * (5 + 3 * D), D, kind, linear,
                                             s, minsq);
  std::vector<char> want((size_t)(Kx * Ky), 0), graded((size_t)(Kx * Ky), 1);
  for (size_t u = 0; u < bound.size(); ++u) {
    want[u] = bound[u] <= margin;
    graded[u] = std::fabs(bound[u] - margin) > 1e-9;
  }
  for (int64_t i = 0; i < Kx; ++i) {  // each row's best candidate
    int64_t arg = -1;
    for (int64_t j = 0; j < Ky; ++j) if (bound[i * Ky + j] < INF && (arg < 0 || bound[i * Ky + j] < bound[i * Ky + arg])) arg = j;
    if (arg >= 0) want[i * Ky + arg] = 1;
  }
  for (int64_t j = 0; j < Ky; ++j) {  // each column's best candidate
    int64_t arg = -1;
    for (int64_t i = 0; i < Kx; ++i) if (bound[i * Ky + j] < INF && (arg < 0 || bound[i * Ky + j] < bound[arg * Ky + j])) arg = i;
    if (arg >= 0) want[arg * Ky + j] = 1;
  }
  int64_t wrong = 0, kept = 0, dropped = 0;
  for (size_t u = 0; u < want.size(); ++u) {
    kept += want[u];
    dropped += bound[u] < INF && !want[u];
    wrong += graded[u] && (keep[u] != 0) != (want[u] != 0);
  }
  char buf[160];
  std::snprintf(buf, sizeof buf, "%lld wrong decisions of %lld (%lld kept, %lld candidates dropped)", (long long)wrong,
                (long long)(Kx * Ky), (long long)kept, (long long)dropped);
  t.report(rc == 0 && wrong == 0 && kept > 0 && dropped > 0,
           std::string("block_keep D=") + std::to_string(D) + " kind=" + std::to_string(kind) + " linear=" +
               std::to_string(linear), buf);
}

void run_all(Tally& t) {
  check_build_facts(t);
  check_fp_probe(t);
  check_vexp<float>(t);
  check_vexp<double>(t);
  const int dims[] = {1, 2, 3, 5, 17, 40};
  const int sizes[][2] = {{37, 131}, {131, 37}, {100, 64}, {64, 97}, {53, 130}, {129, 65}};
  for (int u = 0; u < 6; ++u) {
    const int D = dims[u], N = sizes[u][0], M = sizes[u][1];
    const int n = std::min(N, M), m = std::max(N, M);  // chunked: m > 64 columns, so 2 or 3 chunks
    check_softmin<float>(t, D, N, M, 0.05, L2, 10 + u);
    check_softmin<float>(t, D, n, m, 0.002, 64 * (D + 2) * 4, 20 + u);
    check_softmin<double>(t, D, N, M, 0.05, L2, 30 + u);
    check_softmin<double>(t, D, n, m, 0.002, 64 * (D + 2) * 8, 40 + u);
    check_softmin_bs<float>(t, D, n, m, 0.05, 50 + u);
    check_softmin_bs<double>(t, D, n, m, 0.002, 60 + u);
  }
  check_pair<float>(t, 3, 37, 131, 50);
  check_pair<float>(t, 17, 131, 70, 51);
  check_pair<double>(t, 2, 100, 37, 52);
  check_pair<double>(t, 40, 64, 129, 53);
  check_pair_bs<float>(t, 3, 137, 201, false, 54);
  check_pair_bs<float>(t, 3, 190, 190, true, 55);
  check_pair_bs<double>(t, 2, 211, 97, false, 56);
  check_pair_bs<double>(t, 5, 160, 160, true, 57);
  check_pair_bs<float>(t, 17, 150, 150, true, 58);
  check_pair_bs<float>(t, 3, 137, 201, false, 59, 1);
  check_pair_bs<float>(t, 3, 137, 201, false, 60, 2);
  check_pair_bs<float>(t, 3, 190, 190, true, 61, 2);
  check_pair_bs<double>(t, 2, 211, 97, false, 62, 2);
  check_pair_bs<double>(t, 1, 160, 160, true, 63, 2);
  check_pair_bs<float>(t, 3, 137, 201, false, 64, 2, true);
  check_pair_bs<float>(t, 3, 190, 190, true, 65, 2, true);
  check_pair_bs<double>(t, 2, 211, 97, false, 66, 0, true);
  check_plan<float>(t, {3, 37, 131, 3, W_ONE, 1, 1}, 60);
  check_plan<float>(t, {5, 131, 40, 4, W_COST, 0, 1}, 61);
  check_plan<float>(t, {40, 70, 101, 37, W_ONE, 0, 0}, 62);
  check_plan<float>(t, {2, 45, 77, 9, W_COST, 1, 0}, 63);
  check_plan<double>(t, {3, 37, 131, 3, W_ONE, 1, 1}, 64);
  check_plan<double>(t, {17, 131, 40, 2, W_COST, 0, 1}, 65);
  check_plan<double>(t, {40, 70, 101, 37, W_COST, 1, 0}, 66);
  check_plan<double>(t, {2, 45, 77, 9, W_ONE, 0, 0}, 67);
  check_alt(t, 3, 37, 131, 70);
  check_alt(t, 24, 131, 67, 71);
  check_cached<float>(t, 131, 37, 80);
  check_cached<float>(t, 37, 131, 81);
  check_cached<double>(t, 131, 37, 82);
  check_cached<double>(t, 37, 131, 83);
  check_block_keep(t, 3, 1, 1, 90);
  check_block_keep(t, 2, 1, 0, 91);
  check_block_keep(t, 3, 0, 0, 92);
}

}  // namespace

int main() {
  Tally t;
  run_all(t);
  std::printf("%d passed, %d failed\n", t.passed, t.failed);
  return t.failed ? 1 : 0;
}

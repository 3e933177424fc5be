// flashot CPU kernels: fused streamed softmin / plan product for point clouds.
//
// Plain C++17 with GCC/Clang vector extensions (512-bit vectors, lowered to
// AVX-512 / AVX2 / SSE / NEON by -march, default native; FLASHOT_CPU_MARCH picks another),
// a thread team over row blocks (parallel.h: dynamic tasks, passive waiting), exported
// with a C ABI and called through ctypes (no torch headers).  Every exported function and
// every parallel region runs with flush-to-zero / denormals-are-zero set and the thread's
// previous state restored after (fpenv.h).
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
//
// Base 2 throughout: every exponent in these kernels is a base-2 logarithm
// (callers pass h * log2(e) and scale * log2(e) / eps), so the exponential is
// exp2, whose range reduction a = n + r (n = round(a), |r| <= 1/2) is one
// rounding and one exact subtraction: two fewer multiply-adds per exponential
// than e^a = 2^n e^r with r = a - n ln2, and no reduction error.
// exp2: polynomial for 2^r (float: our degree-5 fit for e^r re-expressed in r
// ln2, 1.85e-7 relative; double: Taylor degree 12 of e^(r ln2), 4.4e-16), times
// 2^n (vscalefps with AVX-512, exponent bits otherwise).  Arguments must be
// <= 126 / 1000 (every caller passes s - m <= TH).  float with AVX-512: lanes below
// -150 give exactly 0, lanes in [-150, -126) are flushed to 0 by FTZ.  Otherwise arguments are
// clamped to [-127, 128] / [-1023, 1024]: lanes below -126.5 / -1022.5 (including -inf) give
// exactly 0, the next half unit a denormal flushed by FTZ, branch-free.
// Either way no denormal reaches memory or a later operation (no slow path on Intel).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>
#include "fpenv.h"
#include "parallel.h"
#include "prune.h"
#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

// Vector width: the widest the target has natively (AVX-512: 64 bytes, AVX / AVX2: 32, SSE2,
// NEON and anything else: 16).  Wider vectors than the target's registers (e.g. 512-bit
// vectors on AVX2, split by the compiler) spill and ran 9-23x slower.  The register count picks
// the micro-kernel shapes (struct Shape).
#if defined(__AVX512F__)
#define FL_VBYTES 64
#elif defined(__AVX__)
#define FL_VBYTES 32
#else
#define FL_VBYTES 16
#endif
#if defined(__AVX512F__) || defined(__aarch64__)
#define FL_NREGS 32
#else
#define FL_NREGS 16
#endif

namespace {

template <typename T> struct VT;
template <> struct VT<float> {
  typedef float v __attribute__((vector_size(FL_VBYTES)));
  typedef int32_t vi __attribute__((vector_size(FL_VBYTES)));
  static constexpr int L = FL_VBYTES / 4;
};
template <> struct VT<double> {
  typedef double v __attribute__((vector_size(FL_VBYTES)));
  typedef int64_t vi __attribute__((vector_size(FL_VBYTES)));
  static constexpr int L = FL_VBYTES / 8;
};

// Micro-kernel shapes: R rows x NV vectors of columns per register block (accumulators R NV,
// running sums R, column vectors NV must fit the register file).  32 registers: measured on
// Zen 4 (benchmarks/CPU_ENGINE.md); 16 registers (AVX2, SSE): see CPU_ENGINE.md, ISA section.
// (Tuning: -DFL_SMALL_R=.., -DFL_BIG_R=.., -DFL_BIG_NV=.. override them.)
#ifndef FL_SMALL_R
#define FL_SMALL_R (FL_NREGS >= 32 ? 12 : 8)
#endif
#ifndef FL_BIG_R
#define FL_BIG_R (FL_NREGS >= 32 ? 4 : 2)
#endif
#ifndef FL_BIG_NV
#define FL_BIG_NV 4
#endif
#ifndef FL_MID_R
#define FL_MID_R (FL_NREGS >= 32 ? 4 : 2)
#endif
#ifndef FL_MID_NV
#define FL_MID_NV (FL_NREGS >= 32 ? 2 : 4)
#endif
// Block-sparse pair kernels: panels of FL_TILE_MULT micro-kernels' rows, the height of the sub-tile pruning's
// tiles (x 64 columns; 64 rows for the AVX2 pair kernel, 96 with AVX-512).  8 evaluated 0.94-0.96x the pairs
// of 16 and ran 0.95-0.99x the time at 3 x 10^6 points (multiscale, x86-64-v3 build on a Zen 4; BENCHMARKS.md).
#ifndef FL_TILE_MULT
#define FL_TILE_MULT 8
#endif
struct Shape {
  static constexpr int SMALL_R = FL_SMALL_R;  // d <= 3 (NV = 1)
  static constexpr int MID_R = FL_MID_R, MID_NV = FL_MID_NV;  // 4 <= d <= 32
  static constexpr int BIG_R = FL_BIG_R, BIG_NV = FL_BIG_NV;  // d > 32
  // plan times a narrow V (K <= 4).  16 registers: 8 rows (their accumulators spill) beat 2 (what fits)
  // by ~12-15%, presumably by keeping more independent exponentials in flight (not profiled); 2 / 3 / 4 /
  // 6 / 8 measured on an Intel Xeon built for AVX2 (BENCHMARKS.md, multiscale).  32 registers: 4 beat 8
  // by ~5% (same machine, AVX-512).
  static constexpr int PV_R = FL_NREGS >= 32 ? 4 : 8;
  static constexpr int MG_R = FL_NREGS >= 32 ? 4 : 2;      // plan times a wide V: rows per GEMM block
};

template <typename V> static inline V vload(const void* p) { V r; std::memcpy(&r, p, sizeof(V)); return r; }
template <typename V> static inline void vstore(void* p, V x) { std::memcpy(p, &x, sizeof(V)); }
template <typename V, typename S> static inline V vset(S s) { V r = {}; return r + s; }

// min(max(a, lo), hi) lane-wise, a NaN lane stays NaN: one min and one max instruction (the portable
// a > hi ? hi : a compiles to a compare and a blend on x86 for the NaN case: four instructions).
template <typename V> static inline V vclamp(V a, V lo, V hi) {
#if FL_VBYTES == 32
  if constexpr (sizeof(a[0]) == 4)  // (max / min return their second operand where either is NaN)
    return (V)_mm256_min_ps((__m256)hi, _mm256_max_ps((__m256)lo, (__m256)a));
  else
    return (V)_mm256_min_pd((__m256d)hi, _mm256_max_pd((__m256d)lo, (__m256d)a));
#elif FL_VBYTES == 16 && defined(__SSE2__)
  if constexpr (sizeof(a[0]) == 4)
    return (V)_mm_min_ps((__m128)hi, _mm_max_ps((__m128)lo, (__m128)a));
  else
    return (V)_mm_min_pd((__m128d)hi, _mm_max_pd((__m128d)lo, (__m128d)a));
#elif defined(__aarch64__)  // (fmax / fmin return NaN where either is NaN)
  if constexpr (sizeof(a[0]) == 4)
    return (V)vminq_f32((float32x4_t)hi, vmaxq_f32((float32x4_t)lo, (float32x4_t)a));
  else
    return (V)vminq_f64((float64x2_t)hi, vmaxq_f64((float64x2_t)lo, (float64x2_t)a));
#else
  a = a < lo ? lo : a;
  return a > hi ? hi : a;
#endif
}

// float: 2^a = 2^n 2^r, n = round(a), r = a - n (exact, |r| <= 1/2); degree-5 polynomial
// for 2^r (our Lawson-weighted least-squares fit of e^t on |t| <= ln2/2, coefficients
// times ln2^k; float32 Horner: max rel. error 1.85e-7), times 2^n by vscalefps: 8 vector
// ops, no compare, no mask.  Arguments must not be -inf or NaN (r would be NaN): the
// kernels encode zero weights as the finite ZERO_W = -1e38, for which r = 0 and the
// result is exactly 0.  Lanes below -150 give exactly 0, lanes in [-150, -126) would give
// denormals but are flushed to 0 (FTZ, set by FpScope in every thread that runs a kernel:
// see fpenv.h; such terms cannot matter next to a leading term >= 2^-30).
// Without AVX-512: exponent bits built by hand from arguments clamped to [-127, 128] (a min and
// a max, no compare or mask): -127 has exponent field 0, so lanes below -126.5 (-inf included)
// give exactly 0 and lanes in [-126.5, -126) a denormal that FTZ flushes, as above; 128 has the
// field of +inf, so an overflow gives +inf as vscalefps does (the fused pair kernels detect
// overflowed sums by it).  12 vector ops (14 with the earlier mask and separate bias add).
// AVX2 (FL_EXP_TABLE): 2^a = 2^n 2^(j/8) 2^r with 8n + j = round(8a), |r| <= 1/16: 2^(j/8) from an
// 8-entry table (one vpermps), 2^r by a cubic (our Lawson fit, p(0) = 1; 2.5e-8), 3 multiply-adds
// instead of 5, 1.6e-7 relative in float32 (the table's rounding included).  Same clamp, zeros and
// +inf: t = a + 1.5 * 2^20 has ulp 1/8, so its low bits hold 8n + j (two's complement); t << 20 puts
// n in the exponent field and j at bits 20-22, which the table's entries have subtracted, so the
// integer sum is the float 2^n 2^(j/8) (exponent field 0 for n = -127: 0 or a denormal, flushed;
// +inf for a = 128, where j = 0).
// G vectors at once, each step over all G before the next: x86 GCC emits instructions in source
// order, and one exponential's dependency chain (~40 cycles with the score before it) left the
// out-of-order window short of independent work (with the AVX2 table: the pair panels 0.80-0.85x the
// time, benchmarks/panel_bench.cpp; 0.60-0.80x with SSE4.2).
#if FL_VBYTES == 32 && defined(__AVX2__) && !defined(__AVX512F__)
#define FL_EXP_TABLE 1
#else
#define FL_EXP_TABLE 0
#endif
template <int G> static inline void vexp2_n(VT<float>::v (&a)[G]) {
  typedef VT<float>::v v;
  typedef VT<float>::vi vi;
  v n[G], r[G], p[G];
#if defined(__AVX512F__)
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) n[g] = (v)_mm512_roundscale_ps((__m512)a[g], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  // t = a + C rounds a to nearest (to 1/8 with the table) and holds the rounded value's low bits in its
  // mantissa: n + 127 without the table (C = 1.5 * 2^23 + 127), 8n + j with it (C = 1.5 * 2^20)
  constexpr float C = FL_EXP_TABLE ? 1572864.0f : 12583039.0f;
  v t[G];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) a[g] = vclamp(a[g], vset<v>(-127.0f), vset<v>(128.0f));
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) t[g] = a[g] + C;
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) n[g] = t[g] - C;
#endif
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) r[g] = a[g] - n[g];  // exact
#if FL_EXP_TABLE
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) p[g] = r[g] * 0.0554962158203125f + 0.2402576208114624f;
#else
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) p[g] = r[g] * 0.0013300195569172502f + 0.009669759310781956f;
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) p[g] = p[g] * r[g] + 0.055505603551864624f;
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) p[g] = p[g] * r[g] + 0.24022281169891357f;
#endif
  constexpr float C1 = FL_EXP_TABLE ? 0.6931472420692444f : 0.6931471824645996f;
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) p[g] = p[g] * r[g] + C1;
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) p[g] = p[g] * r[g] + 1.0f;
#if defined(__AVX512F__)
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) a[g] = (v)_mm512_scalef_ps((__m512)p[g], (__m512)n[g]);
#elif FL_EXP_TABLE
  const v tab = {0x1p+0f, 0x1.172b84p+0f, 0x1.306fep+0f, 0x1.4bfdaep+0f,  // 2^(j/8) rounded, j = 0..7
                 0x1.6a09e6p+0f, 0x1.8ace54p+0f, 0x1.ae89fap+0f, 0x1.d5818ep+0f};
  const vi tabj = (vi)tab - vi{0, 1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20, 6 << 20, 7 << 20};
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)  // vpermps reads t's low 3 bits: j
    a[g] = p[g] * (v)(((vi)t[g] << 20) + (vi)_mm256_permutevar8x32_ps((__m256)tabj, (__m256i)t[g]));
#else
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) a[g] = p[g] * (v)((vi)t[g] << 23);  // 2^n: 0 for n = -127 (a < -126.5), +inf for 128
#endif
}
static inline VT<float>::v vexp2(VT<float>::v a) {
  VT<float>::v b[1] = {a};
  vexp2_n<1>(b);
  return b[0];
}

// double: 2^a, a = n + r; Taylor polynomial of degree 12 for e^(r ln2) (4.4e-16 on |r| <= 1/2).  G vectors at
// once, step by step as for float (vexp2_n above).
template <int G> static inline void vexp2_n(VT<double>::v (&a)[G]) {
  typedef VT<double>::v v;
  static constexpr double C[13] = {2.5678435993488196e-11, 4.44553827187081e-10, 7.054911620801121e-09,
                                   1.0178086009239696e-07, 1.3215486790144305e-06, 1.5252733804059838e-05,
                                   0.00015403530393381606, 0.0013333558146428441, 0.009618129107628477,
                                   0.055504108664821576,   0.2402265069591007,     0.6931471805599453,
                                   1.0};
  v n[G], r[G], p[G];
#if defined(__AVX512F__)
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) n[g] = (v)_mm512_roundscale_pd((__m512d)a[g], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  v t[G];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) {  // as for float: biased exponent in [0, 2047]
    a[g] = vclamp(a[g], vset<v>(-1023.0), vset<v>(1024.0));
    t[g] = a[g] + 6755399441056767.0;  // 1.5 * 2^52 + 1023
    n[g] = t[g] - 6755399441056767.0;
  }
#endif
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) {
    r[g] = a[g] - n[g];
    p[g] = r[g] * C[0] + C[1];
  }
#pragma GCC unroll 11
  for (int i = 2; i < 13; ++i)
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) p[g] = p[g] * r[g] + C[i];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) {
#if defined(__AVX512F__)
    __mmask8 keep = _mm512_cmp_pd_mask((__m512d)a[g], _mm512_set1_pd(-1009.0), _CMP_NLT_UQ);
    a[g] = (v)_mm512_maskz_scalef_pd(keep, (__m512d)p[g], (__m512d)n[g]);
#else
    typedef VT<double>::vi vi;
    a[g] = p[g] * (v)((vi)t[g] << 52);  // 0 for n = -1023, +inf for n = 1024
#endif
  }
}
static inline VT<double>::v vexp2(VT<double>::v a) {
  VT<double>::v b[1] = {a};
  vexp2_n<1>(b);
  return b[0];
}

static inline VT<float>::v vsqrt(VT<float>::v a) {
  typedef VT<float>::v v;
#if FL_VBYTES == 64
  return (v)_mm512_sqrt_ps((__m512)a);
#elif FL_VBYTES == 32
  return (v)_mm256_sqrt_ps((__m256)a);
#elif defined(__SSE2__)
  return (v)_mm_sqrt_ps((__m128)a);
#elif defined(__aarch64__)
  return (v)vsqrtq_f32((float32x4_t)a);
#else
  v r; for (int l = 0; l < VT<float>::L; ++l) r[l] = std::sqrt(a[l]); return r;
#endif
}
static inline VT<double>::v vsqrt(VT<double>::v a) {
  typedef VT<double>::v v;
#if FL_VBYTES == 64
  return (v)_mm512_sqrt_pd((__m512d)a);
#elif FL_VBYTES == 32
  return (v)_mm256_sqrt_pd((__m256d)a);
#elif defined(__SSE2__)
  return (v)_mm_sqrt_pd((__m128d)a);
#elif defined(__aarch64__)
  return (v)vsqrtq_f64((float64x2_t)a);
#else
  v r; for (int l = 0; l < VT<double>::L; ++l) r[l] = std::sqrt(a[l]); return r;
#endif
}

// Is any lane of a greater than the same lane of b?  (One compare and one mask test.)
static inline bool any_gt(VT<float>::v a, VT<float>::v b) {
#if FL_VBYTES == 64
  return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_GT_OQ) != 0;
#elif FL_VBYTES == 32
  return _mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)b, _CMP_GT_OQ)) != 0;
#elif defined(__SSE2__)
  return _mm_movemask_ps(_mm_cmpgt_ps((__m128)a, (__m128)b)) != 0;
#elif defined(__aarch64__)
  return vmaxvq_u32(vcgtq_f32((float32x4_t)a, (float32x4_t)b)) != 0;
#else
  bool r = false; for (int l = 0; l < VT<float>::L; ++l) r |= a[l] > b[l]; return r;
#endif
}
static inline bool any_gt(VT<double>::v a, VT<double>::v b) {
#if FL_VBYTES == 64
  return _mm512_cmp_pd_mask((__m512d)a, (__m512d)b, _CMP_GT_OQ) != 0;
#elif FL_VBYTES == 32
  return _mm256_movemask_pd(_mm256_cmp_pd((__m256d)a, (__m256d)b, _CMP_GT_OQ)) != 0;
#elif defined(__SSE2__)
  return _mm_movemask_pd(_mm_cmpgt_pd((__m128d)a, (__m128d)b)) != 0;
#elif defined(__aarch64__)
  return vmaxvq_u32(vreinterpretq_u32_u64(vcgtq_f64((float64x2_t)a, (float64x2_t)b))) != 0;
#else
  bool r = false; for (int l = 0; l < VT<double>::L; ++l) r |= a[l] > b[l]; return r;
#endif
}

template <typename V> static inline auto hmax(V a) {
  auto m = a[0];
  for (int l = 1; l < (int)(sizeof(V) / sizeof(m)); ++l) m = a[l] > m ? a[l] : m;
  return m;
}
template <typename V> static inline auto hsum(V a) {
  auto s = a[0];
  for (int l = 1; l < (int)(sizeof(V) / sizeof(s)); ++l) s += a[l];
  return s;
}

template <typename T> struct Consts;
template <> struct Consts<float> { static constexpr float TH = 60.0f, H = 30.0f, SENT = -1e30f, LO = -124.0f; };
template <> struct Consts<double> { static constexpr double TH = 200.0, H = 100.0, SENT = -1e300, LO = -1009.0; };

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

// One panel of R rows (x: R consecutive rows, row stride D) over columns [j0, j1).
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
template <typename T, int R, int NV, int KIND, int DS, int MODE, int WK, bool CK = true>
static inline void panel(const T* __restrict x, const T* __restrict yT, const T* __restrict yy,
                         const T* __restrict hs, int64_t j0, int64_t j1, const Args& a,
                         T* __restrict m, typename VT<T>::v* __restrict sum, T* __restrict P, int64_t ldp) {
  typedef typename VT<T>::v v;
  constexpr int L = VT<T>::L;
  const int D = DS > 0 ? DS : a.D;
  const int64_t Mp = a.Mp;
  const T k = (T)a.kcoef;
  const v minsq = vset<v>((T)a.minsq);
  const v wthr = vset<v>((T)(a.minsq > 0 ? 1.001 * std::sqrt(a.minsq) : 0.0));
  const v zero = {};
  T xx[R];
  v sm[R];
  T mr[R];
  constexpr bool BARY = MODE == MODE_PAIRB || MODE == MODE_PAIRBC;
  constexpr int DB = DS > 0 ? DS : 1;  // MODE_PAIRB(C): coordinates per point (static)
  constexpr int SV = 1 + DB;           // and sum vectors per row
  v pa[MODE == MODE_PV ? R : 1][PV_K];
  v pb[BARY ? R : 1][DB];
  if (BARY)
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < DB; ++d) pb[r][d] = sum[r * SV + 1 + d];
  if (MODE == MODE_PV)
    for (int r = 0; r < R; ++r)
      for (int kk = 0; kk < PV_K; ++kk) pa[r][kk] = sum[r * (PV_K + 1) + kk];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    T s = 0;
    if (KIND == KIND_DOT) for (int d = 0; d < D; ++d) s += x[r * D + d] * x[r * D + d];
    xx[r] = s;
    mr[r] = m[r];
    if (MODE == MODE_LSE || MODE == MODE_PAIR) sm[r] = sum[r];
    if (MODE == MODE_P) sm[r] = sum ? sum[r] : zero;
    if (MODE == MODE_PV) sm[r] = sum[r * (PV_K + 1) + PV_K];
    if (BARY) sm[r] = sum[r * SV];
  }
  for (int64_t j = j0; j < j1; j += L * NV) {
    // dot costs: acc ends as |x|^2 + |y|^2 - 2<x, y> (the explicit cost, formed before
    // 1/eps).  For d <= 3 acc starts at |x_r|^2 + |y_j|^2 (no extra add in the exp-bound
    // kernels); for larger d it accumulates -2<x, y> from zero and the norms come last:
    // starting at the norms puts each of the d roundings at the scale |x|^2 + |y|^2
    // instead of that of the partial dot products (measured at d = 64, float32: softmin
    // error 8.5e-5 -> 3.7e-5, barycentres 3.4x closer to float64; neutral at d <= 3).
    const bool norms_first = KIND == KIND_DOT && (DS > 0 || D <= 3);
    v acc[R][NV];
#pragma GCC unroll 8
    for (int q = 0; q < NV; ++q) {
      v init = zero;
      if (norms_first) init = vload<v>(yy + j + q * L);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][q] = norms_first ? init + xx[r] : zero;
    }
    const T* yp = yT + j;
#pragma GCC unroll 4
    for (int d = 0; d < D; ++d) {
      v yv[NV];
#pragma GCC unroll 8
      for (int q = 0; q < NV; ++q) yv[q] = vload<v>(yp + (int64_t)d * Mp + q * L);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const T xs = KIND == KIND_DOT ? (T)-2 * x[r * D + d] : x[r * D + d];
#pragma GCC unroll 8
        for (int q = 0; q < NV; ++q) {
          if (KIND == KIND_DOT) {
            acc[r][q] += xs * yv[q];
          } else {
            v df = yv[q] - xs;
            acc[r][q] += df * df;
          }
        }
      }
    }
    if (KIND == KIND_DOT && !norms_first) {
#pragma GCC unroll 8
      for (int q = 0; q < NV; ++q) {
        const v yq = vload<v>(yy + j + q * L);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[r][q] += yq + xx[r];
      }
    }
    if (MODE == MODE_PV) {
      // plan times a narrow V (K <= 4): vectorised over 16 columns, K FMAs per 16 pairs
      // (the general path broadcasts one weight per pair over the K lanes of V)
#pragma GCC unroll 8
      for (int q = 0; q < NV; ++q) {
        const v hq = vload<v>(hs + j + q * L);
        v vk[PV_K];
#pragma GCC unroll 4
        for (int kk = 0; kk < PV_K; ++kk) vk[kk] = kk < a.K ? vload<v>(P + (int64_t)kk * Mp + j + q * L) : zero;
        // the exponentials of G rows at a time interleaved (vexp2_n): all R rows for double (0.72-0.74x with
        // AVX2); one by one for float, where interleaving them cost ~5% (the K accumulators a row spill)
        constexpr int G = sizeof(T) == 8 ? R : 1;
#pragma GCC unroll 16
        for (int r0 = 0; r0 < R; r0 += G) {
          v e[G];
#pragma GCC unroll 16
          for (int g = 0; g < G; ++g) {
            v c = acc[r0 + g][q];
            if (KIND == KIND_DOT) {
              c = c < zero ? zero : c;  // c is a weight here
            } else {
              c = c < minsq ? minsq : c;
              c = vsqrt(c);
            }
            acc[r0 + g][q] = c;
            e[g] = (hq - mr[r0 + g]) - c * k;
          }
          vexp2_n<G>(e);
#pragma GCC unroll 16
          for (int g = 0; g < G; ++g) {
            const int r = r0 + g;
            const v c = acc[r][q];
            v p = e[g];
            sm[r] += p;
            if (WK == W_COST) p *= c;
            if (WK == W_INV) p = c > wthr ? p / c : zero;
#pragma GCC unroll 4
            for (int kk = 0; kk < PV_K; ++kk) pa[r][kk] += p * vk[kk];
          }
        }
      }
      continue;
    }
    if (MODE == MODE_PAIR || BARY) {
      // one exponential per pair feeds both the row and the column sum (no max: the caller checks the sums
      // and recomputes rows / columns that under- or overflowed); MODE_PAIRB(C) also weight the other side's
      // coordinates with it (DS FMAs per side)
      constexpr int NB = BARY ? DB : 0;
#pragma GCC unroll 8
      for (int q = 0; q < NV; ++q) {
        const v hq = vload<v>(hs + j + q * L);
        v yq[DB], colc[DB];
#pragma GCC unroll 4
        for (int d = 0; d < NB; ++d) {
          yq[d] = vload<v>(yT + (int64_t)d * Mp + j + q * L);
          colc[d] = zero;
        }
        v colv = zero;
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          v c = acc[r][q];
          if (KIND == KIND_DIRECT) {
            c = c < minsq ? minsq : c;
            c = vsqrt(c);
          }
          const v e = vexp2((hq + mr[r]) - c * k);
          sm[r] += e;
#pragma GCC unroll 4
          for (int d = 0; d < NB; ++d) pb[r][d] += e * yq[d];
          colv += e;
          if (MODE == MODE_PAIRBC)
#pragma GCC unroll 4
            for (int d = 0; d < NB; ++d) colc[d] += e * x[r * DB + d];
        }
        vstore(P + j + q * L, vload<v>(P + j + q * L) + colv);
        if (MODE == MODE_PAIRBC) {
#pragma GCC unroll 4
          for (int d = 0; d < NB; ++d) {
            T* pc = P + (int64_t)(1 + d) * Mp + j + q * L;
            vstore(pc, vload<v>(pc) + colc[d]);
          }
        }
      }
      continue;
    }
    if (MODE == MODE_LSE) {
      // s - m for the whole R x NV block first, then ONE check of its maximum
      // against TH (one compare and one mask test per block instead of per
      // vector: 13% of the d = 3 kernel's time), then the exponentials.
      v am[R][NV];
      v mx = vset<v>(Consts<T>::SENT);  // unused (optimised away) when !CK
#pragma GCC unroll 8
      for (int q = 0; q < NV; ++q) {
        const v hq = vload<v>(hs + j + q * L);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          // dot costs: a rounding-level negative c changes s by k * O(ulp(|x|^2)),
          // like the rounding itself, so no clamp in the exponent
          if (KIND == KIND_DIRECT) {
            v c = acc[r][q];
            c = c < minsq ? minsq : c;
            acc[r][q] = vsqrt(c);
          }
          am[r][q] = (hq - mr[r]) - acc[r][q] * k;  // s - m: one sub + one fnmadd
          if (CK) mx = am[r][q] > mx ? am[r][q] : mx;
        }
      }
      if (P) {  // fused alternating step: keep the costs for the column pass (alt_impl)
#pragma GCC unroll 8
        for (int q = 0; q < NV; ++q)
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) vstore(P + r * ldp + (j - j0) + q * L, acc[r][q]);
      }
      if (CK && __builtin_expect(any_gt(mx, vset<v>(Consts<T>::TH)), 0)) {
        // rare (O(log M) times per row): raise the running max of the rows that
        // need it, from the absolute scores s = h - k c (m may still be the sentinel).  Then
        // s - m is recomputed as (h - m) - k c (more accurate: h - m is exact for h near m),
        // unless that disagrees with the maximum by more than rounding: when h and k c are so
        // large that their ulp exceeds the headroom (float32 with |h| ~ 1e9, e.g. eps ~ 1e-10),
        // it could exceed TH (exp2 overflow: inf, then NaN) or fall far below (every term 0,
        // +inf out) where dense is finite; the row then uses s - m from the same s as the max.
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          v sc[NV];
          T nm = Consts<T>::SENT;
          for (int q = 0; q < NV; ++q) {
            sc[q] = vload<v>(hs + j + q * L) - acc[r][q] * k;
            nm = std::max(nm, hmax(sc[q]));
          }
          if (nm > mr[r] + Consts<T>::TH) {
            sm[r] *= (T)std::exp2(mr[r] - (nm + Consts<T>::H));
            mr[r] = nm + Consts<T>::H;
          }
          T amax = Consts<T>::SENT;
          for (int q = 0; q < NV; ++q) {
            am[r][q] = (vload<v>(hs + j + q * L) - mr[r]) - acc[r][q] * k;
            amax = std::max(amax, hmax(am[r][q]));
          }
          if (!(amax <= Consts<T>::TH && amax >= (nm - mr[r]) - 1))
            for (int q = 0; q < NV; ++q) am[r][q] = sc[q] - mr[r];
        }
      }
#pragma GCC unroll 8
      for (int q = 0; q < NV; ++q) {
        v e[R];  // the rows' exponentials interleaved (vexp2_n; float64 AVX2 softmin at d = 3: 0.71x)
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) e[r] = am[r][q];
        vexp2_n<R>(e);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) sm[r] += e[r];
      }
      continue;
    }
#pragma GCC unroll 8
    for (int q = 0; q < NV; ++q) {
      const v hq = vload<v>(hs + j + q * L);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        v c;
        if (KIND == KIND_DOT) {
          c = acc[r][q];
          c = c < zero ? zero : c;  // c is a weight here
        } else {
          c = acc[r][q];
          c = c < minsq ? minsq : c;
          c = vsqrt(c);
        }
        v s = hq - c * k;
        v p = vexp2(s - mr[r]);
        sm[r] += p;
        if (WK == W_COST) p *= c;
        // dcost of |x - y|: 1/C, zero where C = 0 or where the clamp sqrt(minsq)
        // is active (the clamp kills the gradient; 1.001 absorbs float rounding)
        if (WK == W_INV) p = c > wthr ? p / c : zero;
        vstore(P + r * ldp + (j - j0) + q * L, p);
      }
    }
  }
  if (MODE == MODE_LSE || MODE == MODE_PAIR) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) { m[r] = mr[r]; sum[r] = sm[r]; }
  }
  if (MODE == MODE_P && sum)
    for (int r = 0; r < R; ++r) sum[r] = sm[r];
  if (BARY)
    for (int r = 0; r < R; ++r) {
      sum[r * SV] = sm[r];
      for (int d = 0; d < DB; ++d) sum[r * SV + 1 + d] = pb[r][d];
    }
  if (MODE == MODE_PV)
    for (int r = 0; r < R; ++r) {
      for (int kk = 0; kk < PV_K; ++kk) sum[r * (PV_K + 1) + kk] = pa[r][kk];
      sum[r * (PV_K + 1) + PV_K] = sm[r];
    }
}

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

// Column-wise (the transposed problem): out[b,j] = oscale * LSE_i (h_i - C_ij / eps)
template <typename T>
static void cols_lse(const T* C, const T* h, T* out, int B, int64_t N, int64_t M, T inv_eps, T oscale, int nth) {
  typedef typename VT<T>::v v;
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
      const int64_t nv = w / L;
      std::vector<v> mvec(nv + 1), svec(nv + 1);
      v* __restrict mv = mvec.data();
      v* __restrict sv = svec.data();
      T ms[16], ss[16];
      for (int64_t q = 0; q < nv; ++q) { mv[q] = vset<v>(Consts<T>::SENT); sv[q] = v{}; }
      for (int64_t q = nv * L; q < w; ++q) { ms[q - nv * L] = Consts<T>::SENT; ss[q - nv * L] = 0; }
      const T* hb = h + b * N;
      int64_t i = 0;
      for (; i + 2 <= N; i += 2) {  // two rows per sweep: half the state traffic
        const T* c0 = C + (b * N + i) * M + j0;
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
          const int64_t u = q - nv * L;
          for (int k = 0; k < 2; ++k) {
            T a = (k ? h1 : h0) - (k ? c1 : c0)[q] * inv_eps;
            if (a > ms[u] + Consts<T>::TH) { ss[u] *= std::exp2(ms[u] - (a + Consts<T>::H)); ms[u] = a + Consts<T>::H; }
            if (a - ms[u] > Consts<T>::LO) ss[u] += std::exp2(a - ms[u]);
          }
        }
      }
      for (; i < N; ++i) {
        const T* c = C + (b * N + i) * M + j0;
        const T hi = hb[i];
        for (int64_t q = 0; q < nv; ++q) {
          v a = hi - vload<v>(c + q * L) * inv_eps;
          v thr = mv[q] + Consts<T>::TH;
          if (__builtin_expect(any_gt(a, thr), 0)) {
            v up = a + Consts<T>::H;
            v nm = up > mv[q] ? up : mv[q];
            sv[q] *= vexp2(mv[q] - nm);
            mv[q] = nm;
          }
          sv[q] += vexp2(a - mv[q]);
        }
        for (int64_t q = nv * L; q < w; ++q) {
          const int64_t u = q - nv * L;
          T a = hi - c[q] * inv_eps;
          if (a > ms[u] + Consts<T>::TH) { ss[u] *= std::exp2(ms[u] - (a + Consts<T>::H)); ms[u] = a + Consts<T>::H; }
          if (a - ms[u] > Consts<T>::LO) ss[u] += std::exp2(a - ms[u]);
        }
      }
      const T ninf = -std::numeric_limits<T>::infinity();
      for (int64_t q = 0; q < nv; ++q)
        for (int l = 0; l < L; ++l) {
          T mm = mv[q][l];
          out[b * M + j0 + q * L + l] = oscale * (mm == Consts<T>::SENT ? ninf : mm + std::log2(sv[q][l]));
        }
      for (int64_t q = nv * L; q < w; ++q) {
        const int64_t u = q - nv * L;
        out[b * M + j0 + q] = oscale * (ms[u] == Consts<T>::SENT ? ninf : ms[u] + std::log2(ss[u]));
      }
    }
  });
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
    for (int r = 0; r < nr; ++r) {
      const T sc = w[r] - P[(int64_t)r * ldp + j] * k;
      if (sc > cm[j] + Consts<T>::TH) { cs[j] *= std::exp2(cm[j] - (sc + Consts<T>::H)); cm[j] = sc + Consts<T>::H; }
      if (sc - cm[j] > Consts<T>::LO) cs[j] += std::exp2(sc - cm[j]);
    }
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

// Block-sparse symmetric step (pair_impl over softmin_bs_impl's kept ranges, B = 1): rsum[i] = sum_j E_ij
// over row i's kept columns and csum[j] (padded layout) = sum_i E_ij, E_ij = 2^(hx_i + hs_j - k c_ij), one
// exponential per pair.  Column partials per group of row clusters (cluster t -> group t % G), combined in
// group order: the same bits for any thread count.  sym (y is x with the same clusters, a symmetric pattern,
// coff (Kx + 1,) the clusters' padded column offsets): cluster k sums its own block for its rows only and
// the kept columns right of it for rows and columns, skipping those left of it; the caller adds rsum + csum.
// Barycentres (MODE_PAIRB / MODE_PAIRBC, static D = DS): rb[i * DS + d] = sum_j E_ij y_jd and, with
// MODE_PAIRBC, csum[(1 + d) Mp + j] = sum_i E_ij x_id after csum's first Mp values (the solver's gradient
// is then sum_j P_ij (x_i - y_j) = x_i - rb_i / rsum_i per unit of row mass: no plan-product pass).
// tb.fx: sub-tile pruning (TileBounds); the pairs evaluated (padded columns included) are added to *evaluated.
template <typename T, int R, int NV, int KIND, int DS, int MODE>
static void pair_bs_impl(const T* x, const T* yT, const T* yy, const T* hs, const T* hx, T* rsum, T* csum, T* rb,
                         int64_t Mp, const int64_t* tasks, int64_t ntasks, const int64_t* cptr, const int64_t* cr,
                         const int64_t* coff, const Args& a, const TileBounds<T>& tb, int64_t* evaluated, bool sym,
                         int nth) {
  typedef typename VT<T>::v v;
  const int D = a.D;
  constexpr int RB = R * FL_TILE_MULT;  // rows per panel: the tiles' height
  constexpr int SV = MODE == MODE_PAIR ? 1 : 1 + DS;  // sum vectors per row
  const int64_t per = (MODE == MODE_PAIRBC ? 1 + DS : 1) * Mp;
  const int64_t G = col_groups(ntasks, per * (int64_t)sizeof(T));
  const bool tiles = tb.fx != nullptr && D <= 3;
  // dot costs at a static d <= 3: the folded panels (panel_local), in a frame centred on each row panel
  constexpr bool LOCAL = KIND == KIND_DOT && DS > 0 && NV == 1;
  constexpr int DL = DS > 0 ? DS : 1;
  const T kc = (T)a.kcoef;
  std::atomic<int64_t> count{0};
  // scratch: column sums of diagonal blocks, discarded
  col_group_pass<T>(G, (size_t)per, sym ? (size_t)per : 0, csum, nth, [&](int64_t g, T* cacc, T* scratch) {
    int64_t done = 0;
    double ball[TILE_STRIDE], ball_o[TILE_STRIDE];  // the panel's terms from fx and fxo (sub-tile pruning)
    T o[DL], u[LOCAL ? RB * DL : 1], A[LOCAL ? RB : 1];  // the row panel's origin and folded terms
    std::vector<T> zbuf;                                 // the folded columns' terms: z (DL rows), H
    for (int64_t t = g; t < ntasks; t += G) {
      const int64_t i1 = tasks[3 * t + 1], k = tasks[3 * t + 2];
      const int64_t d0 = sym ? coff[k] : 0, d1 = sym ? coff[k + 1] : 0;
      for (int64_t i0 = tasks[3 * t]; i0 < i1; i0 += RB) {
        const int nr = (int)std::min<int64_t>(RB, i1 - i0);
        T m[RB];
        v sum[RB * SV];
        for (int r = 0; r < nr; ++r) {
          m[r] = hx[i0 + r];
          for (int u = 0; u < SV; ++u) sum[r * SV + u] = v{};
        }
        const T* xb = x + i0 * D;
        if constexpr (LOCAL) local_rows<T, DL>(xb, m, nr, a.kcoef, o, u, A);
        // the panel's rows over columns [c0, c1)
        auto eval = [&](int64_t c0, int64_t c1, T* cols) {
          if constexpr (LOCAL) {
            const int64_t w = c1 - c0;
            if ((int64_t)zbuf.size() < (DL + 1) * w) zbuf.resize((size_t)((DL + 1) * w));
            local_cols<T, DL>(yT, hs, Mp, c0, c1, o, kc, zbuf.data(), w, zbuf.data() + DL * w);
            panel_local_rows<T, R, DL, MODE>(nr, xb, u, A, zbuf.data(), zbuf.data() + DL * w, w, c0, c0, c1, sum,
                                              cols, Mp);
          } else {
            panel_rows<T, R, NV, KIND, DS, MODE, W_ONE>(nr, xb, yT, yy, hs, c0, c1, a, m, sum, cols, 0);
          }
          done += (int64_t)nr * (c1 - c0);
        };
        if (tiles) {
          tile_terms(nr, D, [&](int i, int d) { return (double)xb[i * D + d]; },
                     [&](int i) { return (double)tb.fx[i0 + i]; }, a.kcoef, tb.linear, ball);
          tile_terms(nr, D, [&](int i, int d) { return (double)xb[i * D + d]; },
                     [&](int i) { return (double)tb.fxo[i0 + i]; }, a.kcoef, tb.linear, ball_o);
        }
        // columns [lo, hi) into cols: the kept chunks' runs when pruning tiles, else at once
        auto stream = [&](int64_t lo, int64_t hi, T* cols) {
          if (!tiles) {
            eval(lo, hi, cols);
            return;
          }
          int64_t run = -1;
          for (int64_t ch = lo / TILE_COLS; ch * TILE_COLS < hi; ++ch) {
            const int64_t c0 = std::max(lo, ch * TILE_COLS), c1 = std::min(hi, (ch + 1) * TILE_COLS);
            const bool keep = tile_kept<T, KIND>(tb, ball, ball_o, ch, D, a);
            if (keep && run < 0) run = c0;
            if (run >= 0 && (!keep || c1 == hi)) {
              eval(run, keep ? c1 : c0, cols);
              run = -1;
            }
          }
        };
        for (int64_t q = cptr[k]; q < cptr[k + 1]; ++q) {
          int64_t lo = cr[2 * q];
          const int64_t hi = cr[2 * q + 1];
          if (sym) {  // the diagonal block for the rows only; nothing left of it
            if (hi <= d0) continue;
            const int64_t dlo = std::max(lo, d0), dhi = std::min(hi, d1);
            if (dlo < dhi) stream(dlo, dhi, scratch);
            lo = std::max(lo, d1);
            if (lo >= hi) continue;
          }
          stream(lo, hi, cacc);
        }
        for (int r = 0; r < nr; ++r) {
          rsum[i0 + r] = hsum(sum[r * SV]);
          if (MODE != MODE_PAIR)  // folded: the numerators are about o
            for (int d = 0; d < DS; ++d)
              rb[(i0 + r) * DS + d] = hsum(sum[r * SV + 1 + d]) + (LOCAL ? o[d] * rsum[i0 + r] : (T)0);
        }
      }
    }
    count += done;
  });
  if (evaluated) *evaluated += count.load();
}

// sym is a run-time flag: it changes which column ranges a row panel visits, not the inner loop.
template <typename T, int KIND>
static int pair_bs_dispatch(const T* x, const T* yT, const T* yy, const T* hs, const T* hx, T* rs, T* cs, T* rb,
                            int cb, int64_t Mp, const int64_t* tasks, int64_t ntasks, const int64_t* cptr,
                            const int64_t* cr, const int64_t* coff, const Args& a, const TileBounds<T>& tb,
                            int64_t* evaluated, bool sym, int cfg, int nth) {
  if (rb == nullptr)
    return with_lse_shape(cfg, a.D, [&](auto s) {
      using S = decltype(s);
      pair_bs_impl<T, S::R, S::NV, KIND, S::DS, MODE_PAIR>(x, yT, yy, hs, hx, rs, cs, nullptr, Mp, tasks, ntasks,
                                                           cptr, cr, coff, a, tb, evaluated, sym, nth);
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
                                        evaluated, sym, nth)
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
                         int nth) {
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
                                 evaluated, sym != 0, cfg, nth)
  if (kind == KIND_DOT) FL_PAIR_BS(KIND_DOT);
  if (kind == KIND_DIRECT) FL_PAIR_BS(KIND_DIRECT);
#undef FL_PAIR_BS
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

}  // namespace

// The exported functions are split into parts, each compiled as its own translation unit
// (-DFLASHOT_PART=k; without the macro, or with 0, one unit holds everything), so that the build
// compiles them in parallel and builds each library only when it is first needed: parts 1-4 are the
// dense and streamed kernels (the `cpu` engine), parts 5-8 the block-sparse ones (multiscale).  Within
// a library the parts are balanced by compile time (build.py: LIBRARIES).
#ifndef FLASHOT_PART
#define FLASHOT_PART 0
#endif
#define FL_PART(k) (FLASHOT_PART == 0 || FLASHOT_PART == (k))

extern "C" {

#if FL_PART(1)
int flashot_abi_version() { return 19; }  // build.py: ABI_VERSION

// FTZ/DAZ probe (tests): flashot_fp_probe(1) clears the slots and makes every FpScope record its
// thread's bits (FTZ 1 | DAZ 2 | seen 4) while a kernel runs; flashot_fp_probe(0) stops recording
// (the slots are kept for flashot_fp_probe_read).
int flashot_fp_probe(int on) {
  if (on)
    for (int t = 0; t < flashot_fp::PROBE_SLOTS; ++t) flashot_fp::g_fp_probe[t].store(0);
  flashot_fp::g_fp_probe_on.store(on ? 1 : 0);
  return 0;
}

// Copies up to n slots (indexed by team index, 0 = the caller) to out; returns how many threads were seen.
int flashot_fp_probe_read(int* out, int n) {
  int seen = 0;
  for (int t = 0; t < flashot_fp::PROBE_SLOTS; ++t) {
    const int b = flashot_fp::g_fp_probe[t].load();
    if (t < n) out[t] = b;
    seen += (b & flashot_fp::SEEN) ? 1 : 0;
  }
  return seen;
}

// The kernels' vector width in bytes (64 AVX-512, 32 AVX/AVX2, 16 SSE/NEON): the engine pads to it.
int flashot_vector_bytes() { return FL_VBYTES; }

// The calling thread's FTZ (1) / DAZ (2) bits, read outside any kernel.
int flashot_fp_bits() { return flashot_fp::bits_of(flashot_fp::get_state()); }

// The FTZ / DAZ bits of each thread of a team of nth threads running WITHOUT an FpScope
// (what the workers carry between kernels); returns the team size (1 when the team is busy).
int flashot_fp_bits_workers(int* out, int nth) {
  for (int t = 0; t < nth; ++t) out[t] = -1;
  const int team = run_team(nth, [&](int tid) {
    if (tid < nth) out[tid] = flashot_fp::bits_of(flashot_fp::get_state());
  });
  return team;
}

// The instruction set the library was compiled for (bit mask): 1 SSE4.2, 2 AVX, 4 AVX2, 8 FMA,
// 16 AVX-512F, 32 AArch64 (NEON), 64 multi-threaded (always: parallel.h needs no OpenMP).
int flashot_isa() {
  int m = 0;
#if defined(__SSE4_2__)
  m |= 1;
#endif
#if defined(__AVX__)
  m |= 2;
#endif
#if defined(__AVX2__)
  m |= 4;
#endif
#if defined(__FMA__)
  m |= 8;
#endif
#if defined(__AVX512F__)
  m |= 16;
#endif
#if defined(__aarch64__)
  m |= 32;
#endif
  m |= 64;
  return m;
}
#endif

#if FL_PART(1)
int flashot_softmin_f32(const float* x, const float* yT, const float* yy, const float* hs, float* out, int B,
                        int64_t N, int64_t Mp, int D, double kcoef, double minsq, int kind, double oscale, int cfg,
                        int64_t l2, int nth) {
  return softmin_entry<float>(x, yT, yy, hs, out, B, N, Mp, D, kcoef, minsq, kind, oscale, cfg, l2, nth);
}
#endif

#if FL_PART(2)
int flashot_softmin_f64(const double* x, const double* yT, const double* yy, const double* hs, double* out, int B,
                        int64_t N, int64_t Mp, int D, double kcoef, double minsq, int kind, double oscale, int cfg,
                        int64_t l2, int nth) {
  return softmin_entry<double>(x, yT, yy, hs, out, B, N, Mp, D, kcoef, minsq, kind, oscale, cfg, l2, nth);
}
#endif

#if FL_PART(3)
int flashot_pair_f32(const float* x, const float* yT, const float* yy, const float* hs, const float* hx, float* rs,
                     float* cs, int B, int64_t N, int64_t Mp, int D, double kcoef, double minsq, int kind, int cfg,
                     int sym, int64_t l2, int nth) {
  return pair_entry<float>(x, yT, yy, hs, hx, rs, cs, B, N, Mp, D, kcoef, minsq, kind, cfg, sym, l2, nth);
}
#endif

#if FL_PART(4)
int flashot_pair_f64(const double* x, const double* yT, const double* yy, const double* hs, const double* hx,
                     double* rs, double* cs, int B, int64_t N, int64_t Mp, int D, double kcoef, double minsq, int kind,
                     int cfg, int sym, int64_t l2, int nth) {
  return pair_entry<double>(x, yT, yy, hs, hx, rs, cs, B, N, Mp, D, kcoef, minsq, kind, cfg, sym, l2, nth);
}
#endif

#if FL_PART(3)
int flashot_plan_f32(const float* x, const float* yT, const float* yy, const float* hs, const float* lse,
                     const float* alpha, const float* VTm, int K, float* out, float* mass, int single, int B,
                     int64_t N, int64_t Mp, int D, double kcoef, double minsq, int kind, int wk, double wconst,
                     int narrow, int64_t l2, int nth) {
  return plan_entry<float>(x, yT, yy, hs, lse, alpha, VTm, K, out, mass, single, B, N, Mp, D, kcoef, minsq, kind, wk,
                           wconst, narrow, l2, nth);
}
#endif

#if FL_PART(4)
int flashot_plan_f64(const double* x, const double* yT, const double* yy, const double* hs, const double* lse,
                     const double* alpha, const double* VTm, int K, double* out, double* mass, int single, int B,
                     int64_t N, int64_t Mp, int D, double kcoef, double minsq, int kind, int wk, double wconst,
                     int narrow, int64_t l2, int nth) {
  return plan_entry<double>(x, yT, yy, hs, lse, alpha, VTm, K, out, mass, single, B, N, Mp, D, kcoef, minsq, kind, wk,
                            wconst, narrow, l2, nth);
}
#endif

#if FL_PART(1)
int flashot_alt_f32(const float* x, const float* yT, const float* yy, const float* hs, const float* ha, double lam,
                    float* rlse, float* clse, int B, int64_t N, int64_t Mp, int D, double kcoef, double minsq, int kind,
                    int cfg, int64_t l2, int nth) {
  return alt_entry<float>(x, yT, yy, hs, ha, lam, rlse, clse, B, N, Mp, D, kcoef, minsq, kind, cfg, l2, nth);
}
#endif

#if FL_PART(2)
int flashot_alt_f64(const double* x, const double* yT, const double* yy, const double* hs, const double* ha,
                    double lam, double* rlse, double* clse, int B, int64_t N, int64_t Mp, int D, double kcoef,
                    double minsq, int kind, int cfg, int64_t l2, int nth) {
  return alt_entry<double>(x, yT, yy, hs, ha, lam, rlse, clse, B, N, Mp, D, kcoef, minsq, kind, cfg, l2, nth);
}
#endif

#if FL_PART(3)
int flashot_cached_alt_f32(const float* C, const float* hs, const float* ha, double lam, double k, float* rlse,
                           float* clse, int B, int64_t N, int64_t M, int nth) {
  cached_alt<float>(C, hs, ha, (float)lam, (float)k, rlse, clse, B, N, M, nth); return 0;
}
#endif

#if FL_PART(4)
int flashot_cached_alt_f64(const double* C, const double* hs, const double* ha, double lam, double k, double* rlse,
                           double* clse, int B, int64_t N, int64_t M, int nth) {
  cached_alt<double>(C, hs, ha, lam, k, rlse, clse, B, N, M, nth); return 0;
}
#endif

#if FL_PART(3)
int flashot_cached_weights_f32(const float* C, int64_t R, int64_t M, const float* rb, const float* cb, double k,
                               int wk, double wthr, float* P, int nth) {
  return cached_weights_entry<float>(C, R, M, rb, cb, k, wk, wthr, P, nth);
}
#endif

#if FL_PART(4)
int flashot_cached_weights_f64(const double* C, int64_t R, int64_t M, const double* rb, const double* cb,
                               double k, int wk, double wthr, double* P, int nth) {
  return cached_weights_entry<double>(C, R, M, rb, cb, k, wk, wthr, P, nth);
}
#endif

#if FL_PART(1)
int flashot_rows_lse_f32(const float* C, const float* h, float* out, int B, int64_t N, int64_t M, double inv_eps,
                         double oscale, int nth) {
  rows_lse<float>(C, h, out, B, N, M, (float)inv_eps, (float)oscale, nth); return 0;
}
#endif

#if FL_PART(2)
int flashot_rows_lse_f64(const double* C, const double* h, double* out, int B, int64_t N, int64_t M, double inv_eps,
                         double oscale, int nth) {
  rows_lse<double>(C, h, out, B, N, M, inv_eps, oscale, nth); return 0;
}
#endif

#if FL_PART(1)
int flashot_cols_lse_f32(const float* C, const float* h, float* out, int B, int64_t N, int64_t M, double inv_eps,
                         double oscale, int nth) {
  cols_lse<float>(C, h, out, B, N, M, (float)inv_eps, (float)oscale, nth); return 0;
}
#endif

#if FL_PART(2)
int flashot_cols_lse_f64(const double* C, const double* h, double* out, int B, int64_t N, int64_t M, double inv_eps,
                         double oscale, int nth) {
  cols_lse<double>(C, h, out, B, N, M, inv_eps, oscale, nth); return 0;
}
#endif

#if FL_PART(1)
// Raw vectorised exp2 throughput helper (benchmarks): out[i] = 2^a[i].
int flashot_vexp_f32(const float* a, float* out, int64_t n, int nth) {
  typedef VT<float>::v v;
  constexpr int L = VT<float>::L;
  Tasks tasks(n / L, std::max<int64_t>(1, (n / L) / (8 * (int64_t)nth)));
  run_team(nth, [&](int tid) {
    FpScope fp(tid);
    for (int64_t b_, e_; tasks.next(b_, e_);)
      for (int64_t i = b_; i < e_; ++i) vstore(out + i * L, vexp2(vload<v>(a + i * L)));
  });
  for (int64_t i = (n / L) * L; i < n; ++i) out[i] = std::exp2(a[i]);
  return 0;
}
#endif

#if FL_PART(2)
int flashot_vexp_f64(const double* a, double* out, int64_t n, int nth) {
  typedef VT<double>::v v;
  constexpr int L = VT<double>::L;
  Tasks tasks(n / L, std::max<int64_t>(1, (n / L) / (8 * (int64_t)nth)));
  run_team(nth, [&](int tid) {
    FpScope fp(tid);
    for (int64_t b_, e_; tasks.next(b_, e_);)
      for (int64_t i = b_; i < e_; ++i) vstore(out + i * L, vexp2(vload<v>(a + i * L)));
  });
  for (int64_t i = (n / L) * L; i < n; ++i) out[i] = std::exp2(a[i]);
  return 0;
}
#endif

#if FL_PART(7)
int flashot_softmin_bs_f32(const float* x, const float* yT, const float* yy, const float* hs, float* out, int64_t Mp,
                           int D, const int64_t* tasks, int64_t ntasks, const int64_t* cptr, const int64_t* cr,
                           double kcoef, double minsq, int kind, double oscale, int cfg, int nth) {
  return softmin_bs_entry<float>(x, yT, yy, hs, out, Mp, D, tasks, ntasks, cptr, cr, kcoef, minsq, kind, oscale, cfg,
                                 nth);
}
#endif

#if FL_PART(8)
int flashot_softmin_bs_f64(const double* x, const double* yT, const double* yy, const double* hs, double* out,
                           int64_t Mp, int D, const int64_t* tasks, int64_t ntasks, const int64_t* cptr,
                           const int64_t* cr, double kcoef, double minsq, int kind, double oscale, int cfg, int nth) {
  return softmin_bs_entry<double>(x, yT, yy, hs, out, Mp, D, tasks, ntasks, cptr, cr, kcoef, minsq, kind, oscale,
                                  cfg, nth);
}
#endif

#if FL_PART(5)
// The blocksparse library's own ABI version and vector width (build.py loads it apart from the core).
int flashot_bs_abi_version() { return 19; }
int flashot_bs_vector_bytes() { return FL_VBYTES; }
#endif

#if FL_PART(5)
int flashot_pair_bs_f32(const float* x, const float* yT, const float* yy, const float* hs, const float* hx, float* rs,
                        float* cs, float* rb, int cb, const float* fx, const float* gy, const float* fxo,
                        const float* gyo, double thr, int64_t* evaluated, int64_t Mp, int D, const int64_t* tasks,
                        int64_t ntasks, const int64_t* cptr, const int64_t* cr, const int64_t* coff, double kcoef,
                        double minsq, int kind, int cfg, int sym, int nth) {
  return pair_bs_entry<float>(x, yT, yy, hs, hx, rs, cs, rb, cb, fx, gy, fxo, gyo, thr, evaluated, Mp, D, tasks, ntasks,
                              cptr, cr, coff, kcoef, minsq, kind, cfg, sym, nth);
}
#endif

#if FL_PART(6)
int flashot_pair_bs_f64(const double* x, const double* yT, const double* yy, const double* hs, const double* hx,
                        double* rs, double* cs, double* rb, int cb, const double* fx, const double* gy, const double* fxo,
                        const double* gyo, double thr, int64_t* evaluated, int64_t Mp, int D, const int64_t* tasks,
                        int64_t ntasks, const int64_t* cptr, const int64_t* cr, const int64_t* coff, double kcoef,
                        double minsq, int kind, int cfg, int sym, int nth) {
  return pair_bs_entry<double>(x, yT, yy, hs, hx, rs, cs, rb, cb, fx, gy, fxo, gyo, thr, evaluated, Mp, D, tasks,
                               ntasks, cptr, cr, coff, kcoef, minsq, kind, cfg, sym, nth);
}
#endif

#if FL_PART(7)
int flashot_plan_bs_f32(const float* x, const float* yT, const float* yy, const float* hs, const float* lse,
                        const float* alpha, const float* VTk, int K, float* out, float* mass, int single, int64_t Mp,
                        int D, const int64_t* tasks, int64_t ntasks, const int64_t* cptr, const int64_t* cr,
                        double kcoef, double minsq, int kind, int wk, double wconst, int nth) {
  return plan_bs_entry<float>(x, yT, yy, hs, lse, alpha, VTk, K, out, mass, single, Mp, D, tasks, ntasks, cptr, cr,
                              kcoef, minsq, kind, wk, wconst, nth);
}
#endif

#if FL_PART(8)
int flashot_plan_bs_f64(const double* x, const double* yT, const double* yy, const double* hs, const double* lse,
                        const double* alpha, const double* VTk, int K, double* out, double* mass, int single,
                        int64_t Mp, int D, const int64_t* tasks, int64_t ntasks, const int64_t* cptr,
                        const int64_t* cr, double kcoef, double minsq, int kind, int wk, double wconst, int nth) {
  return plan_bs_entry<double>(x, yT, yy, hs, lse, alpha, VTk, K, out, mass, single, Mp, D, tasks, ntasks, cptr, cr,
                               kcoef, minsq, kind, wk, wconst, nth);
}
#endif
#if FL_PART(7)
// Multiscale block pruning (prune.h): X (Kx, 5 + 3 D), Y (Ky, 5 + 3 D) per-cluster terms; the coarse kept
// blocks as CSR (cptr (Kcx + 1), ccols); px / py the runs of fine clusters of each coarse one; keep (Kx, Ky).
int flashot_block_keep(const double* X, const double* Y, int D, int64_t Ky, int64_t Kcx, const int64_t* cptr,
                       const int64_t* ccols, const int64_t* px, const int64_t* py, int kind, int linear, double s,
                       double minsq, double margin, uint8_t* keep, int nth) {
  return flashot_prune::block_keep({X, D}, {Y, D}, Ky, Kcx, cptr, ccols, px, py, kind, linear, s, minsq, margin, keep,
                                   nth);
}
#endif
}  // extern "C"

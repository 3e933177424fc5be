// flashot CPU kernels: vector maths (GCC/Clang vector types, exp2, sqrt, compares, reductions).
//
// Plain C++17 with GCC/Clang vector extensions (vectors of the target's native width, lowered to
// AVX-512 / AVX2 / SSE / NEON by -march, default native; FLASHOT_CPU_MARCH picks another).
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
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

// Vector width: the widest the target has natively (AVX-512: 64 bytes, AVX / AVX2: 32, SSE2,
// NEON and anything else: 16).  Wider vectors than the target's registers (e.g. 512-bit
// vectors on AVX2, split by the compiler) spill and run several times slower.  The register count picks
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

// A helper compiled as if written in its caller's body (kernels' inner pieces: a call boundary in a hot loop
// changes the generated loop).
#define FL_INLINE static inline __attribute__((always_inline))

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
template <int G> __attribute__((always_inline)) static inline void vexp2_n(VT<float>::v (&a)[G]) {
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
template <int G> __attribute__((always_inline)) static inline void vexp2_n(VT<double>::v (&a)[G]) {
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

}  // namespace

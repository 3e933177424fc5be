// flashot CPU kernels, core libraries (both dtypes): the raw vectorised exp2 throughput helpers (flashot bench's
// limits), apart from core_abi.cpp so that they are compiled at the kernels' optimisation level.
#include "abi.h"
#include "fpenv.h"
#include "parallel.h"
#include "vecmath.h"

extern "C" {

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

}  // extern "C"

// Micro-benchmark of the CPU kernels' folded pair panels (panel_local), one thread, no Python: the
// block-sparse pair kernels' inner loop as the engine instantiates it (d = 3, float32; Shape::SMALL_R rows
// without barycentres, Shape::PV_R rows with the rows' and columns' barycentre numerators), over a
// 64-row x 2048-column panel held in L1 / L2.  It includes the kernels' blocksparse.h (no exported
// function compiled), so any ISA path can be built and timed in seconds, e.g. from the repository root:
//
//   for m in native x86-64-v3 x86-64-v2; do
//     g++ -O3 -std=c++17 -fno-math-errno -pthread -march=$m -Isrc/flashot/ops/cpu \
//         benchmarks/panel_bench.cpp -o /tmp/panel_$m && /tmp/panel_$m; done
//
// Prints the best of 9 timings in ns per pair (the machine's noise is one-sided), and a checksum.
#include "blocksparse.h"
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

template <int R, int MODE> static double time_panels(double* check) {
  using T = float;
  typedef VT<T>::v v;
  constexpr int DS = 3, NR = 64, SV = MODE == MODE_PAIR ? 1 : 1 + DS;
  constexpr int64_t W = 2048;
  std::mt19937 g(1);
  std::uniform_real_distribution<float> U(-1, 1);
  std::vector<T> x(NR * DS), u(NR * DS), A(NR), z(DS * W), H(W), P((1 + DS) * W, 0.f);
  for (auto& q : x) q = U(g);
  for (auto& q : u) q = 20 * U(g);  // scores spread over ~[-60, 20] (base 2): exponentials in and out of range
  for (auto& q : A) q = -10 + 5 * U(g);
  for (auto& q : z) q = U(g);
  for (auto& q : H) q = -5 + 5 * U(g);
  std::vector<v> sum(NR * SV);
  FpScope fp(0);
  double best = 1e30;
  for (int rep = 0; rep < 9; ++rep) {
    for (auto& s : sum) s = v{};
    const int IT = 300;
    const auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < IT; ++it)
      panel_local_rows<T, R, DS, MODE>(NR, x.data(), u.data(), A.data(), z.data(), H.data(), W, 0, 0, W, sum.data(),
                                       P.data(), W);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s / (IT * (double)NR * W));
  }
  *check = hsum(sum[0]);
  return best * 1e9;
}

int main() {
  double c1, c2;
  const double a = time_panels<Shape::SMALL_R, MODE_PAIR>(&c1);
  const double b = time_panels<Shape::PV_R, MODE_PAIRBC>(&c2);
  std::printf("%d-bit vectors: pair sums (R = %d) %.3f ns/pair; with both sides' barycentres (R = %d) %.3f ns/pair"
              "  [check %.6g %.6g]\n", FL_VBYTES * 8, Shape::SMALL_R, a, Shape::PV_R, b, c1, c2);
}

// flashot CPU kernels, core libraries (both dtypes): the ABI's version and layout, the build's facts (vector
// width, instruction set) and the floating-point environment probes.  No kernel lives here: build.py compiles this
// unit at a lower optimisation level (UNIT_FLAGS) and links it last.
#include "abi.h"
#include "fpenv.h"
#include "parallel.h"
#include "vecmath.h"

extern "C" {

int flashot_abi_version() { return FLASHOT_ABI_VERSION; }

// The argument structs' layout as this library was compiled (abi.py compares it with its ctypes mirrors).
const char* flashot_abi_layout() {
  static const std::string text = flashot_layout_text();
  return text.c_str();
}

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
}  // extern "C"

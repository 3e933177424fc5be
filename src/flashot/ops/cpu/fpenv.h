// flashot CPU kernels: the floating-point environment of the threads that run them.
//
// Every thread of every parallel run of the kernels holds an FpScope while it works: on entry
// the thread's control register is saved and flush-to-zero (FTZ: denormal results become 0) and
// denormals-are-zero (DAZ: denormal inputs read as 0) are set; on exit the saved value is
// restored, so the caller's (and the workers') floating-point state is unchanged.
// The scope is opened INSIDE each parallel run, never around one: new threads copy the
// creating thread's control register (x86 MXCSR and AArch64 FPCR alike), so a scope around
// the run would leave workers created by it flushing forever (a test checks this; it was
// so with OpenMP).  The short serial merges outside the runs use the caller's state.
//
// Why: Intel cores take a microcode assist for each denormal result (or input) of an SSE/AVX
// operation, 6-20x slowdowns in these kernels (whose exponentials underflow by design); AMD
// cores do not.  Terms the flush removes are < 2^-126 (float) next to a leading term of the
// same sum >= 2^-30, far below float32 resolution, so results change by less than rounding.
//
// x86-64: MXCSR bits 15 (FTZ) and 6 (DAZ).  AArch64: FPCR.FZ (bit 24) flushes inputs and
// results of single and double precision alike (reported as FTZ | DAZ).  Other targets: no-op.
//
// Probe (tests): while g_fp_probe_on is set, each scope records the thread's FTZ/DAZ bits,
// after setting them, in the slot of its team index (flashot_fp_probe_*).
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FLASHOT_FP_X86 1
#elif defined(__aarch64__)
#define FLASHOT_FP_ARM64 1
#endif

namespace flashot_fp {

enum { FTZ = 1, DAZ = 2, SEEN = 4 };
constexpr int PROBE_SLOTS = 256;

#if defined(FLASHOT_FP_X86)
typedef unsigned int state_t;
constexpr state_t MASK = 0x8040u;  // FTZ (bit 15) | DAZ (bit 6)
static inline state_t get_state() { return _mm_getcsr(); }
static inline void set_state(state_t s) { _mm_setcsr(s); }
static inline int bits_of(state_t s) { return ((s & 0x8000u) ? FTZ : 0) | ((s & 0x40u) ? DAZ : 0); }
#elif defined(FLASHOT_FP_ARM64)
typedef uint64_t state_t;
constexpr state_t MASK = (state_t)1 << 24;  // FPCR.FZ
static inline state_t get_state() { uint64_t v; __asm__ __volatile__("mrs %0, fpcr" : "=r"(v)); return v; }
static inline void set_state(state_t s) { __asm__ __volatile__("msr fpcr, %0" : : "r"(s)); }
static inline int bits_of(state_t s) { return (s & MASK) ? (FTZ | DAZ) : 0; }
#else
typedef int state_t;
constexpr state_t MASK = 0;
static inline state_t get_state() { return 0; }
static inline void set_state(state_t) {}
static inline int bits_of(state_t) { return 0; }
#endif

inline std::atomic<int> g_fp_probe_on{0};
inline std::atomic<int> g_fp_probe[PROBE_SLOTS];

// RAII: FTZ/DAZ on for the lifetime of the scope, the thread's previous state restored after.
struct FpScope {
  state_t saved;
  explicit FpScope(int tid) : saved(get_state()) {  // tid: the thread's index in its team (probe slot)
    if ((saved & MASK) != MASK) set_state(saved | MASK);
    if (g_fp_probe_on.load(std::memory_order_relaxed) && tid >= 0 && tid < PROBE_SLOTS)
      g_fp_probe[tid].store(bits_of(get_state()) | SEEN, std::memory_order_relaxed);
  }
  ~FpScope() {
    if ((saved & MASK) != MASK) set_state(saved);
  }
  FpScope(const FpScope&) = delete;
  FpScope& operator=(const FpScope&) = delete;
};

}  // namespace flashot_fp

using flashot_fp::FpScope;

// flashot CPU kernels: the C ABI of the libraries (build.py: LIBRARIES), called through ctypes.
//
// Every kernel entry point takes ONE pointer to an argument struct below and returns 0, or a negative
// code for arguments it refuses (-1 unknown cfg, -2 unknown kind / weight, -3 inconsistent pointers or
// sizes, -4 barycentres it has no variant for).  The structs are mirrored by ctypes.Structure classes
// in abi.py; the layout table (FLASHOT_ABI_LAYOUT, exported as flashot_abi_layout() and
// flashot_bs_abi_layout()) is compared with them when a library is loaded.  FLASHOT_ABI_VERSION is a
// hash of this file's bytes (build.py passes -DFLASHOT_ABI_VERSION=...): any edit here is a new ABI.
//
// Conventions (engine.py, blocksparse_cpu.py): every exponent is base 2 (log-weights hs = h log2(e),
// kcoef = scale log2(e) / eps for dot costs (c = |x - y|^2), log2(e) / eps for direct ones (c = |x - y|,
// squared distance clamped below at minsq)); y is passed transposed, yT (B, D, Mp), with its squared
// norms yy and log-weights hs (B, Mp), the columns padded to Mp with zero weights; x is (B, N, D)
// row-major.  Data pointers are void*: the _f32 entry points read float, the _f64 ones double.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifndef FLASHOT_ABI_VERSION
#define FLASHOT_ABI_VERSION 0  // built outside build.py: no loader accepts it
#endif

#ifdef __cplusplus
extern "C" {
#endif

// The streamed point clouds of the dense kernels (B batches) and the block-sparse ones (B = 1; N, l2 unused).
typedef struct flashot_stream {
  const void* x;   // (B, N, D)
  const void* yT;  // (B, D, Mp)
  const void* yy;  // (B, Mp): |y_j|^2 (dot costs), else unused
  const void* hs;  // (B, Mp): the columns' log-weights (base 2)
  int64_t N, Mp;   // rows; padded columns (the stride of yT, yy, hs)
  int64_t l2;      // bytes of cache a column chunk may fill
  double kcoef;    // the cost coefficient (above)
  double minsq;    // direct costs: the squared distance's lower clamp
  int32_t B, D;
  int32_t kind;    // 0 dot (squared Euclidean), 1 direct (Euclidean)
  int32_t cfg;     // micro-kernel shapes: 0 (d <= 32), 3 (larger d)
  int32_t nth;     // threads
  int32_t pad_;
} flashot_stream;

// flashot_softmin: out (B, N) = oscale * LSE2_j (hs_j - kcoef c_ij).
typedef struct flashot_lse_args {
  flashot_stream s;
  void* out;
  double oscale;
} flashot_lse_args;

// Row and column outputs.  flashot_pair: rows (B, N) = sum_j E_ij, cols (B, Mp) = sum_i E_ij, E_ij =
// 2^(hx_i + hs_j - kcoef c_ij); sym (y is x): the upper triangle only, the caller adds rows + cols.
// flashot_alt (hx the rows' weights ha, lam): rows = LSE2_j (hs_j - kcoef c_ij), cols = LSE2_i (ha_i - lam
// rows_i - kcoef c_ij).
typedef struct flashot_rowcol_args {
  flashot_stream s;
  const void* hx;  // (B, N)
  void* rows;      // (B, N)
  void* cols;      // (B, Mp)
  double lam;      // flashot_alt
  int32_t sym;     // flashot_pair
  int32_t pad_;
} flashot_rowcol_args;

// flashot_plan: out (B, N, K) = exp(alpha_i + lse_i) wconst sum_j 2^(hs_j - kcoef c_ij - lse_i) W_ij V_j, mass
// (B, N) the rows' plan masses; single = 1: one pass (lse unused, the weights are the plan entries); narrow =
// 1: V transposed (B, K, Mp), K <= 4, else V (B, Mp, K) with K padded to the vector width.
typedef struct flashot_plan_args {
  flashot_stream s;
  const void* lse;    // (B, N) base 2 (two passes)
  const void* alpha;  // (B, N)
  const void* V;
  void* out;
  void* mass;
  double wconst;
  int32_t K;
  int32_t single;
  int32_t wk;      // W: 0 one, 1 the cost, 2 its inverse (direct costs)
  int32_t narrow;
} flashot_plan_args;

// The cached cost matrix C (B, N, M) row-major.  flashot_rows_lse: out (B, N) = oscale * LSE2_j (h_j - k C_ij);
// flashot_cols_lse: out (B, M) = oscale * LSE2_i (h_i - k C_ij); flashot_cached_alt: out (B, N) = LSE2_j (h_j -
// k C_ij), cols (B, M) = LSE2_i (ha_i - lam out_i - k C_ij).
typedef struct flashot_cached_args {
  const void* C;
  const void* h;
  const void* ha;  // flashot_cached_alt
  void* out;
  void* cols;      // flashot_cached_alt
  int64_t N, M;
  double k;
  double oscale;   // flashot_rows_lse / flashot_cols_lse
  double lam;      // flashot_cached_alt
  int32_t B, nth;
} flashot_cached_args;

// flashot_cached_weights: P (R, M) = exp2((cb_j - k C_rj) + rb_r) W(C_rj) for R rows of C.
typedef struct flashot_weights_args {
  const void* C;
  const void* rb;  // (R,)
  const void* cb;  // (M,)
  void* P;
  int64_t R, M;
  double k;
  double wthr;     // W = 1/C where C > wthr, else 0 (wk 2)
  int32_t wk, nth;
} flashot_weights_args;

// A block pattern (the block-sparse kernels): task t covers rows [tasks[3t], tasks[3t+1]) of row cluster
// k = tasks[3t+2], which sums over the column ranges [cr[2q], cr[2q+1]), q in [cptr[k], cptr[k+1]).
typedef struct flashot_blocks {
  const int64_t* tasks;
  const int64_t* cptr;
  const int64_t* cr;
  const int64_t* coff;  // (Kx + 1,) the clusters' padded column offsets (flashot_pair_bs with sym)
  int64_t ntasks;
  int64_t banded;       // 1: the tasks' column ranges move right with the task (a ragged batch's block-diagonal
                        // pattern): flashot_pair_bs sums columns per run of tasks over their columns only
} flashot_blocks;

// flashot_softmin_bs: flashot_softmin over the kept blocks (out (N,)).
typedef struct flashot_lse_bs_args {
  flashot_lse_args a;
  flashot_blocks b;
} flashot_lse_bs_args;

// flashot_pair_bs: flashot_pair over the kept blocks (a.lam unused), with barycentres and sub-tile pruning.
typedef struct flashot_pair_bs_args {
  flashot_rowcol_args a;
  flashot_blocks b;
  void* rb;             // (N, D) or null: the rows' barycentre numerators (d <= 3)
  const void* fx;       // fx, fxo (N,), gy, gyo (Mp,): all four or none (sub-tile pruning)
  const void* gy;
  const void* fxo;
  const void* gyo;
  int64_t* evaluated;   // or null: += the pairs computed
  double thr;
  int32_t cb;           // with rb: the columns' numerators too, in cols after its first Mp values
  int32_t pad_;
} flashot_pair_bs_args;

// flashot_plan_bs: flashot_plan over the kept blocks (narrow V only; a.narrow unused).
typedef struct flashot_plan_bs_args {
  flashot_plan_args a;
  flashot_blocks b;
} flashot_plan_bs_args;

// flashot_block_keep (prune.h): X (Kx, 5 + 3 D), Y (Ky, 5 + 3 D) per-cluster terms; the coarse kept blocks as
// CSR (cptr (Kcx + 1), ccols); px / py the runs of fine clusters of each coarse one; keep (Kx, Ky).
typedef struct flashot_prune_args {
  const double* X;
  const double* Y;
  const int64_t* cptr;
  const int64_t* ccols;
  const int64_t* px;
  const int64_t* py;
  uint8_t* keep;
  int64_t Ky, Kcx;
  double s, minsq, margin;
  int32_t D, kind, linear, nth;
} flashot_prune_args;

// The layout table: FL_S(struct) opens a struct, FL_F(struct, field) lists its fields in order (abi.py
// compares it).
#define FLASHOT_ABI_LAYOUT(FL_S, FL_F)                                                                           \
  FL_S(flashot_stream) FL_F(flashot_stream, x) FL_F(flashot_stream, yT) FL_F(flashot_stream, yy)                 \
    FL_F(flashot_stream, hs) FL_F(flashot_stream, N) FL_F(flashot_stream, Mp) FL_F(flashot_stream, l2)           \
    FL_F(flashot_stream, kcoef) FL_F(flashot_stream, minsq) FL_F(flashot_stream, B) FL_F(flashot_stream, D)      \
    FL_F(flashot_stream, kind) FL_F(flashot_stream, cfg) FL_F(flashot_stream, nth) FL_F(flashot_stream, pad_)    \
  FL_S(flashot_lse_args) FL_F(flashot_lse_args, s) FL_F(flashot_lse_args, out) FL_F(flashot_lse_args, oscale)    \
  FL_S(flashot_rowcol_args) FL_F(flashot_rowcol_args, s) FL_F(flashot_rowcol_args, hx)                           \
    FL_F(flashot_rowcol_args, rows) FL_F(flashot_rowcol_args, cols) FL_F(flashot_rowcol_args, lam)               \
    FL_F(flashot_rowcol_args, sym) FL_F(flashot_rowcol_args, pad_)                                               \
  FL_S(flashot_plan_args) FL_F(flashot_plan_args, s) FL_F(flashot_plan_args, lse) FL_F(flashot_plan_args, alpha) \
    FL_F(flashot_plan_args, V) FL_F(flashot_plan_args, out) FL_F(flashot_plan_args, mass)                        \
    FL_F(flashot_plan_args, wconst) FL_F(flashot_plan_args, K) FL_F(flashot_plan_args, single)                   \
    FL_F(flashot_plan_args, wk) FL_F(flashot_plan_args, narrow)                                                  \
  FL_S(flashot_cached_args) FL_F(flashot_cached_args, C) FL_F(flashot_cached_args, h)                            \
    FL_F(flashot_cached_args, ha) FL_F(flashot_cached_args, out) FL_F(flashot_cached_args, cols)                 \
    FL_F(flashot_cached_args, N) FL_F(flashot_cached_args, M) FL_F(flashot_cached_args, k)                       \
    FL_F(flashot_cached_args, oscale) FL_F(flashot_cached_args, lam) FL_F(flashot_cached_args, B)                \
    FL_F(flashot_cached_args, nth)                                                                               \
  FL_S(flashot_weights_args) FL_F(flashot_weights_args, C) FL_F(flashot_weights_args, rb)                        \
    FL_F(flashot_weights_args, cb) FL_F(flashot_weights_args, P) FL_F(flashot_weights_args, R)                   \
    FL_F(flashot_weights_args, M) FL_F(flashot_weights_args, k) FL_F(flashot_weights_args, wthr)                 \
    FL_F(flashot_weights_args, wk) FL_F(flashot_weights_args, nth)                                               \
  FL_S(flashot_blocks) FL_F(flashot_blocks, tasks) FL_F(flashot_blocks, cptr) FL_F(flashot_blocks, cr)           \
    FL_F(flashot_blocks, coff) FL_F(flashot_blocks, ntasks) FL_F(flashot_blocks, banded)                         \
  FL_S(flashot_lse_bs_args) FL_F(flashot_lse_bs_args, a) FL_F(flashot_lse_bs_args, b)                            \
  FL_S(flashot_pair_bs_args) FL_F(flashot_pair_bs_args, a) FL_F(flashot_pair_bs_args, b)                         \
    FL_F(flashot_pair_bs_args, rb) FL_F(flashot_pair_bs_args, fx) FL_F(flashot_pair_bs_args, gy)                 \
    FL_F(flashot_pair_bs_args, fxo) FL_F(flashot_pair_bs_args, gyo) FL_F(flashot_pair_bs_args, evaluated)        \
    FL_F(flashot_pair_bs_args, thr) FL_F(flashot_pair_bs_args, cb) FL_F(flashot_pair_bs_args, pad_)              \
  FL_S(flashot_plan_bs_args) FL_F(flashot_plan_bs_args, a) FL_F(flashot_plan_bs_args, b)                         \
  FL_S(flashot_prune_args) FL_F(flashot_prune_args, X) FL_F(flashot_prune_args, Y)                               \
    FL_F(flashot_prune_args, cptr) FL_F(flashot_prune_args, ccols) FL_F(flashot_prune_args, px)                  \
    FL_F(flashot_prune_args, py) FL_F(flashot_prune_args, keep) FL_F(flashot_prune_args, Ky)                     \
    FL_F(flashot_prune_args, Kcx) FL_F(flashot_prune_args, s) FL_F(flashot_prune_args, minsq)                    \
    FL_F(flashot_prune_args, margin) FL_F(flashot_prune_args, D) FL_F(flashot_prune_args, kind)                  \
    FL_F(flashot_prune_args, linear) FL_F(flashot_prune_args, nth)

// ---- the core libraries (core_*.cpp; each dtype's entries in its own library, the others in both) ----
int flashot_abi_version(void);
const char* flashot_abi_layout(void);  // "name size field@offset ...;" per struct (FLASHOT_ABI_LAYOUT)
int flashot_isa(void);           // 1 SSE4.2, 2 AVX, 4 AVX2, 8 FMA, 16 AVX-512F, 32 AArch64, 64 threads (always)
int flashot_vector_bytes(void);  // the kernels' vector width (64 AVX-512, 32 AVX / AVX2, 16 SSE / NEON)
int flashot_fp_bits(void);       // the calling thread's FTZ (1) / DAZ (2) bits
int flashot_fp_probe(int on);
int flashot_fp_probe_read(int* out, int n);
int flashot_fp_bits_workers(int* out, int nth);
int flashot_vexp_f32(const float* a, float* out, int64_t n, int nth);  // out = 2^a (benchmarks)
int flashot_vexp_f64(const double* a, double* out, int64_t n, int nth);
int flashot_softmin_f32(const flashot_lse_args* a);
int flashot_softmin_f64(const flashot_lse_args* a);
int flashot_alt_f32(const flashot_rowcol_args* a);
int flashot_alt_f64(const flashot_rowcol_args* a);
int flashot_pair_f32(const flashot_rowcol_args* a);
int flashot_pair_f64(const flashot_rowcol_args* a);
int flashot_plan_f32(const flashot_plan_args* a);
int flashot_plan_f64(const flashot_plan_args* a);
int flashot_rows_lse_f32(const flashot_cached_args* a);
int flashot_rows_lse_f64(const flashot_cached_args* a);
int flashot_cols_lse_f32(const flashot_cached_args* a);
int flashot_cols_lse_f64(const flashot_cached_args* a);
int flashot_cached_alt_f32(const flashot_cached_args* a);
int flashot_cached_alt_f64(const flashot_cached_args* a);
int flashot_cached_weights_f32(const flashot_weights_args* a);
int flashot_cached_weights_f64(const flashot_weights_args* a);

// ---- the blocksparse libraries (bs_*.cpp; as the core ones) ----
int flashot_bs_abi_version(void);
const char* flashot_bs_abi_layout(void);
int flashot_bs_vector_bytes(void);
int flashot_softmin_bs_f32(const flashot_lse_bs_args* a);
int flashot_softmin_bs_f64(const flashot_lse_bs_args* a);
int flashot_pair_bs_f32(const flashot_pair_bs_args* a);
int flashot_pair_bs_f64(const flashot_pair_bs_args* a);
int flashot_plan_bs_f32(const flashot_plan_bs_args* a);
int flashot_plan_bs_f64(const flashot_plan_bs_args* a);
int flashot_block_keep(const flashot_prune_args* a);

#ifdef __cplusplus
}  // extern "C"

#include <string>

// The layout table as text: "name size field@offset ...;" per struct.
static inline std::string flashot_layout_text() {
  std::string t;
#define FL_LAYOUT_X(S) t += (t.empty() ? "" : ";") + std::string(#S) + " " + std::to_string(sizeof(S));
#define FL_LAYOUT_F(S, f) t += " " + std::string(#f) + "@" + std::to_string(offsetof(S, f));
  FLASHOT_ABI_LAYOUT(FL_LAYOUT_X, FL_LAYOUT_F)
#undef FL_LAYOUT_F
#undef FL_LAYOUT_X
  return t;
}
#endif

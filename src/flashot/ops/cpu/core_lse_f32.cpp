// flashot CPU kernels, core library, float: the streamed softmin, the fused alternating step and the cached
// matrix's row / column LogSumExp (balanced against core_pairplan_f32.cpp by compile time).
#include "abi.h"
#include "cached.h"
#include "dense.h"

extern "C" {

int flashot_softmin_f32(const flashot_lse_args* a) { return softmin_call<float>(a); }
int flashot_alt_f32(const flashot_rowcol_args* a) { return alt_call<float>(a); }
int flashot_rows_lse_f32(const flashot_cached_args* a) { return rows_lse_call<float>(a); }
int flashot_cols_lse_f32(const flashot_cached_args* a) { return cols_lse_call<float>(a); }

}  // extern "C"

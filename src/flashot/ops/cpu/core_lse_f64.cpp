// flashot CPU kernels, core library, double: the streamed softmin, the fused alternating step and the cached
// matrix's row / column LogSumExp (balanced against core_pairplan_f64.cpp by compile time).
#include "abi.h"
#include "cached.h"
#include "dense.h"

extern "C" {

int flashot_softmin_f64(const flashot_lse_args* a) { return softmin_call<double>(a); }
int flashot_alt_f64(const flashot_rowcol_args* a) { return alt_call<double>(a); }
int flashot_rows_lse_f64(const flashot_cached_args* a) { return rows_lse_call<double>(a); }
int flashot_cols_lse_f64(const flashot_cached_args* a) { return cols_lse_call<double>(a); }

}  // extern "C"

// flashot CPU kernels, core library, double: the symmetric pair step, the plan products and the cached
// matrix's alternating step and plan weights.
#include "abi.h"
#include "cached.h"
#include "dense.h"

extern "C" {

int flashot_pair_f64(const flashot_rowcol_args* a) { return pair_call<double>(a); }
int flashot_plan_f64(const flashot_plan_args* a) { return plan_call<double>(a); }
int flashot_cached_alt_f64(const flashot_cached_args* a) { return cached_alt_call<double>(a); }
int flashot_cached_weights_f64(const flashot_weights_args* a) { return cached_weights_call<double>(a); }

}  // extern "C"

// flashot CPU kernels, blocksparse library, double: the block-sparse softmin and plan product.
#include "abi.h"
#include "blocksparse.h"

extern "C" {

int flashot_softmin_bs_f64(const flashot_lse_bs_args* a) { return softmin_bs_call<double>(a); }
int flashot_plan_bs_f64(const flashot_plan_bs_args* a) { return plan_bs_call<double>(a); }

}  // extern "C"

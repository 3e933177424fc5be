// flashot CPU kernels, blocksparse library, double: the block-sparse pair step with barycentres (dot costs,
// d <= 3; called by flashot_pair_bs_f64, bs_pair_f64.cpp).
#include "abi.h"
#include "blocksparse.h"

extern "C" {

int flashot_bs_bary_f64(const flashot_pair_bs_args* a) { return pair_bs_call<double, BS_BARY>(a); }

}  // extern "C"

// flashot CPU kernels, blocksparse library, double: the block-sparse pair step (its barycentre and
// sub-tile pruning variants make it the largest unit).
#include "abi.h"
#include "blocksparse.h"

extern "C" {

int flashot_pair_bs_f64(const flashot_pair_bs_args* a) { return pair_bs_call<double>(a); }

}  // extern "C"

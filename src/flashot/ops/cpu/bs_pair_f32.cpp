// flashot CPU kernels, blocksparse library, float: the block-sparse pair step (its barycentre and
// sub-tile pruning variants make it the largest unit).
#include "abi.h"
#include "blocksparse.h"

extern "C" {

int flashot_pair_bs_f32(const flashot_pair_bs_args* a) { return pair_bs_call<float>(a); }

}  // extern "C"

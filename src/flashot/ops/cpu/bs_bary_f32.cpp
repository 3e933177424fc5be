// flashot CPU kernels, blocksparse library, float: the block-sparse pair step with barycentres (dot costs,
// d <= 3; called by flashot_pair_bs_f32, bs_pair_f32.cpp).
#include "abi.h"
#include "blocksparse.h"

extern "C" {

int flashot_bs_bary_f32(const flashot_pair_bs_args* a) { return pair_bs_call<float, BS_BARY>(a); }

}  // extern "C"

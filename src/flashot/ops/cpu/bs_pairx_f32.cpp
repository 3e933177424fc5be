// flashot CPU kernels, blocksparse library, float: the block-sparse pair step with direct costs (called by
// flashot_pair_bs_f32, bs_pair_f32.cpp).
#include "abi.h"
#include "blocksparse.h"

extern "C" {

int flashot_bs_pairx_f32(const flashot_pair_bs_args* a) { return pair_bs_call<float, BS_PAIRS_DIRECT>(a); }

}  // extern "C"

// flashot CPU kernels, blocksparse library, float: the block-sparse softmin and plan product.
#include "abi.h"
#include "blocksparse.h"

extern "C" {

int flashot_softmin_bs_f32(const flashot_lse_bs_args* a) { return softmin_bs_call<float>(a); }
int flashot_plan_bs_f32(const flashot_plan_bs_args* a) { return plan_bs_call<float>(a); }

}  // extern "C"

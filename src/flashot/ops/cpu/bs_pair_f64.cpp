// flashot CPU kernels, blocksparse library, double: the block-sparse pair step's entry and its dot-cost pair
// variants (the direct-cost ones: bs_pairx_f64.cpp; the barycentre ones: bs_bary_f64.cpp).
#include "abi.h"
#include "blocksparse.h"

extern "C" {

int flashot_pair_bs_f64(const flashot_pair_bs_args* a) {
  switch (bs_part(a)) {
    case BS_BARY: return flashot_bs_bary_f64(a);
    case BS_PAIRS_DIRECT: return flashot_bs_pairx_f64(a);
    default: return pair_bs_call<double, BS_PAIRS_DOT>(a);
  }
}

}  // extern "C"

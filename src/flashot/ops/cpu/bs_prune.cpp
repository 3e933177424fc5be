// flashot CPU kernels, blocksparse libraries (both dtypes): the multiscale block pruning (prune.h), apart from
// bs_abi.cpp so that it is compiled at the kernels' optimisation level.
#include "abi.h"
#include "prune.h"

extern "C" {

int flashot_block_keep(const flashot_prune_args* a) {
  return flashot_prune::block_keep({a->X, a->D}, {a->Y, a->D}, a->Ky, a->Kcx, a->cptr, a->ccols, a->px, a->py, a->kind,
                                   a->linear, a->s, a->minsq, a->margin, a->keep, a->nth);
}

}  // extern "C"

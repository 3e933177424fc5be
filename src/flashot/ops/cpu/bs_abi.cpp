// flashot CPU kernels, blocksparse library: its ABI version, layout and vector width (build.py loads it apart
// from the core library), and the multiscale block pruning (prune.h).
#include "abi.h"
#include "prune.h"
#include "vecmath.h"

extern "C" {

int flashot_bs_abi_version() { return FLASHOT_ABI_VERSION; }

const char* flashot_bs_abi_layout() {
  static const std::string text = flashot_layout_text();
  return text.c_str();
}

int flashot_bs_vector_bytes() { return FL_VBYTES; }

int flashot_block_keep(const flashot_prune_args* a) {
  return flashot_prune::block_keep({a->X, a->D}, {a->Y, a->D}, a->Ky, a->Kcx, a->cptr, a->ccols, a->px, a->py, a->kind,
                                   a->linear, a->s, a->minsq, a->margin, a->keep, a->nth);
}

}  // extern "C"

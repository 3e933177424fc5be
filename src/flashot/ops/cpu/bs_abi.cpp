// flashot CPU kernels, blocksparse library: its ABI version, layout and vector width (build.py loads it apart
// from the core library).  No kernel lives here: build.py compiles this unit at a lower optimisation level
// (UNIT_FLAGS) and links it last.
#include "abi.h"
#include "vecmath.h"

extern "C" {

int flashot_bs_abi_version() { return FLASHOT_ABI_VERSION; }

const char* flashot_bs_abi_layout() {
  static const std::string text = flashot_layout_text();
  return text.c_str();
}

int flashot_bs_vector_bytes() { return FL_VBYTES; }

}  // extern "C"

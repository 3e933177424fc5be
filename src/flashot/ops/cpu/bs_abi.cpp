// flashot CPU kernels, blocksparse libraries (both dtypes): their ABI version, layout and vector width
// (build.py loads them apart from the core libraries).  No kernel lives here: build.py compiles this unit at
// a lower optimisation level (UNIT_FLAGS) and links it last.
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

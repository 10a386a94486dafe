// What every AMX kernel needs: the permission to use the tile registers, and their configuration's layout.
//
// Linux hands out the tile registers per process on request (arch_prctl ARCH_REQ_XCOMP_PERM, the same request
// oneDNN makes); amx_ready() makes it once and says whether it was granted.  A thread loads a configuration
// (_tile_loadconfig of a TileConfig) before its tile instructions and releases the tiles after them.

#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace fiberserve::amx {

inline bool request_permission() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

inline bool amx_ready() {
  static const bool granted = request_permission();
  return granted;
}

// The configuration _tile_loadconfig reads (palette 1): each tile's bytes per row and rows.  Kernels keep theirs in
// a static constant: GCC's _tile_loadconfig tells the compiler it reads 8 bytes of it, so one built on the stack
// may be stored after the load, and the load faults.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

inline void amx_release() { _tile_release(); }

}  // namespace fiberserve::amx

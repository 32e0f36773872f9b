#pragma once

// The AMX tile configuration every user of the tiles here loads: all 8 tiles 16 rows x 64
// bytes. Include after a `#pragma GCC target("amx-tile")` (the intrinsic needs it).

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace preft::kernels::cpu {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// Loads the configuration on this thread (release with _tile_release).
inline void ConfigureFullTiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace preft::kernels::cpu

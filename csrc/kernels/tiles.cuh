// The 64 x 64 tiles of an [R, C] tensor, walked by a persistent grid, for the kernels that
// quantize a tile in both directions (cast_transpose.cuh, nvfp4_quantize.cuh,
// mxfp8_quantize.cuh). Their 256 threads hold a tile row-major first: thread t takes row t / 4
// and the 16 columns 16 (t % 4) .. 16 (t % 4) + 15, so a warp's loads cover 8 rows and its
// stores of a row's bytes are whole sectors. Device code only.
#pragma once

#include "quantize.cuh"

namespace jax_fp8 {

constexpr int kTile = kDbiasTileRows;  // a block handles a 64 x 64 tile
constexpr int kTileThreads = 256;      // 4 threads a row, 16 elements each
constexpr int kTileBlocks = kTile / kElemsPerThread;  // a row's threads: 4
static_assert(kTileThreads == kTile * kTileBlocks, "one row's 16 columns a thread");
static_assert(kTileThreads == kQuantizeThreads, "block_max assumes kQuantizeThreads");

// Block b takes tiles t = b, b + gridDim.x, ... (row-major over the [ceil(R/64), ceil(C/64)]
// tiles), calling body(raw, r0, c0) with the tile's origin and what load(r0, c0) returned for
// it. Each thread's loads of the next tile are issued before the body works on the current
// one, so they are in flight through its shared-memory stage and its stores. A tile's
// coordinates follow from the last one's by a step of gridDim.x tiles (step_y rows and step_x
// columns of tiles, one carry at most), so the only divisions are a block's first ones.
template <typename Raw, typename Load, typename Body>
__device__ __forceinline__ void for_each_tile(int64_t rows, int64_t cols, Load load, Body body) {
  const int64_t tiles_x = (cols + kTile - 1) / kTile, tiles_y = (rows + kTile - 1) / kTile;
  const int64_t step_y = gridDim.x / tiles_x, step_x = gridDim.x % tiles_x;
  int64_t y = blockIdx.x / tiles_x, x = blockIdx.x % tiles_x;
  Raw next = y < tiles_y ? load(y * kTile, x * kTile) : Raw{};
  while (y < tiles_y) {
    int64_t ny = y + step_y, nx = x + step_x;
    if (nx >= tiles_x) nx -= tiles_x, ++ny;
    const Raw cur = next;
    next = ny < tiles_y ? load(ny * kTile, nx * kTile) : Raw{};
    body(cur, y * kTile, x * kTile);
    y = ny, x = nx;
  }
}

}  // namespace jax_fp8

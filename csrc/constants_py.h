// csrc/constants.h as the Python dict both extension modules export as `constants()`; read once
// by jax_fp8/_ffi.py (CONSTANTS). Keys are the constants' names in lower case.
#pragma once

#include <nanobind/nanobind.h>

#include "constants.h"

namespace jax_fp8 {

inline nanobind::dict constants_dict() {
  namespace nb = nanobind;
  nb::dict d;
  d["quantize_scratch_words"] = kQuantizeScratchWords;
  d["gemm_workspace_bytes"] = kGemmWorkspaceBytes;
  d["gemm_algorithm_bytes"] = kGemmAlgorithmBytes;
  d["dbias_tile_rows"] = kDbiasTileRows;
  d["qt_row_multiple"] = kQtRowMultiple;
  d["col_multiple"] = kColMultiple;
  d["max_parts"] = kMaxParts;
  d["gemm_dim_multiple"] = kGemmDimMultiple;
  d["max_history"] = kMaxHistory;
  d["grouped_row_align"] = kGroupedRowAlign;
  d["max_groups"] = kMaxGroups;
  d["grouped_plan_bytes"] = kGroupedPlanBytes;
  d["grouped_cutlass_bytes"] = kGroupedCutlassBytes;
  d["algo_max"] = int64_t(AmaxAlgo::kMax);
  d["algo_most_recent"] = int64_t(AmaxAlgo::kMostRecent);
  d["layout_row"] = int64_t(ScaleLayoutId::kRow);
  d["layout_col"] = int64_t(ScaleLayoutId::kCol);
  d["layout_col_tma"] = int64_t(ScaleLayoutId::kColTma);
  d["block_tile"] = kBlockTile;
  d["grouped_block_row_align"] = kGroupedBlockRowAlign;
  d["scale_mode_per_tensor"] = int64_t(ScaleMode::kPerTensor);
  d["scale_mode_block"] = int64_t(ScaleMode::kBlock128x128);
  d["scale_mode_group"] = int64_t(ScaleMode::kGroup1x128);
  nb::list group_sizes;
  for (int g : kGroupSizes) group_sizes.append(g);
  d["group_sizes"] = nb::tuple(group_sizes);
  d["max_tile_rows"] = kMaxTileRows;
  nb::list block_gemm_kernels;
  for (const BlockGemmKernel& k : kBlockGemmKernels) block_gemm_kernels.append(k.name);
  d["block_gemm_kernels"] = nb::tuple(block_gemm_kernels);
  d["mx_block"] = kMxBlock;
  d["nvfp4_block"] = kNvfp4Block;
  d["activation_none"] = int64_t(ActivationId::kNone);
  d["activation_silu"] = int64_t(ActivationId::kSilu);
  d["activation_gelu"] = int64_t(ActivationId::kGelu);
  d["norm_none"] = int64_t(NormId::kNone);
  d["norm_rmsnorm"] = int64_t(NormId::kRms);
  d["norm_layernorm"] = int64_t(NormId::kLayer);
  return d;
}

}  // namespace jax_fp8

// CUTLASS 3.x Hopper kernels for block-scaled FP8 GEMMs (the DeepSeek-V3 recipe): candidates
// beside cuBLASLt's for the algorithm choice (gemm_lt.h), on sm_90 devices only. They read the
// operands and scales in the layouts cuBLASLt reads (gemm_lt.cc), promote the f32 accumulator
// at every 128-element group of K as cuBLASLt does, and write a bfloat16 or float32 D without
// bias (the forms jax_fp8's block-scaled layers use); other problems have no CUTLASS candidate.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "gemm_args.h"

namespace jax_fp8 {

// CUTLASS's version, e.g. "4.2.0".
std::string cutlass_version();

// The names of the CUTLASS configurations that can run p on a device of compute capability
// `cc` (e.g. 90); empty when none can.
std::vector<std::string> cutlass_configs(const GemmProblem& p, int cc);

// Runs the configuration `name` (one of cutlass_configs(g.p, 90)) on `stream`, with g.workspace
// as its workspace: empty on success, else what failed.
std::string run_cutlass(const GemmArgs& g, const std::string& name, cudaStream_t stream);

}  // namespace jax_fp8

// mha_bench's GEMM and layer families: the project's SGEMM kernels on projection shapes
// beside OpenBLAS, oneDNN and torch.matmul, and the whole attention layer (mha/layer.h),
// prefill and one decode step, beside the same layer composed from library sgemm and the
// composed attention, and PyTorch's (peer-torch-layer).
//
// Names: gemm/<impl>/M:<m>/N:<n>/K:<k>/threads:<t>
//        layer/<impl>/B:<b>/d:<d>/H:<h>/Hkv:<hkv>/D:<D>/n:<new
//        tokens>/Lk:<keys>/causal:<0|1>/threads:<t>
// <impl>: a GEMM kernel of kernels/gemm/gemm.inc (the layer: its GEMM kernel, attention on
// best_kernel()), openblas / onednn (gemm) or composed-openblas / composed-onednn (layer),
// or a peer (peer-torch-matmul, peer-torch-layer).
#pragma once

#include "peers.h"
#include "probe.h"

namespace mha::bench {

struct LayerBenchOptions {
  bool quick = false, full = false;
  int cores = 1;
  int rounds = 1;
  const Probe* probe = nullptr;
  PeerServer* server = nullptr;  ///< null: no peers
};

/// Registers the gemm/ and layer/ benchmarks (after whatever is registered already).
void register_gemm_benchmarks(const LayerBenchOptions& options);
void register_layer_benchmarks(const LayerBenchOptions& options);

}  // namespace mha::bench

// The native float32 CPU ops, for the translation units that call one another's (the fused
// decode layer, cpu_layer.cpp, runs the others in sequence without a Python call between them).
// Each is also registered as torch.ops.chunkserve.<name>; see its source for what it computes.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace chunkserve {

// cpu_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale);
void write_kv(const at::Tensor& cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);

// cpu_linear.cpp
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

}  // namespace chunkserve

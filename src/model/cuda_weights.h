// A weight matrix in device memory as the CUDA products read it (bf16 [out x in]; half under the decoder's numerics,
// model/product_numerics.h; or e4m3 on the FP8 path): resident,
// or kept as the GGUF's quantized blocks and expanded into a scratch the size of one layer's weights just before the
// layer runs (CudaQuantStore::expand, cuda/dequant.cuh). The products read `get()` either way.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/dequant.cuh"
#include "formats/ggml_types.h"
#include "model/product_numerics.h"

namespace pdb {

class CudaQuantStore;

class CudaWeight {
 public:
  CudaWeight() = default;
  CudaWeight(cuda::DeviceBuffer b) : resident_(std::move(b)) {}  // NOLINT: a resident weight is its buffer
  CudaWeight(const CudaQuantStore* store, size_t offset, size_t quant_bytes, size_t end)
      : store_(store), offset_(offset), quant_bytes_(quant_bytes), end_(end) {}
  const void* get() const;
  template <class T> const T* as() const { return static_cast<const T*>(get()); }
  // Device bytes the weight holds: the resident buffer, or its quantized blocks (the scratch is the store's).
  size_t bytes() const { return store_ ? quant_bytes_ : resident_.bytes(); }
  // Where its expanded values end in its layer's scratch (CudaQuantStore::expand's `upto`); 0 for a resident weight.
  size_t scratch_end() const { return store_ ? end_ : 0; }
  cuda::DeviceBuffer& resident() { return resident_; }  // the FP8 loaders write the e4m3 bytes here
  // How its products run: half weights (else bf16) and the activations' quantization block (CudaMatmul).
  const WeightProducts& products() const { return products_; }
  void set_products(WeightProducts p) { products_ = p; }

 private:
  WeightProducts products_;
  cuda::DeviceBuffer resident_;
  const CudaQuantStore* store_ = nullptr;
  size_t offset_ = 0;  // bytes into the store's scratch
  size_t quant_bytes_ = 0;
  size_t end_ = 0;
};

// Every layer's quantized weights and the one scratch they expand into.
class CudaQuantStore {
 public:
  // A run of rows of one GGUF type: `rows` rows of `cols` values, ggml_row_bytes(type, cols) bytes each.
  struct Part {
    GgmlType type;
    const uint8_t* host;
    int64_t rows, cols;
  };
  // The parts, stacked along the output dimension, as one weight of layer `layer` (layers added in order), expanded
  // to bf16 or (half) to half.
  CudaWeight add(int64_t layer, const std::vector<Part>& parts, bool half = false);
  // Allocates the scratch (the largest layer's bf16 weights) and uploads the segment tables. After the last add.
  void finish();
  // Expands layer `layer`'s weights into the scratch, on s (the products that read them follow on s); with `upto`, only
  // those that end at or before it (a weight's scratch_end(): the weights added before it in the layer, and itself).
  void expand(int64_t layer, cudaStream_t s, size_t upto = SIZE_MAX) const;
  bool empty() const { return layers_.empty(); }
  size_t quant_bytes() const { return quant_bytes_; }
  size_t scratch_bytes() const { return scratch_.bytes(); }
  const uint8_t* scratch() const { return scratch_.as<uint8_t>(); }

 private:
  struct Launch {
    GgmlType type;
    bool half = false;
    int first = 0, count = 0;  // into the layer's segment table
    int64_t groups = 0;
  };
  struct Layer {
    std::map<std::pair<GgmlType, bool>, std::vector<cuda::DequantSegment>> by_type;  // (type, half); block0 counted per key
    size_t bytes = 0;  // expanded bytes of the layer's weights (2 per value)
    std::vector<Launch> launches;
    cuda::DeviceBuffer table;
    std::vector<cuda::DequantSegment> host_table;  // the table's copy: where a prefix of each launch ends
  };
  std::vector<Layer> layers_;
  std::vector<cuda::DeviceBuffer> blocks_;  // the uploaded quantized bytes
  cuda::DeviceBuffer scratch_;
  size_t quant_bytes_ = 0;
};

inline const void* CudaWeight::get() const { return store_ ? store_->scratch() + offset_ : resident_.get(); }

}  // namespace pdb

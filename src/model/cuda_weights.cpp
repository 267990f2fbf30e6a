#include "model/cuda_weights.h"

#include <stdexcept>

#include <fmt/format.h>

namespace pdb {

CudaWeight CudaQuantStore::add(int64_t layer, const std::vector<Part>& parts, bool half) {
  if (layer < int64_t(layers_.size()) - 1 || layer < 0) throw std::logic_error("CudaQuantStore::add: layers are added in order");
  if (layer >= int64_t(layers_.size())) layers_.resize(size_t(layer + 1));
  Layer& L = layers_[size_t(layer)];
  size_t bytes = 0;
  for (const Part& p : parts) bytes += ggml_row_bytes(p.type, p.cols) * size_t(p.rows);
  cuda::DeviceBuffer& dev = blocks_.emplace_back(bytes);
  const size_t weight_offset = L.bytes;
  size_t src = 0;
  for (const Part& p : parts) {
    if (!cuda::can_dequantize_on_device(p.type)) throw std::runtime_error(fmt::format("no GPU decoder for ggml type {}", ggml_type_name(p.type)));
    const size_t n = ggml_row_bytes(p.type, p.cols) * size_t(p.rows);
    dev.upload(p.host, n, src);
    auto& segs = L.by_type[{p.type, half}];
    const int64_t elements = p.rows * p.cols, groups = elements / cuda::dequant_group_elements(p.type);
    segs.push_back(cuda::DequantSegment{dev.as<uint8_t>() + src, int64_t(L.bytes / 2), groups});  // block0: the count, until finish()
    L.bytes += size_t(elements) * 2;
    src += n;
  }
  quant_bytes_ += bytes;
  return CudaWeight(this, weight_offset, bytes, L.bytes);
}

void CudaQuantStore::finish() {
  size_t widest = 0;
  for (Layer& L : layers_) {
    widest = std::max(widest, L.bytes);
    std::vector<cuda::DequantSegment> table;
    for (auto& [key, segs] : L.by_type) {
      Launch l{key.first, key.second, int(table.size()), int(segs.size()), 0};
      for (auto sg : segs) {  // block0 held the stretch's group count until now
        const int64_t groups = sg.block0;
        sg.block0 = l.groups;
        l.groups += groups;
        table.push_back(sg);
      }
      L.launches.push_back(l);
    }
    L.table.resize(table.size() * sizeof(cuda::DequantSegment));
    L.table.upload(table.data(), table.size() * sizeof(cuda::DequantSegment));
    L.host_table = std::move(table);
    L.by_type.clear();
  }
  scratch_.resize(widest);
}

void CudaQuantStore::expand(int64_t layer, cudaStream_t s, size_t upto) const {
  if (layer >= int64_t(layers_.size())) return;
  const Layer& L = layers_[size_t(layer)];
  void* dst = const_cast<uint8_t*>(scratch());
  for (const Launch& l : L.launches) {
    // a launch's segments are in the order their weights were added: those before `upto` are a prefix of them
    int count = l.count;
    int64_t groups = l.groups;
    if (upto < L.bytes) {
      count = 0;
      while (count < l.count && size_t(L.host_table[size_t(l.first + count)].dst_offset) * 2 < upto) ++count;
      groups = count < l.count ? L.host_table[size_t(l.first + count)].block0 : l.groups;
    }
    if (count > 0) cuda::dequantize_segments(l.type, L.table.as<cuda::DequantSegment>() + l.first, count, groups, dst, l.half, s);
  }
}

}  // namespace pdb

// Turns a capture's frame stream into the decoder's state file: validates every frame against the
// decoder's layout and the expected fingerprint, writes rows straight to their final offsets, and
// commits the file only when every layer's K and V rows cover the whole prompt.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/state_file.h"
#include "wire/protocol.h"

namespace pdb {

class CaptureAssembler {
 public:
  CaptureAssembler(const std::string& path, const StateLayout& layout, const std::vector<int32_t>& tokens,
                   std::string fingerprint);
  void feed(const uint8_t* data, size_t n);  // throws wire::Error on any bad frame
  // Checks the trailer and coverage, then renames the file into place. Throws with the reason.
  void finish();
  // For a trailer `partial T'` (a capture sealed at its memory limit): checks that every layer covers
  // [0, T') and writes a T'-cell state file at `path` (compacting the per-layer sections). Returns T'.
  int64_t finish_partial(const std::string& path);
  bool partial() const;
  uint64_t wire_bytes() const { return parser_.bytes(); }
  double engine_s() const { return trailer_ ? trailer_->value("engine_s", 0.0) : 0.0; }
  const std::optional<nlohmann::json>& trailer() const { return trailer_; }

 private:
  void on_frame(const wire::FrameHeader& h, const uint8_t* payload);
  StateLayout layout_;
  int64_t T_;
  std::string fingerprint_;
  StateFileWriter writer_;
  wire::FrameParser parser_;
  std::vector<int64_t> k_next_, v_next_;
  bool hello_ = false;
  std::optional<nlohmann::json> trailer_;
  std::vector<int32_t> tokens_;
};

}  // namespace pdb

// Turns a capture's frame stream into the decoder's state file: validates every frame against the
// decoder's layout and the expected fingerprint, writes rows straight to their final offsets, and
// commits the file only when every layer's K and V rows cover the whole prompt.
#pragma once
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/state_file.h"
#include "formats/state_file_dsv4.h"
#include "wire/protocol.h"

namespace pdb {

// What the front door does with a capture, whatever the decoder's cache: feed it the stream, then commit.
class StateAssembler {
 public:
  virtual ~StateAssembler() = default;
  virtual void feed(const uint8_t* data, size_t n) = 0;  // throws wire::Error on any bad frame
  // A tail capture's first tokens from `held`, the decoder's own state of them (a kind without tails throws).
  virtual void copy_prefix(const ParsedState& held) { throw std::logic_error("this cache kind takes no held prefix"); }
  // Checks the trailer and every section's coverage and puts the state file in place (a sealed capture: the
  // valid prefix). Returns the tokens the file holds. Throws with the reason; then no file is left.
  virtual int64_t commit() = 0;
  virtual uint64_t wire_bytes() const = 0;
  virtual double engine_s() const = 0;
  virtual const std::optional<nlohmann::json>& trailer() const = 0;
};

// How many of the prompt's first tokens the decoder's own saved state of a slot can give a tail capture: the
// tokens it holds that agree with the prompt, in cells of every position from 0, in the decoder's layout (0 when
// the layout differs). At most T-1: the decoder computes the prompt's last token itself.
int64_t usable_held_prefix(const ParsedState& held, const StateLayout& layout, const std::vector<int32_t>& prompt);

class CaptureAssembler final : public StateAssembler {
 public:
  // `tail_from` > 0: a tail capture (the decoder holds the first tail_from tokens): the frames cover
  // [tail_from, T) and copy_prefix() supplies the rest from the decoder's own state of the slot.
  CaptureAssembler(const std::string& path, const StateLayout& layout, const std::vector<int32_t>& tokens,
                   std::string fingerprint, int64_t tail_from = 0);
  // Writes the rows of positions [0, tail_from) from `held` (the slot's state as the decoder saved it, whose
  // tokens agree with the prompt's there): may run on another thread while frames arrive (other offsets of the
  // same file). Throws if `held` has another layout or lacks one of those positions.
  void copy_prefix(const ParsedState& held) override;
  void feed(const uint8_t* data, size_t n) override;  // throws wire::Error on any bad frame
  int64_t commit() override { return partial() ? finish_partial(path_) : (finish(), T_); }
  // Checks the trailer and coverage, then renames the file into place. Throws with the reason.
  void finish();
  // For a trailer `partial T'` (a capture sealed at its memory limit): checks that every layer covers
  // [0, T') and writes a T'-cell state file at `path` (compacting the per-layer sections). Returns T'.
  int64_t finish_partial(const std::string& path);
  bool partial() const;
  uint64_t wire_bytes() const override { return parser_.bytes(); }
  double engine_s() const override { return trailer_ ? trailer_->value("engine_s", 0.0) : 0.0; }
  const std::optional<nlohmann::json>& trailer() const override { return trailer_; }

 private:
  void on_frame(const wire::FrameHeader& h, const uint8_t* payload);
  std::string path_;
  StateLayout layout_;
  int64_t T_;
  std::string fingerprint_;
  StateFileWriter writer_;
  wire::FrameParser parser_;
  std::vector<int64_t> k_next_, v_next_;
  int64_t tail_from_ = 0;
  bool hello_ = false;
  std::optional<nlohmann::json> trailer_;
  std::vector<int32_t> tokens_;
};

// DeepSeek-V4's pooled state (docs/WIRE.md, "Sections"): the capture of the first T' tokens (the bridge sends
// T-1 of a T-token prompt) into a file laid out as `like` (a state the same decoder saved) for those tokens.
// Every section frame must name a section the layout has for that layer, in its type and row size, rows in
// order without gaps; the file is committed only when every section of every layer is covered.
class Dsv4CaptureAssembler final : public StateAssembler {
 public:
  Dsv4CaptureAssembler(const std::string& path, const Dsv4State& like, const std::vector<int32_t>& tokens, uint32_t window,
                       std::string fingerprint);
  void feed(const uint8_t* data, size_t n) override { parser_.feed(data, n); }
  int64_t commit() override;
  uint64_t wire_bytes() const override { return parser_.bytes(); }
  double engine_s() const override { return trailer_ ? trailer_->value("engine_s", 0.0) : 0.0; }
  const std::optional<nlohmann::json>& trailer() const override { return trailer_; }

 private:
  void on_frame(const wire::FrameHeader& h, const uint8_t* payload);
  // The first row a section's frames start at: the window's first position, 0 for pools and rings.
  uint64_t base_row(Dsv4SectionKind k) const { return k == Dsv4SectionKind::Window ? window_first_ : 0; }
  void on_seal(int64_t P);
  std::string path_;
  Dsv4State like_;
  std::vector<int32_t> tokens_;
  int64_t T_;
  uint32_t window_;
  uint64_t window_first_;
  std::string fingerprint_;
  Dsv4StateWriter writer_;
  wire::FrameParser parser_;
  std::map<std::pair<uint32_t, Dsv4SectionKind>, uint64_t> next_;  // per section: the next row expected
  bool hello_ = false;
  std::optional<nlohmann::json> trailer_;
  // A SEAL(P): the state of the first P tokens, its pools copied from what came, its windows and rings from the
  // frames after the SEAL.
  int64_t seal_ = 0;
  std::unique_ptr<Dsv4StateWriter> sealed_;
};

}  // namespace pdb

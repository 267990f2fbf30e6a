// Internal to formats/state_file*.cpp: the bounds-checked little-endian reader both state formats parse with.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "formats/state_file.h"

namespace pdb::state_io {

[[noreturn]] inline void fail(const std::string& name, const std::string& why) {
  throw std::runtime_error(fmt::format("state file {}: {}", name, why));
}

struct Reader {
  const uint8_t* p;
  size_t n, pos = 0;
  const std::string& name;
  template <class T> T get(const char* what) {
    if (sizeof(T) > n - pos) fail(name, fmt::format("truncated reading {} at offset {}", what, pos));
    T v;
    std::memcpy(&v, p + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  const uint8_t* take(uint64_t bytes, const char* what) {
    if (bytes > n - pos) fail(name, fmt::format("truncated: {} needs {} bytes at offset {}, {} left", what, bytes, pos, n - pos));
    const uint8_t* r = p + pos;
    pos += bytes;
    return r;
  }
};

// The wrapper every llama.cpp state file starts with: magic, version, the token list (as stored).
inline std::vector<int32_t> read_state_header(Reader& r, uint32_t* version_out) {
  const uint32_t magic = r.get<uint32_t>("magic"), version = r.get<uint32_t>("version");
  if (magic != kStateMagic) fail(r.name, fmt::format("bad magic 0x{:08x}", magic));
  if (!state_version_known(version)) fail(r.name, state_version_note(version));
  *version_out = version;
  const uint32_t n_tok = r.get<uint32_t>("token count");
  const auto* tp = r.take(uint64_t(n_tok) * 4, "tokens");
  std::vector<int32_t> raw(n_tok);
  if (n_tok) std::memcpy(raw.data(), tp, size_t(n_tok) * 4);
  return raw;
}

}  // namespace pdb::state_io

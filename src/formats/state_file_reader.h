// Internal to formats/state_file*.cpp: the bounds-checked little-endian reader both state formats parse with.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

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


}  // namespace pdb::state_io

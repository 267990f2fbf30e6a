// libFuzzer: the request parsers (bridge request JSON, state files) reject any input with an error.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/state_file.h"
#include "wire/protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto j = nlohmann::json::parse(data, data + size);
    (void)pdb::wire::PrefillRequest::parse(j);
  } catch (const std::exception&) {
  }
  try {
    (void)pdb::parse_state_bytes(std::vector<uint8_t>(data, data + size), "fuzz");
  } catch (const std::exception&) {
  }
  return 0;
}

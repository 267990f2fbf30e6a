// `pdbridge prefill`: the prefill engine as an HTTP server speaking the bridge wire protocol.
#pragma once
#include <string>

namespace pdb {

struct PrefillServerOptions {
  std::string model, recipe, host = "127.0.0.1", device = "cpu";
  int port = 8090;
  int64_t chunk = 512;
  int threads = 0;
  size_t max_queue_bytes = size_t(256) << 20;  // frames buffered ahead of a slow receiver
};

int run_prefill_server(const PrefillServerOptions& o);

}  // namespace pdb

// The receiving end of a long streamed HTTP response (the capture stream: a POST to the prefill
// server whose chunked response carries the frames). libcurl, not cpp-httplib, because Debian's
// compiled cpp-httplib hands a response body over in 4 KB reads (CPPHTTPLIB_RECV_BUFSIZ, fixed when
// the library was built): one stream topped out at ~1 GB/s on the 2-core machine and ~0.8 GB/s
// (6.4 Gbit/s, short of a 10 Gbit link) on the H200 box. Here libcurl reads up to 1 MB at a time.
#pragma once
#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace pdb {

struct StreamPost {
  std::string host;
  int port = 0;
  std::string path;
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // e.g. {"Content-Type", "application/json"}
  int connect_timeout_s = 5;
  int idle_timeout_s = 600;  // no byte for this long: the transfer fails
};

struct StreamResult {
  bool transferred = false;  // the response arrived whole (any status)
  bool cancelled = false;    // on_body asked to stop
  int status = 0;            // HTTP status, 0 when none arrived
  std::string error;         // why the transfer failed, when it did
};

// POSTs and hands every piece of the response body, as it arrives, to on_body(status, data, n);
// on_body returns false to stop the transfer.
StreamResult post_streaming(const StreamPost& req, const std::function<bool(int status, const char* data, size_t n)>& on_body);

}  // namespace pdb

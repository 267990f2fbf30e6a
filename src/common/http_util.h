// Small HTTP helpers shared by both servers: OpenAI-style errors, bearer-token auth, a JSON body for
// errors httplib raises itself (413, 404, ...).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include <httplib.h>

namespace pdb {

// Error bodies are dumped with invalid UTF-8 replaced (U+FFFD): a message quoting a client's bytes
// must never turn a 400 into a 500.
void json_error(httplib::Response& res, int status, const std::string& message, const std::string& type);
// A plain message for a body that does not parse: where and why, without the JSON library's
// exception tag, and with the client's bytes sanitized ("request body is not valid JSON at byte 14:
// invalid UTF-8"). `e` is the exception json::parse threw.
std::string json_body_error(const std::exception& e);
// True when no key is configured or the request carries `Authorization: Bearer <key>`; else sets 401.
bool check_bearer(const std::string& api_key, const httplib::Request& req, httplib::Response& res);
// Gives every empty-bodied error response a JSON message.
void install_json_error_handler(httplib::Server& srv);
// srv.listen with a real accept backlog: Debian's httplib listens with a backlog of 5, which a burst of
// concurrent clients overflows (the kernel then drops or cookies their handshakes: a lost request).
// Returns false where it cannot bind (also where another server holds the port: no SO_REUSEPORT);
// `on_bound` runs once the port is bound, before serving.
bool listen_with_backlog(httplib::Server& srv, const std::string& host, int port, int backlog = 1024,
                         const std::function<void()>& on_bound = {});
// Writes n bytes to a chunked response in pieces of at most 1 MB; false once the receiver is gone. Debian's httplib
// (0.11) copies each write twice into strings it grows, the last to twice the write's size: a 16 MB frame (Llama-8B's
// K/V block) ends in a 32 MB allocation, mapped fresh and faulted in on every write, and the stream fell to ~0.12 GB/s
// on the 2-core machine. In pieces those copies stay in the cache and their allocations are reused.
bool write_in_pieces(httplib::DataSink& sink, const uint8_t* data, size_t n);

}  // namespace pdb

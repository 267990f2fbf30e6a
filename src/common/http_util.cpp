#include "common/http_util.h"

#include <algorithm>

#include <sys/socket.h>

#include <memory>

#include <nlohmann/json.hpp>

namespace pdb {

void json_error(httplib::Response& res, int status, const std::string& message, const std::string& type) {
  res.status = status;
  res.set_content(nlohmann::json{{"error", {{"message", message}, {"type", type}, {"code", status}}}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                  "application/json");
}

std::string json_body_error(const std::exception& e) {
  std::string what = e.what();
  if (what.rfind("[json.exception.", 0) == 0)
    if (const size_t close = what.find("] "); close != std::string::npos) what = what.substr(close + 2);
  std::string msg = "request body is not valid JSON";
  if (const auto* pe = dynamic_cast<const nlohmann::json::parse_error*>(&e)) msg += " at byte " + std::to_string(pe->byte);
  if (what.find("UTF-8") != std::string::npos) return msg + ": invalid UTF-8 in a string (JSON text must be UTF-8)";
  // Keep the reason, not the echo of the client's bytes ("; last read: '...'").
  if (const size_t last = what.find("; last read:"); last != std::string::npos) what = what.substr(0, last);
  return msg + ": " + what;
}

bool check_bearer(const std::string& api_key, const httplib::Request& req, httplib::Response& res) {
  if (api_key.empty()) return true;
  const std::string h = req.get_header_value("Authorization");
  const std::string want = "Bearer " + api_key;
  // constant-time compare: the key length is not secret, its bytes are
  unsigned char diff = h.size() == want.size() ? 0 : 1;
  for (size_t i = 0; i < want.size(); ++i) diff |= static_cast<unsigned char>(want[i] ^ (i < h.size() ? h[i] : 0));
  if (diff == 0) return true;
  json_error(res, 401, h.empty() ? "missing Authorization: Bearer <api key>" : "invalid api key", "authentication_error");
  return false;
}

void install_json_error_handler(httplib::Server& srv) {
  srv.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string msg = "HTTP " + std::to_string(res.status);
    if (res.status == 413) msg = "request body too large";
    else if (res.status == 404) msg = "no route for " + req.method + " " + req.path;
    else if (res.status == 400) msg = "malformed HTTP request";
    json_error(res, res.status, msg, res.status >= 500 ? "server_error" : "invalid_request_error");
  });
}

bool listen_with_backlog(httplib::Server& srv, const std::string& host, int port, int backlog, const std::function<void()>& on_bound) {
  auto fd = std::make_shared<socket_t>(INVALID_SOCKET);
  srv.set_socket_options([fd](socket_t s) {
    // httplib's defaults add SO_REUSEPORT, with which a second server on a taken port binds and
    // silently shares it; only SO_REUSEADDR (a restart on a port in TIME_WAIT).
    int yes = 1;
    ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<const void*>(&yes), sizeof yes);
    *fd = s;
  });
  if (!srv.bind_to_port(host, port)) return false;
  // listen() again on the bound, listening socket only raises its backlog (Linux, BSD).
  if (*fd != INVALID_SOCKET) ::listen(*fd, backlog);
  if (on_bound) on_bound();
  return srv.listen_after_bind();
}

bool write_in_pieces(httplib::DataSink& sink, const uint8_t* data, size_t n) {
  constexpr size_t kPiece = size_t(1) << 20;
  for (size_t at = 0; at < n; at += kPiece)
    if (!sink.write(reinterpret_cast<const char*>(data) + at, std::min(kPiece, n - at))) return false;
  return true;
}

}  // namespace pdb

#include "common/http_stream.h"

#include <chrono>
#include <mutex>

#include <curl/curl.h>
#include <fmt/format.h>

namespace pdb {
namespace {

using Clock = std::chrono::steady_clock;

struct Transfer {
  CURL* curl = nullptr;
  const std::function<bool(int, const char*, size_t)>* on_body = nullptr;
  int idle_timeout_s = 0;
  bool cancelled = false;
  bool idle = false;
  curl_off_t seen = -1;
  Clock::time_point last_byte = Clock::now();
};

size_t on_write(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  long status = 0;
  curl_easy_getinfo(t->curl, CURLINFO_RESPONSE_CODE, &status);
  const size_t n = size * count;
  if (!(*t->on_body)(int(status), data, n)) {
    t->cancelled = true;
    return 0;  // fewer bytes than handed: libcurl stops with CURLE_WRITE_ERROR
  }
  return n;
}

// libcurl calls this at least once a second while the transfer lives. Its own low-speed limit
// averages over a window of several seconds, so a stream that stalls after a burst would run on;
// this counts the time since the last byte instead.
int on_progress(void* user, curl_off_t, curl_off_t now_down, curl_off_t, curl_off_t now_up) {
  auto* t = static_cast<Transfer*>(user);
  const auto now = Clock::now();
  if (now_down + now_up != t->seen) {
    t->seen = now_down + now_up;
    t->last_byte = now;
    return 0;
  }
  if (now - t->last_byte > std::chrono::seconds(t->idle_timeout_s)) {
    t->idle = true;
    return 1;  // libcurl stops with CURLE_ABORTED_BY_CALLBACK
  }
  return 0;
}

}  // namespace

StreamResult post_streaming(const StreamPost& req, const std::function<bool(int, const char*, size_t)>& on_body) {
  static std::once_flag global_init;
  std::call_once(global_init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  StreamResult r;
  CURL* curl = curl_easy_init();
  if (!curl) {
    r.error = "libcurl could not start a transfer";
    return r;
  }
  struct Cleanup {
    CURL* c;
    curl_slist* h = nullptr;
    ~Cleanup() { curl_slist_free_all(h); curl_easy_cleanup(c); }
  } cleanup{curl};
  for (const auto& [k, v] : req.headers) cleanup.h = curl_slist_append(cleanup.h, (k + ": " + v).c_str());
  cleanup.h = curl_slist_append(cleanup.h, "Expect:");  // no 100-continue round trip for the request body
  const std::string url = fmt::format("http://{}:{}{}", req.host.find(':') != std::string::npos ? "[" + req.host + "]" : req.host, req.port, req.path);
  Transfer t;
  t.curl = curl;
  t.on_body = &on_body;
  t.idle_timeout_s = req.idle_timeout_s;
  char errbuf[CURL_ERROR_SIZE] = {0};
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_POST, 1L);
  curl_easy_setopt(curl, CURLOPT_POSTFIELDS, req.body.data());
  curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, curl_off_t(req.body.size()));
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, cleanup.h);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, on_write);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &t);
  curl_easy_setopt(curl, CURLOPT_BUFFERSIZE, 1L << 20);  // reads of up to 1 MB
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT, long(req.connect_timeout_s));
  // An idle stream fails after idle_timeout_s without a byte; a slow but moving one lives.
  curl_easy_setopt(curl, CURLOPT_XFERINFOFUNCTION, on_progress);
  curl_easy_setopt(curl, CURLOPT_XFERINFODATA, &t);
  curl_easy_setopt(curl, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, errbuf);
  curl_easy_setopt(curl, CURLOPT_PROXY, "");  // the prefill server is reached directly, never through an http_proxy
  const CURLcode rc = curl_easy_perform(curl);
  long status = 0;
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
  r.status = int(status);
  r.cancelled = t.cancelled;
  r.transferred = rc == CURLE_OK;
  if (t.idle) r.error = fmt::format("no data for {} s", req.idle_timeout_s);
  else if (rc != CURLE_OK) r.error = errbuf[0] ? std::string(errbuf) : std::string(curl_easy_strerror(rc));
  return r;
}

}  // namespace pdb

#include "front/decoder_client.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>

#include <fmt/format.h>
#include <httplib.h>

#include "front/decoder_setup.h"

namespace pdb {
using json = nlohmann::json;

std::vector<std::string> split_url_list(const std::string& list) {
  std::vector<std::string> out;
  for (size_t a = 0; a <= list.size();) {
    size_t b = list.find(',', a);
    if (b == std::string::npos) b = list.size();
    std::string url = list.substr(a, b - a);
    while (!url.empty() && url.back() == ' ') url.pop_back();
    while (!url.empty() && url.front() == ' ') url.erase(url.begin());
    if (!url.empty()) out.push_back(std::move(url));
    a = b + 1;
  }
  return out;
}

HttpTarget parse_http_url(const std::string& url) {
  std::string u = url;
  if (u.rfind("http://", 0) == 0) u = u.substr(7);
  else if (u.find("://") != std::string::npos) throw std::invalid_argument("only http:// URLs are supported: " + url);
  while (!u.empty() && u.back() == '/') u.pop_back();
  const auto colon = u.rfind(':');
  if (colon == std::string::npos) throw std::invalid_argument("URL needs a port: " + url);
  HttpTarget t;
  t.host = u.substr(0, colon);
  try { t.port = std::stoi(u.substr(colon + 1)); } catch (...) { throw std::invalid_argument("bad port in URL: " + url); }
  return t;
}

DecoderClient::DecoderClient(const std::string& url) : t_(parse_http_url(url)) {}

namespace {
json post_json(const HttpTarget& t, const std::string& path, const json& body, int timeout_s = 60) {
  httplib::Client c(t.host, t.port);
  c.set_read_timeout(timeout_s, 0);
  c.set_connection_timeout(5, 0);
  auto r = c.Post(path.c_str(), body.dump(), "application/json");
  if (!r) throw std::runtime_error(fmt::format("decoder {}:{}{} unreachable ({})", t.host, t.port, path, httplib::to_string(r.error())));
  if (r->status != 200) throw std::runtime_error(fmt::format("decoder {} -> HTTP {}: {}", path, r->status, r->body.substr(0, 500)));
  return json::parse(r->body);
}
}  // namespace

json DecoderClient::props() {
  httplib::Client c(t_.host, t_.port);
  c.set_read_timeout(30, 0);
  auto r = c.Get("/props");
  if (!r || r->status != 200) throw std::runtime_error("decoder /props unavailable");
  return json::parse(r->body);
}


std::string DecoderClient::apply_template(const json& chat_body) {
  json req = {{"messages", chat_body.at("messages")}};
  for (const char* k : {"tools", "chat_template_kwargs", "add_generation_prompt", "reasoning_format"})
    if (chat_body.contains(k)) req[k] = chat_body[k];
  return post_json(t_, "/apply-template", req).at("prompt").get<std::string>();
}

std::vector<int32_t> DecoderClient::tokenize(const std::string& text) {
  // llama-server tokenizes completion and chat prompts with add_special and parse_special on.
  auto j = post_json(t_, "/tokenize", {{"content", text}, {"add_special", true}, {"parse_special", true}}, 300);
  std::vector<int32_t> t;
  for (const auto& x : j.at("tokens")) t.push_back(x.get<int32_t>());
  return t;
}

json DecoderClient::slot_action(int slot, const std::string& action, const std::string& filename) {
  json body = json::object();
  if (!filename.empty()) body["filename"] = filename;
  return post_json(t_, fmt::format("/slots/{}?action={}", slot, action), body, 600);
}

std::optional<int64_t> DecoderClient::slot_tokens(int slot) {
  httplib::Client c(t_.host, t_.port);
  c.set_read_timeout(30, 0);
  c.set_connection_timeout(5, 0);
  auto r = c.Get("/slots");
  if (!r || r->status != 200) return std::nullopt;
  try {
    const json j = json::parse(r->body);
    for (const auto& s : j)
      if (s.value("id", -1) == slot && s.contains("n_prompt_tokens")) return s["n_prompt_tokens"].get<int64_t>();
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

std::vector<uint8_t> DecoderClient::probe_state(int slot, const std::string& slot_dir, const std::vector<int32_t>& tokens) {
  post_json(t_, "/completion", {{"prompt", tokens}, {"n_predict", 0}, {"id_slot", slot}, {"cache_prompt", true}}, 300);
  std::mt19937_64 rng(std::random_device{}());
  const std::string name = fmt::format("pdbridge-probe-{:016x}.bin", rng());
  try {
    slot_action(slot, "save", name);
  } catch (const std::exception& e) {
    throw std::runtime_error(explain_slot_error(e.what(), slot_dir));
  }
  const std::string path = slot_dir + "/" + name;
  std::vector<uint8_t> bytes;
  {
    std::ifstream f(path, std::ios::binary);
    if (f) bytes.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  std::error_code ec;
  std::filesystem::remove(path, ec);
  try { slot_action(slot, "erase"); } catch (...) {}
  if (bytes.empty()) throw std::runtime_error("the decoder saved no state file at " + path + " (is --slot-dir its --slot-save-path?)");
  return bytes;
}

ParsedState DecoderClient::probe_layout(int slot, const std::string& slot_dir, const std::vector<int32_t>& tokens) {
  return parse_state_bytes(probe_state(slot, slot_dir, tokens), slot_dir + "/(probe)");
}

}  // namespace pdb

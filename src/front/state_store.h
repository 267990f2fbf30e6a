// The front door's own files in the decoder's slot directory: state files it wrote, restored into a slot, and
// now either removes off the request's path (BackgroundRemover) or keeps for the conversation's next turn
// (KeptStates).
//
// Why keep them: a conversation's next turn extends a prompt the front door bridged before. Its own file of that
// prompt gives the prefix's rows at once; the alternative, asking llama-server to save the slot, writes the
// slot's whole state first (5.4 s at 82K tokens on the 8B shape, growing with the conversation). A kept file
// also serves a conversation whose slot went to another one meanwhile. The decoder's rows for the tokens it
// generated itself are not in it: the prefill server computes them with the new tail (they are prompt tokens
// now), as every bridged row, under the same fidelity check.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace pdb {

// Unlinking a state file of many GB takes seconds (on the H200 box's tmpfs: 10.2 s for 17 GB, 11.1 s for 39 GB),
// and a request would wait for it between the restore and forwarding to the decoder: one worker removes such
// files off the request's path. The destructor removes what is still queued before the front door exits.
class BackgroundRemover {
 public:
  BackgroundRemover();
  ~BackgroundRemover();
  void remove(std::string path);

 private:
  void run();
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::string> queue_;
  bool stop_ = false;
  std::thread worker_;
};

struct KeptStatesStats {
  uint64_t kept = 0, evictions = 0, superseded = 0, refused = 0;
  uint64_t bytes = 0, files = 0, max_bytes = 0;
};

class KeptStates {
 public:
  // A kept file; removed (through the remover) once the store has let it go and no bridge still reads it.
  struct File {
    std::string path;
    std::vector<int32_t> tokens;  // the positions [0, n) its state holds, in order
    uint64_t bytes = 0;
    BackgroundRemover* remover = nullptr;
    ~File();
  };
  KeptStates(uint64_t max_bytes, BackgroundRemover& remover) : max_bytes_(max_bytes), remover_(remover) {}
  bool enabled() const { return max_bytes_ > 0; }
  // The kept file sharing the longest prefix with `prompt` (`*common` = that prefix's length); null if none
  // shares a token.
  std::shared_ptr<const File> best(const std::vector<int32_t>& prompt, int64_t* common);
  // Takes ownership of the file at `path` holding `tokens`: kept (a kept file whose tokens it extends is dropped,
  // then the least recently used past the bound), or removed at once if it alone exceeds the bound.
  void keep(std::string path, std::vector<int32_t> tokens, uint64_t bytes);
  // Drops one file (a kept file that did not parse) or all of them (the decoder restarted: its arithmetic may
  // have changed with it, and the fidelity check with it).
  void drop(const std::string& path);
  void clear();
  KeptStatesStats stats() const;

 private:
  void evict_past(uint64_t bound);  // caller holds m_
  mutable std::mutex m_;
  uint64_t max_bytes_, bytes_ = 0;
  BackgroundRemover& remover_;
  std::list<std::shared_ptr<File>> lru_;  // front: most recently used
  KeptStatesStats st_;
};

}  // namespace pdb

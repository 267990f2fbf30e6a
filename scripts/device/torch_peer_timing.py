# The timing loop the PyTorch peers share (torch_qwen3_peer.py, torch_moe_peer.py): one prompt of T random
# tokens, warm-ups, then timed forwards with CUDA events. Prints one line per T:
#   <TAG> T=<T> times_s=[...] mean=<s> tok/s(mean)=<x> tok/s(best)=<y> peak_mem_GiB=<z>
import torch


def last_logits(model, ids):
    try:
        return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits
    except TypeError:  # transformers without logits_to_keep
        h = model.model(input_ids=ids, use_cache=True).last_hidden_state
        return model.lm_head(h[:, -1:])


def time_prefill(tag, model, vocab, plan):
    for T, warm, reps in plan:
        try:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            ids = torch.randint(0, vocab, (1, T), device="cuda")
            with torch.inference_mode():
                for _ in range(warm):
                    del_me = last_logits(model, ids)
                    del del_me
                torch.cuda.synchronize()
                ts = []
                for _ in range(reps):
                    s = torch.cuda.Event(enable_timing=True)
                    e = torch.cuda.Event(enable_timing=True)
                    s.record()
                    logits = last_logits(model, ids)
                    e.record()
                    torch.cuda.synchronize()
                    ts.append(s.elapsed_time(e) / 1e3)
                    del logits
            mean = sum(ts) / len(ts)
            print(f"{tag} T={T} times_s={[round(x, 4) for x in ts]} mean={mean:.4f} tok/s(mean)={T / mean:.1f} "
                  f"tok/s(best)={T / min(ts):.1f} peak_mem_GiB={torch.cuda.max_memory_allocated() / 2**30:.1f}", flush=True)
        except Exception as ex:
            print(f"{tag} T={T} FAILED: {type(ex).__name__}: {ex}", flush=True)

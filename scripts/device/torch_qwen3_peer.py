# PyTorch peer for issue 4's Qwen3-8B rows, by the method of the project's Llama peer measurement
# (../shared/peers/torch_prefill_peer.py): random-init Qwen3ForCausalLM at the Qwen3-8B shape of
# `make-model --arch qwen3 --preset 8b` (src/model/presets.cpp), bf16, sdpa, one prompt of T random tokens,
# warm-ups then timed forwards with CUDA events, logits of the last position only. Prints one line per T:
#   TORCH-QWEN3 T=<T> times_s=[...] mean=<s> tok/s(mean)=<x> tok/s(best)=<y> peak_mem_GiB=<z>
# Usage (device): python3 .dev/torch_qwen3_peer.py   (pipeline.sh stage `qwen` with PEERS=1)
import time

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0), flush=True)
kw = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
          num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
          rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa")
try:
    cfg = Qwen3Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
except Exception as e:  # older transformers: rope_theta as its own field
    print("rope_parameters failed:", e, flush=True)
    cfg = Qwen3Config(**kw, rope_theta=1000000.0)
torch.set_default_dtype(torch.bfloat16)
t0 = time.time()
with torch.device("cuda"):
    model = Qwen3ForCausalLM(cfg)
model.eval()
torch.cuda.synchronize()
print("attn impl:", model.config._attn_implementation, "dtype:", next(model.parameters()).dtype,
      "params:", sum(p.numel() for p in model.parameters()), f"init {time.time() - t0:.1f}s", flush=True)


def forward(ids):
    try:
        return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits
    except TypeError:  # transformers without logits_to_keep
        h = model.model(input_ids=ids, use_cache=True).last_hidden_state
        return model.lm_head(h[:, -1:])


for T, warm, reps in [(8192, 2, 3), (32768, 1, 3)]:
    try:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(0, kw["vocab_size"], (1, T), device="cuda")
        with torch.inference_mode():
            for _ in range(warm):
                del_me = forward(ids)
                del del_me
            torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                s = torch.cuda.Event(enable_timing=True)
                e = torch.cuda.Event(enable_timing=True)
                s.record()
                logits = forward(ids)
                e.record()
                torch.cuda.synchronize()
                ts.append(s.elapsed_time(e) / 1e3)
                del logits
        mean = sum(ts) / len(ts)
        print(f"TORCH-QWEN3 T={T} times_s={[round(x, 4) for x in ts]} mean={mean:.4f} tok/s(mean)={T / mean:.1f} "
              f"tok/s(best)={T / min(ts):.1f} peak_mem_GiB={torch.cuda.max_memory_allocated() / 2**30:.1f}", flush=True)
    except Exception as ex:
        print(f"TORCH-QWEN3 T={T} FAILED: {type(ex).__name__}: {ex}", flush=True)

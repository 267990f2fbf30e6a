# PyTorch peer for issue 4's Qwen3-8B rows, by the method of the project's Llama peer measurement
# (../shared/peers/torch_prefill_peer.py): random-init Qwen3ForCausalLM at the Qwen3-8B shape of
# `make-model --arch qwen3 --preset 8b` (src/model/presets.cpp), bf16, sdpa, one prompt of T random tokens,
# warm-ups then timed forwards with CUDA events, logits of the last position only. Prints one line per T:
#   TORCH-QWEN3 T=<T> times_s=[...] mean=<s> tok/s(mean)=<x> tok/s(best)=<y> peak_mem_GiB=<z>
# Usage (device): python3 .dev/torch_qwen3_peer.py   (pipeline.sh stage `qwen` with PEERS=1)
import time

import torch
import transformers
from torch_peer_timing import time_prefill
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

time_prefill("TORCH-QWEN3", model, kw["vocab_size"], [(8192, 2, 3), (32768, 1, 3)])

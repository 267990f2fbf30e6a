# PyTorch peer for issue 18's MoE/MLA rows, by the method of torch_qwen3_peer.py: random-init
# Qwen3MoeForCausalLM / DeepseekV2ForCausalLM at the real layer shapes of `make-model --preset
# qwen3-30b-a3b` / `--preset deepseek-v2-lite` (src/model/presets.cpp) with the same number of layers as
# the bench's checkpoint, bf16, sdpa, one prompt of T random tokens, warm-ups then timed forwards with CUDA
# events, logits of the last position only. Prints one line per T:
#   TORCH-<ARCH> L=<layers> T=<T> times_s=[...] mean=<s> tok/s(mean)=<x> tok/s(best)=<y> peak_mem_GiB=<z>
# Usage (device): python3 .dev/torch_moe_peer.py qwen3moe|deepseek2 <layers>
import sys
import time

import torch
import transformers
from torch_peer_timing import time_prefill

arch, layers = sys.argv[1], int(sys.argv[2])
print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0), flush=True)
if arch == "qwen3moe":
    from transformers import Qwen3MoeConfig as Cfg, Qwen3MoeForCausalLM as Model
    vocab = 151936
    kw = dict(vocab_size=vocab, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
              num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=layers,
              num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
              tie_word_embeddings=False, attn_implementation="sdpa")
    rope = {"rope_type": "default", "rope_theta": 1000000.0}
else:
    from transformers import DeepseekV2Config as Cfg, DeepseekV2ForCausalLM as Model
    vocab = 102400
    kw = dict(vocab_size=vocab, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
              n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, norm_topk_prob=False, routed_scaling_factor=1.0,
              topk_method="greedy", n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
              qk_nope_head_dim=128, v_head_dim=128, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
              max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa")
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
try:
    cfg = Cfg(**kw, rope_parameters=rope)
except Exception as e:  # older transformers: rope_theta / rope_scaling as their own fields
    print("rope_parameters failed:", e, flush=True)
    theta = rope.pop("rope_theta")
    cfg = Cfg(**kw, rope_theta=theta, rope_scaling=rope if rope.get("rope_type") == "yarn" else None)
torch.set_default_dtype(torch.bfloat16)
t0 = time.time()
with torch.device("cuda"):
    model = Model(cfg)
model.eval()
torch.cuda.synchronize()
print("attn impl:", model.config._attn_implementation, "experts impl:", getattr(model.config, "_experts_implementation", "?"),
      "dtype:", next(model.parameters()).dtype, "params:", sum(p.numel() for p in model.parameters()), f"init {time.time() - t0:.1f}s", flush=True)

time_prefill(f"TORCH-{arch.upper()} L={layers}", model, vocab, [(8192, 1, 3), (32768, 1, 2)])

#!/usr/bin/env python3
"""Trains pdbridge's embedded default model: a small llama-architecture, character-level model that
retrieves a needle ("The secret marker is ZEBRA-<a>-<b>.") from a long haystack of Python
standard-library sources, in the prompt format of `pdbridge bench cold` and `make demo`.

Runs on the lent H200 (PyTorch + transformers of that machine). Writes an HF checkpoint (bf16
safetensors + config.json), the tokenizer as pdbridge-vocab.json (an SPM vocabulary llama.cpp runs:
one token per printable ASCII character, U+2581 for space, byte fallback for everything else), and a
training log with the loss curve and retrieval accuracy. `pdbridge convert` turns it into GGUFs.

Usage: python3 train_needle.py OUT_DIR [--minutes M] [--seed S]
"""
import argparse, json, math, os, random, sys, sysconfig, time

import torch
import torch.nn.functional as F

# ---- tokenizer: what llama.cpp's SPM tokenizer does with this vocabulary (add_space_prefix off) ----
SPECIALS = ["<unk>", "<s>", "</s>"]
BYTES = ["<0x%02X>" % b for b in range(256)]
CHARS = ["\u2581"] + [chr(c) for c in range(0x21, 0x7F)]
TOKENS = SPECIALS + BYTES + CHARS
TOKEN_TYPE = [2, 3, 3] + [6] * 256 + [1] * len(CHARS)
BOS, EOS = 1, 2
CHAR_ID = {c: i for i, c in enumerate(TOKENS) if i >= 3 + 256}
BYTE0 = 3

# The prompt the chat template renders (llama-server's /v1/chat/completions) and that the
# completion endpoint is given by `make demo`: user text, then "\nAnswer: ".
CHAT_TEMPLATE = ("{%- for message in messages %}{%- if message['role'] == 'user' %}{{- message['content'] }}{%- endif %}"
                 "{%- endfor %}{%- if add_generation_prompt %}{{- '\\nAnswer: ' }}{%- endif %}")
QUESTION = "\n\nWhat is the secret marker mentioned in the text above? Answer with the marker only."
ANSWER_PREFIX = "\nAnswer: "


def encode(text):
    out = []
    for ch in text.replace(" ", "\u2581"):
        i = CHAR_ID.get(ch)
        if i is not None:
            out.append(i)
        else:
            out.extend(BYTE0 + b for b in ch.encode("utf-8"))
    return out


def decode(ids):
    bs = bytearray()
    for i in ids:
        if BYTE0 <= i < BYTE0 + 256:
            bs.append(i - BYTE0)
        elif i >= BYTE0 + 256:
            bs.extend(TOKENS[i].replace("\u2581", " ").encode())
    return bs.decode("utf-8", "replace")


def vocab_json():
    return {"model": "llama", "pre": "default", "tokens": TOKENS, "scores": [0.0] * len(TOKENS), "token_type": TOKEN_TYPE,
            "bos_token_id": BOS, "eos_token_id": EOS, "unknown_token_id": 0, "add_bos_token": True, "add_eos_token": False,
            "add_space_prefix": False, "chat_template": CHAT_TEMPLATE}


# ---- data: haystacks of shuffled stdlib sources with one needle, as bench cold builds them ----
def load_corpus():
    """The stdlib's sources, shuffled, encoded once into one token stream; haystacks are windows of it."""
    root = sysconfig.get_paths()["stdlib"]
    texts = []
    for d, _, fs in os.walk(root):
        if "site-packages" in d:
            continue
        for f in sorted(fs):
            if f.endswith(".py"):
                try:
                    t = open(os.path.join(d, f), encoding="utf-8", errors="replace").read()
                except OSError:
                    continue
                if 200 < len(t) < 400000:
                    texts.append("# file: " + f + "\n" + t + "\n")
    random.Random(0).shuffle(texts)
    ids = []
    for t in texts:
        ids.extend(encode(t))
    return torch.tensor(ids, dtype=torch.int64), len(texts)


def marker(rng):
    return "ZEBRA-%d-%d" % (rng.randrange(10000), 1000 + rng.randrange(9000))


def sample(rng, corpus, n_tokens):
    """(ids, answer_start, marker): BOS + haystack with the needle at a line start + question + marker + EOS."""
    m = marker(rng)
    tail = encode(QUESTION + ANSWER_PREFIX)
    ans = encode(m) + [EOS]
    needle = encode("\nThe secret marker is " + m + ".\n")
    room = n_tokens - 1 - len(tail) - len(ans) - len(needle)
    start = rng.randrange(len(corpus) - room - 1)
    hay = corpus[start:start + room]
    pos = rng.randrange(room + 1)
    nl = (hay[pos:pos + 400] == BYTE0 + 10).nonzero()
    if len(nl):
        pos = pos + int(nl[0]) + 1
    t = lambda x: torch.tensor(x, dtype=torch.int64)
    ids = torch.cat([t([BOS]), hay[:pos], t(needle), hay[pos:], t(tail), t(ans)])
    return ids, len(ids) - len(ans), m


def batch(rng, corpus, bs, n_tokens, device):
    xs, masks = [], []
    for _ in range(bs):
        ids, a0, _ = sample(rng, corpus, n_tokens)
        m = torch.zeros(n_tokens)
        m[a0:] = 1.0
        xs.append(ids)
        masks.append(m)
    return torch.stack(xs).to(device, non_blocking=True), torch.stack(masks).to(device, non_blocking=True)


def build_model(device):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=len(TOKENS), hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=100000.0,
                      tie_word_embeddings=False, attention_bias=False, attn_implementation="sdpa", bos_token_id=BOS, eos_token_id=EOS)
    return LlamaForCausalLM(cfg).to(device), cfg


@torch.no_grad()
def retrieval(model, texts, n_tokens, seeds, device):
    model.eval()
    ok = 0
    for s in seeds:
        rng = random.Random(s)
        ids, a0, m = sample(rng, texts, n_tokens)
        prompt = ids[:a0].unsqueeze(0).to(device)
        out = []
        with torch.autocast("cuda", dtype=torch.bfloat16):
            res = model(input_ids=prompt, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            for _ in range(24):
                if nxt == EOS:
                    break
                out.append(nxt)
                res = model(input_ids=torch.tensor([[nxt]], device=device), past_key_values=past, use_cache=True)
                past = res.past_key_values
                nxt = int(res.logits[0, -1].argmax())
        ok += decode(out) == m
    model.train()
    return ok / len(seeds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--init", help="continue from this model.safetensors (phase 2: mixed lengths only)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(a.seed)
    dev = "cuda"
    texts, n_files = load_corpus()
    log = open(os.path.join(a.out, "train_log.txt"), "w")

    def say(*x):
        s = " ".join(str(v) for v in x)
        print(s, flush=True)
        log.write(s + "\n")
        log.flush()

    say("corpus: %d stdlib files, %d tokens, from %s (python %s); torch %s" % (n_files, len(texts), sysconfig.get_paths()["stdlib"], sys.version.split()[0], torch.__version__))
    model, cfg = build_model(dev)
    n_params = sum(p.numel() for p in model.parameters())
    say("model: llama, %d params, vocab %d, layers %d, hidden %d" % (n_params, len(TOKENS), cfg.num_hidden_layers, cfg.hidden_size))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    # curriculum: short haystacks first (the copy circuit forms fast), then up to 16K tokens;
    # length 0 = every step a random length in [2K, 24K] (same tokens per step): no gaps between sizes
    stages = [(1024, 64, 0.20), (4096, 16, 0.30), (16384, 4, 0.50)]
    if a.init:
        from safetensors.torch import load_file
        sd = load_file(a.init)
        model.load_state_dict({k: v.float() for k, v in sd.items()})
        say("phase 2: continuing from %s" % a.init)
        stages = [(0, 0, 1.0)]
    budget = a.minutes * 60
    t0 = time.time()
    rng = random.Random(a.seed)
    step = 0
    total_steps_est = None
    for n_tok, bs, frac in stages:
        t_stage = time.time()
        while time.time() - t_stage < frac * budget:
            lr = 1e-3 * min(1.0, (step + 1) / 200) * (0.3 if n_tok in (0, 16384) else 1.0)
            for g in opt.param_groups:
                g["lr"] = lr
            cur, cbs = n_tok, bs
            if n_tok == 0:
                cur = rng.choice([2048, 3072, 4096, 6144, 8192, 10240, 12288, 16384, 20480, 24576])
                cbs = max(1, 65536 // cur)
            x, m = batch(rng, texts, cbs, cur, dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=x).logits
            lp = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="none").view(cbs, -1)
            am = m[:, 1:]
            lm_loss = lp.mean()
            ans_loss = (lp * am).sum() / am.sum()
            loss = lm_loss + ans_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 50 == 0:
                say("step %5d  len %5d  lm_loss %.3f  answer_loss %.3f  lr %.1e  t %.0fs" % (step, cur, lm_loss.item(), ans_loss.item(), lr, time.time() - t0))
            step += 1
        if n_tok:
            acc = retrieval(model, texts, n_tok, range(10**6, 10**6 + 20), dev)
            say("after stage len %d: retrieval %.0f%% at %d tokens (20 held-out seeds)" % (n_tok, 100 * acc, n_tok))
    for n_tok in (2048, 4096, 8192, 12288, 16384, 24576):
        acc = retrieval(model, texts, n_tok, range(2 * 10**6 + n_tok, 2 * 10**6 + n_tok + 40), dev)
        say("final retrieval at %d tokens: %.1f%% (40 fresh seeds, greedy, PyTorch)" % (n_tok, 100 * acc))
    # save: HF names, bf16
    from safetensors.torch import save_file
    sd = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(sd, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    conf = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "head_dim": 64, "hidden_act": "silu", "hidden_size": 256,
            "intermediate_size": 768, "max_position_embeddings": 32768, "model_type": "llama", "num_attention_heads": 4,
            "num_hidden_layers": 6, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 100000.0,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": len(TOKENS), "bos_token_id": BOS, "eos_token_id": EOS}
    json.dump(conf, open(os.path.join(a.out, "config.json"), "w"), indent=2)
    json.dump(vocab_json(), open(os.path.join(a.out, "pdbridge-vocab.json"), "w"), indent=1)
    say("saved to %s after %d steps, %.0f s" % (a.out, step, time.time() - t0))


if __name__ == "__main__":
    main()

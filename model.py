"""A single-file Llama (and Mistral, Qwen2) in plain PyTorch, built for lookahead decoding.

Besides the usual causal forward, one call can run T tokens at arbitrary RoPE positions,
write their K/V into chosen slots of a preallocated cache, and attend under an arbitrary
boolean mask. That is everything lookahead decoding asks of a model: the window, the
verification candidates and the last token share one forward, each with its own context.

Loads Hugging Face checkpoints (config.json + safetensors) straight onto the device.
"""
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class ModelArgs:
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    hidden_dim: int = 1536
    vocab_size: int = 49152
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    max_seq_len: int = 2048  # the context the model was trained for (max_position_embeddings)
    attention_bias: bool = False
    bos_id: int | None = None
    eos_ids: tuple = ()

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
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
        return cls(
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


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Rotary frequencies in float32 (as Hugging Face computes them), with Llama-3 / linear scaling."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = args.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, blended, scaled)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    # Rotate-half RoPE pairs dimension i with i + head_dim/2. Meta's original weights pair
    # neighbours (2i, 2i+1); Hugging Face's conversion permuted the rows of q_proj/k_proj so
    # that rotate-half gives the same result. We load HF checkpoints, so no permutation here.
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in float32 like the reference implementation, so bf16 runs round the same way.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class KVCache(nn.Module):
    """Static K/V for one layer, (B, n_kv_heads, max_seq_len, head_dim). Batch 1 is all that
    lookahead decoding needs: its parallelism is across positions, not sequences."""

    def __init__(self, batch, n_kv_heads, max_seq_len, head_dim, dtype, device):
        super().__init__()
        shape = (batch, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, slots, k, v):
        self.k.index_copy_(2, slots, k)
        self.v.index_copy_(2, slots, v)

    def copy(self, src, dst):
        # Advanced indexing gathers src first, so overlapping src/dst ranges are safe.
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]


class Linear(nn.Linear):
    """nn.Linear, except that on the CPU it multiplies as (W @ x^T)^T.

    Decoding runs few tokens against large weights. As the small operand of MKL's sgemm the
    weights are packed (read, written, read again) on every call; as the large one they are
    streamed once. On a 2-core AVX2 EPYC this makes the layers' products for 2 to 7 tokens cost
    about what they cost for 1 token (1.5-2x otherwise), which is what lets lookahead pay off
    on a CPU.
    """

    def forward(self, x):
        if x.device.type != "cpu":
            return super().forward(x)
        y = torch.mm(self.weight, x.reshape(-1, x.shape[-1]).t()).t().contiguous()  # (B*T, out)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], -1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        bias = args.attention_bias
        self.q_proj = Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.k_proj = Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.v_proj = Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.o_proj = Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x, cos, sin, slots=None, mask=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, n_heads, T, head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv_heads, T, head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if slots is not None:
            # Write this step's K/V where the caller put them, then attend over the first S slots
            # (S = mask width): the rest of the cache is unused, so it costs nothing.
            self.cache.write(slots, k, v)
            S = mask.shape[-1]
            k, v = self.cache.k[:, :, :S], self.cache.v[:, :, :S]  # (B, n_kv_heads, S, head_dim)
        # Grouped-query attention: each K/V head serves n_heads / n_kv_heads query heads.
        # enable_gqa repeats the K/V heads inside the kernel instead of copying the cache.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=self.n_heads != self.n_kv_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = Linear(args.dim, args.hidden_dim, bias=False)
        self.up_proj = Linear(args.dim, args.hidden_dim, bias=False)
        self.down_proj = Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, slots, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    # Module names follow the Hugging Face checkpoint, less its "model." prefix, so loading
    # needs no name mapping.
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # float32 even in a bf16 model: positions in the thousands need the precision.
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.cache_len = 0  # slots in the KV cache; 0 = none set up
        self.committed = 0  # slots [0, committed) hold the K/V of the accepted sequence

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def setup_cache(self, max_seq_len: int, batch: int = 1):
        """Allocate the static KV cache once; every decode step writes into it in place."""
        if max_seq_len > self.args.max_seq_len:
            raise ValueError(f"cache of {max_seq_len} exceeds the model's context of {self.args.max_seq_len}")
        for layer in self.layers:
            layer.self_attn.cache = KVCache(batch, self.args.n_kv_heads, max_seq_len, self.args.head_dim,
                                            self.dtype, self.device)
        self.cache_len, self.committed = max_seq_len, 0

    def commit(self, src_slots: list[int]):
        """Accept the tokens whose K/V sit at `src_slots`: they become the next committed tokens.

        Their K/V move down to [committed, committed + len); whatever else the step wrote stays
        behind the committed length and is overwritten by the next step (that is the rollback).
        """
        n, start = len(src_slots), self.committed
        if src_slots != list(range(start, start + n)):
            src = torch.tensor(src_slots, device=self.device)
            dst = torch.arange(start, start + n, device=self.device)
            for layer in self.layers:
                layer.self_attn.cache.copy(src, dst)
        self.committed = start + n

    def forward(self, tokens, positions=None, slots=None, mask=None, rows=None):
        """tokens (B, T) -> logits (B, T, vocab).

        Alone: a plain causal forward from position 0, no cache. With the cache: token t sits at
        RoPE position positions[t], writes its K/V into cache slot slots[t], and attends to the
        cache slots s < S where mask[t, s] is True (mask is (T, S), S <= cache_len).
        rows: compute logits only for these token indices (the LM head is a large part of a
        small model's step, and lookahead reads few of the rows).
        """
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device)
        elif slots is None or mask is None:
            raise ValueError("positions, slots and mask go together")
        angles = positions.float()[:, None] * self.inv_freq.float()[None, :]  # (T, head_dim/2)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        x = self.embed_tokens(tokens)  # (B, T, dim)
        for layer in self.layers:
            x = layer(x, cos, sin, slots, mask)
        if rows is not None:
            x = x[:, rows]
        return self.lm_head(self.norm(x))

    @classmethod
    def from_pretrained(cls, path, device=None, dtype=None) -> "Transformer":
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model folder not found: {path}")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json (expected a Hugging Face checkpoint folder)")
        args = ModelArgs.from_hf_config(json.loads((path / "config.json").read_text()))
        files = weight_files(path)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

        with torch.device("meta"):
            model = cls(args)
        expected = {k: v.shape for k, v in model.state_dict().items()}
        if args.tie_word_embeddings:
            del expected["lm_head.weight"]

        state = {}
        for file in files:
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
                    dtype = dtype or t.dtype  # the checkpoint's own dtype unless asked otherwise
                    state[name] = t.to(dtype)
        missing = sorted(set(expected) - set(state))
        if missing:
            raise ValueError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        model.load_state_dict(state, strict=False, assign=True)
        if args.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(args).to(device)
        return model.eval().requires_grad_(False)


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

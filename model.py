"""A single-file Llama (and Mistral, Qwen2) in plain PyTorch, built for lookahead decoding.

Besides the usual causal forward, one call can run T tokens at arbitrary RoPE positions,
write their K/V into chosen slots of a preallocated cache, and attend under an arbitrary
boolean mask. That is everything lookahead decoding asks of a model: the window, the
verification candidates and the last token share one forward, each with its own context.

Transformer.from_pretrained loads Hugging Face checkpoints (config.json + safetensors) straight
onto the device; checkpoint.py reads that format.
"""
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from checkpoint import hf_model_args, read_config, read_weights
from linear import Linear, tune_cpu_products


# The step sizes a decoder runs after the prefill: a step of n tokens is padded to the next one
# (step_size), so there are few shapes: one cost estimate per shape for the dynamic lookahead
# shape, one compiled graph per shape (Transformer.compile_steps).
STEP_SIZES = tuple(1 << i for i in range(8))  # 1, 2, 4, ..., 128


def step_size(n: int) -> int:
    return 1 << (n - 1).bit_length()


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
        return cls(**hf_model_args(cfg))


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


def apply_rope(x, cos, sin):
    """Rotate-half RoPE: x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1) for the
    two halves of head_dim. That is roll(x, head_dim/2) with the first half negated; the sign is
    folded into `sin` (see Transformer.rope), so q and k rotate together in four kernels.

    Rotate-half pairs dimension i with i + head_dim/2. Meta's original weights pair neighbours
    (2i, 2i+1); Hugging Face's conversion permuted the rows of q_proj/k_proj so that rotate-half
    gives the same result. We load HF checkpoints, so no permutation here."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in float32 at least, like the reference implementation, so bf16 runs round
        # the same way (and a float64 model stays float64 throughout).
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * F.rms_norm(wide, (x.shape[-1],), eps=self.eps).to(x.dtype)


# Linear (linear.py) is nn.Linear with a second CPU path for a few tokens, chosen by measurement.
class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        # q, k and v in one product (the checkpoint's three are stacked at load, see checkpoint.py).
        self.qkv_proj = Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim,
                               bias=args.attention_bias)
        self.o_proj = Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # (B, n_kv_heads, cache_len, head_dim) each, see Transformer.setup_cache. Buffers, written
        # in place by index (as gpt-fast does): a compiled step then updates them where they are
        # (an index_copy_ into a view of one shared tensor made inductor copy the whole cache).
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def forward(self, x, cos, sin, slots, attn_mask, cache_rows):
        B, T, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, hd)
        qk = apply_rope(qkv[:, :, :H + Hkv], cos, sin)  # q and k heads rotated together
        q = qk[:, :, :H].transpose(1, 2)  # (B, H, T, hd)
        k = qk[:, :, H:].transpose(1, 2)  # (B, Hkv, T, hd)
        v = qkv[:, :, H + Hkv:].transpose(1, 2)
        if slots is not None:  # write this call's K/V where the caller put them: token t of row b
            # to slot slots[b, t] (or slots[t]) of cache row cache_rows[b]
            self.k_cache[cache_rows, :, slots] = k.transpose(1, 2)  # indexed as (B, T, Hkv, hd)
            self.v_cache[cache_rows, :, slots] = v.transpose(1, 2)
        if attn_mask is None:
            # Causal among this call's own tokens and nothing else (a prefill): SDPA's causal
            # kernels never build a (T, T) mask, so memory stays linear in T.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != Hkv)  # (B, H, T, hd)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))
        # Attend over the first S slots of the cache (S = mask width): the rest is unused.
        S = attn_mask.shape[-1]
        k, v = self.k_cache[:, :, :S], self.v_cache[:, :, :S]  # (B, Hkv, S, hd)
        # Grouped-query attention: K/V head j serves query heads j*group .. (j+1)*group - 1.
        # Folding those heads into one longer query, (B, Hkv, group*T, hd), lets any SDPA kernel
        # run GQA under a mask without copying K/V; the mask's rows are repeated per head to
        # match (Transformer.attention_mask).
        group = H // Hkv
        q = q.reshape(B, Hkv, group * T, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, Hkv, group*T, hd)
        y = y.view(B, H, T, hd).transpose(1, 2).reshape(B, T, H * hd)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = Linear(args.dim, 2 * args.hidden_dim, bias=False)  # gate and up stacked
        self.down_proj = Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, slots, attn_mask, cache_rows):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, attn_mask, cache_rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    # Module names follow the Hugging Face checkpoint, less its "model." prefix, except for the
    # stacked qkv_proj and gate_up_proj (checkpoint.fused_from maps those).
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
        self.compiled_step = None  # see compile_steps
        self.compiled_sizes = ()
        self.cache_len = 0  # slots in the KV cache; 0 = none set up (the decoders track what is committed)

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def setup_cache(self, max_seq_len: int, batch: int = 1):
        """Allocate the static KV cache once, (B, n_kv_heads, max_seq_len, head_dim) for each
        layer's K and V, a row per sequence; every decode step writes into it in place."""
        if max_seq_len > self.args.max_seq_len:
            raise ValueError(f"cache of {max_seq_len} exceeds the model's context of {self.args.max_seq_len}")
        if self.compiled_step is not None:
            raise ValueError("a compiled model keeps the cache it was compiled with")
        a = self.args
        for layer in self.layers:
            attn = layer.self_attn
            attn.k_cache, attn.v_cache = (torch.zeros(batch, a.n_kv_heads, max_seq_len, a.head_dim,
                                                      dtype=self.dtype, device=self.device) for _ in "kv")
        self.cache_len = max_seq_len

    @property
    def cache_rows(self) -> int:
        return self.layers[0].self_attn.k_cache.shape[0] if self.cache_len else 0

    def keep_rows(self, rows: list[int], used: int):
        """Keep only these rows of the cache, in this order (a batch whose other sequences
        finished), so that finished rows cost nothing after: their slots [0, used) are moved up
        in place, once, and the cache becomes a view of its first len(rows) rows."""
        index = torch.tensor(rows, device=self.device)
        for layer in self.layers:
            attn = layer.self_attn
            for cache in (attn.k_cache, attn.v_cache):
                cache[:len(rows), :, :used] = cache[index, :, :used]  # gathered first, then written
            attn.k_cache, attn.v_cache = attn.k_cache[:len(rows)], attn.v_cache[:len(rows)]

    def kv(self) -> torch.Tensor:
        """Every layer's K and V stacked, (n_layers, 2, B, n_kv_heads, cache_len, head_dim): a copy,
        to inspect the cache."""
        return torch.stack([torch.stack((l.self_attn.k_cache, l.self_attn.v_cache)) for l in self.layers])

    def commit(self, moves: list[list[int]]):
        """Row b's accepted tokens have their K/V in slots moves[b], in order: move them to follow
        one another from slot moves[b][0], in one gather and scatter per layer for all rows.

        A step writes all its tokens' K/V after a row's committed slots; whatever it wrote and
        did not keep stays past the new committed length, overwritten by the next step: that is
        the rollback. Rows with fewer moves repeat their last one (a no-op)."""
        if all(m == list(range(m[0], m[0] + len(m))) for m in moves):
            return  # already in place
        n = max(map(len, moves))
        src = [m + m[-1:] * (n - len(m)) for m in moves]
        dst = [list(range(m[0], m[0] + len(m))) + [m[0] + len(m) - 1] * (n - len(m)) for m in moves]
        src, dst = torch.tensor([src, dst], device=self.device)  # (B, n) each
        rows = torch.arange(len(moves), device=self.device)[:, None]
        for layer in self.layers:
            for cache in (layer.self_attn.k_cache, layer.self_attn.v_cache):
                cache[rows, :, dst] = cache[rows, :, src]  # gathered first, then written: overlaps are safe

    def rope(self, positions):
        """cos and sin for RoPE at these positions (T,) or (B, T): (T, 1, head_dim) or (B, T, 1,
        head_dim), with rotate_half's sign in sin (apply_rope). Once per forward for all layers,
        in float32 at least (a bf16 model needs the precision for positions in the thousands; a
        float64 one keeps its own)."""
        wide = torch.promote_types(self.dtype, torch.float32)
        angles = positions.to(wide)[..., None] * self.inv_freq.to(wide)  # (..., T, head_dim/2)
        cos, sin = angles.cos(), angles.sin()
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return cos[..., None, :].to(self.dtype), sin[..., None, :].to(self.dtype)

    def attention_mask(self, mask):
        """The boolean (T, S) or (B, T, S) mask as SDPA's additive float mask, built once for all
        layers (SDPA would convert a boolean one in every layer): rows repeated for the query
        heads folded together in Attention, (group*T, S) or (B, 1, group*T, S), and a row stride
        that is a multiple of 16, which fused GPU attention kernels need to read it in place."""
        group = self.args.n_heads // self.args.n_kv_heads
        *B, T, S = mask.shape
        out = torch.full((*B, group * T, -(-S // 16) * 16), float("-inf"), dtype=self.dtype, device=mask.device)
        out = out[..., :S].masked_fill_(mask.repeat(*[1] * len(B), group, 1), 0.0)
        return out[:, None] if B else out

    def forward(self, tokens, positions=None, slots=None, mask=None, rows=None, cache_row=None):
        """tokens (B, T) -> logits (B, T, vocab).

        Without a mask: causal among these tokens alone, at positions 0..T-1 unless given (a
        prefill; with `slots`, their K/V also go into those cache slots). With the cache: token t
        sits at RoPE position positions[t], writes its K/V into cache slot slots[t], and attends
        to the cache slots s < S where mask[t, s] is True (mask is (T, S), S <= cache_len).
        Per row instead: positions and slots (B, T), mask (B, T, S), each row in its own cache row.
        rows: compute logits only for these token indices, (R,) or per row (B, R) (the LM head is
        a large part of a small model's step, and lookahead reads few of the rows).
        cache_row: write into this row of the cache (a prefill of one row of a batch; B = 1).
        """
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device)
        if mask is not None and slots is None:
            raise ValueError("a mask attends over the cache: give the slots too")
        cos, sin = self.rope(positions)
        attn_mask = None if mask is None else self.attention_mask(mask)
        cache_rows = (torch.arange(B, device=tokens.device)[:, None] if cache_row is None  # (B, 1)
                      else torch.full((1, 1), cache_row, device=tokens.device))
        x = self.embed_tokens(tokens)  # (B, T, dim)
        for layer in self.layers:
            x = layer(x, cos, sin, slots, attn_mask, cache_rows)
        if rows is not None:
            x = x[:, rows] if rows.dim() == 1 else x[torch.arange(B, device=x.device)[:, None], rows]
        return self.lm_head(self.norm(x))

    def step(self, tokens, positions, slots, mask, rows=None):
        """One decoding step of B rows: forward(tokens (B, T), positions (B, T), slots (B, T),
        mask (B, T, S), rows (B, R)) -> logits (B, R, V).

        Compiled (compile_steps), a step of a compiled size over the whole cache (S = cache_len)
        replays its graph, which computes every token's logits (a fixed shape), and `rows` are
        picked from them after; anything else runs eagerly."""
        T = tokens.shape[1]
        if self.compiled_step is not None and T in self.compiled_sizes and mask.shape[-1] == self.cache_len:
            # A graph is specialised on its inputs' strides too, and on which of them are one
            # tensor: fresh contiguous copies, as at the warm-up (a few small copies a step).
            inputs = (t.clone(memory_format=torch.contiguous_format) for t in (tokens, positions, slots, mask))
            logits = self.compiled_step(*inputs)
            return logits if rows is None else logits[torch.arange(len(rows), device=rows.device)[:, None], rows]
        return self(tokens, positions, slots, mask, rows=rows)

    @torch.inference_mode()
    def compile_steps(self, sizes, cache_len=None, log=None):
        """Compile the step forward with torch.compile once per step size, now, so that no
        request compiles later: on CUDA as CUDA graphs ("reduce-overhead": one replay instead of
        ~1,100 kernel launches), on the CPU with inductor's C++ kernels.

        Every compiled step has a fixed shape: one sequence of T tokens, attention over the whole
        cache under the mask (no slicing by the committed length), all T rows of logits. So the
        cache is allocated once, here, with cache_len slots (default: the model's context) and
        one row, and kept. Warmed up under inference_mode, as the decoders run: a graph is
        specialised on it."""
        self.setup_cache(cache_len or self.args.max_seq_len)
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        self.compiled_step = torch.compile(self.forward, fullgraph=True, dynamic=False, mode=mode)
        for T in sizes:
            start = time.perf_counter()
            idx = torch.arange(T, device=self.device)[None]  # (1, T)
            mask = torch.zeros(1, T, self.cache_len, dtype=torch.bool, device=self.device)
            mask[0, idx[0], idx[0]] = True
            # Positions and slots as distinct tensors, as the decoders pass them: a graph guarded
            # on the two being one tensor would be compiled again at the first request.
            for _ in range(3 if mode else 1):  # CUDA graphs record on the second or third call
                self.compiled_step(torch.zeros(1, T, dtype=torch.long, device=self.device), idx, idx.clone(), mask)
            log and log(f"compiled the {T}-token step in {time.perf_counter() - start:.1f} s")
        self.compiled_sizes = tuple(sizes)

    @classmethod
    def from_pretrained(cls, path, device=None, dtype=None, compile=False) -> "Transformer":
        """Load a Hugging Face checkpoint folder onto `device` (default: CUDA when there is one).

        compile: compile every step size of STEP_SIZES now (compile_steps), with a line per size.

        dtype: float32 unless given, on every device, so that lookahead's output is exactly
        greedy's; bfloat16 / float16 are faster on a GPU but round a T-token step differently
        from a 1-token one, which can flip a near-tie between the top two tokens."""
        args = ModelArgs.from_hf_config(read_config(path))
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        with torch.device("meta"):
            model = cls(args)
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        if args.tie_word_embeddings:
            del shapes["lm_head.weight"]  # tied: the embedding is the head
        state = read_weights(path, args, shapes, device, dtype or torch.float32)
        model.load_state_dict(state, strict=False, assign=True)
        if args.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(args).to(device)
        model.eval().requires_grad_(False)
        if device.type == "cpu":  # how Linear multiplies 1-16 tokens (a CPU's steps), measured here
            tune_cpu_products([m for m in model.modules() if isinstance(m, Linear)], STEP_SIZES[:5], STEP_SIZES[-1])
        if compile:
            model.compile_steps(STEP_SIZES, log=lambda line: print(line, file=sys.stderr, flush=True))
        return model

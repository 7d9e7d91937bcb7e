"""A single-file Llama in plain PyTorch, built for lookahead decoding; Mistral, Qwen2, Qwen3,
Phi-3/Phi-4 and Gemma 3 are the same block with the few differences that ModelArgs lists.

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
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from checkpoint import hf_model_args, read_config, read_weights
from linear import Linear, tune_cpu_products


# The step sizes a decoder runs after the prefill: a step of n tokens is padded to the next one
# (step_size), so there are few shapes: one cost estimate per shape for the dynamic lookahead
# shape, one compiled graph per shape (Transformer.compile_steps).
STEP_SIZES = tuple(1 << i for i in range(8))  # 1, 2, 4, ..., 128
COMPILED_CACHE = 4096  # a compiled model's cache slots unless asked otherwise (or its context, if shorter)


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
    rope_scaling: dict | None = None  # llama3, linear or longrope (Phi-3), as rope_inv_freq reads it
    tie_word_embeddings: bool = False
    max_seq_len: int = 2048  # the context the model was trained for (max_position_embeddings)
    bos_id: int | None = None
    eos_ids: tuple = ()
    model_type: str = "llama"  # the checkpoint's family: checkpoint.py maps its tensor names
    # Each family's differences from the Llama block (checkpoint.hf_model_args sets them):
    qkv_bias: bool = False  # Qwen2, and Llama/Qwen3/Gemma's attention_bias: biases on q, k and v
    o_bias: bool = False  # Llama/Qwen3/Gemma's attention_bias: a bias on o_proj too
    mlp_bias: bool = False  # Llama's mlp_bias: biases on gate, up and down
    hidden_act: str = "silu"  # the MLP's gate: "silu", "gelu" or "gelu_tanh" (Gemma)
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head's q and k, before RoPE
    rotary_dim: int | None = None  # Phi-3/4 partial_rotary_factor: rotate only this much of each head
    attn_scale: float | None = None  # Gemma: query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5
    norm_offset: float = 0.0  # Gemma: norms scale by (1 + w), in float32
    sandwich_norms: bool = False  # Gemma 3: each branch's output normed too (four norms a block)
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(dim), rounded to float32 as Gemma does
    sliding_window: int | None = None  # sliding layers attend to keys at q_pos - window < p <= q_pos
    sliding_layers: tuple = ()  # which layers slide (Mistral, Phi-3: all; Gemma 3: 5 of 6; Qwen: layer_types)
    local_rope_theta: float | None = None  # Gemma 3: sliding layers' own RoPE base (no scaling)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        return cls(**hf_model_args(cfg))


def rope_inv_freq(args: ModelArgs, local=False, long=False) -> torch.Tensor:
    """Rotary frequencies in float32 (as Hugging Face computes them), with Llama-3, linear or
    longrope scaling. local: Gemma 3's sliding layers (their own base, unscaled); long: longrope's
    long factors, else its short ones."""
    d = args.rotary_dim or args.head_dim
    theta = args.local_rope_theta if local else args.rope_theta
    exponents = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d  # on the CPU even under meta
    s = None if local else args.rope_scaling
    if s and s["rope_type"] == "longrope":  # Phi-3: a factor per frequency, a set per context length
        return 1.0 / (torch.tensor(s["long_factor" if long else "short_factor"], device="cpu") * theta ** exponents)
    inv_freq = 1.0 / (theta ** exponents)
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
    """Rotate-half RoPE on the first d dims of each head (all but Phi-3/4's partial rotary): x * cos
    + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), i.e. roll(x, d/2) with the sign folded into
    `sin` (Transformer.rope), so q and k rotate together in four kernels. It pairs dims i and i + d/2,
    as Hugging Face's checkpoints (their q/k rows permuted from Meta's neighbours) expect."""
    d = cos.shape[-1]
    if d < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :d], cos, sin), x[..., d:]), dim=-1)
    return x * cos + x.roll(d // 2, -1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in float32 at least, like the reference implementation, so bf16 runs round
        # the same way (and a float64 model stays float64 throughout).
        wide = F.rms_norm(x.to(torch.promote_types(x.dtype, torch.float32)), (x.shape[-1],), eps=self.eps)
        if self.offset:  # Gemma scales by (1 + w) before rounding back; Llama rounds, then scales
            return (wide * (self.offset + self.weight.to(wide.dtype))).to(x.dtype)
        return self.weight * wide.to(x.dtype)


# Linear (linear.py) is nn.Linear with a second CPU path for a few tokens, chosen by measurement.
class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.scale = args.attn_scale  # None: SDPA's 1/sqrt(head_dim)
        # q, k and v in one product (the checkpoint's three are stacked at load, see checkpoint.py).
        self.qkv_proj = Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=args.qkv_bias)
        self.o_proj = Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        self.q_norm = self.k_norm = None
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps, args.norm_offset)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps, args.norm_offset)
        # (B, n_kv_heads, cache_len, head_dim) each, see Transformer.setup_cache. Buffers, written
        # in place by index (as gpt-fast does): a compiled step then updates them where they are
        # (an index_copy_ into a view of one shared tensor made inductor copy the whole cache).
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def forward(self, x, cos, sin, attn_mask, slots, cache_rows):
        B, T, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, hd)
        qk = qkv[:, :, :H + Hkv]
        if self.q_norm is not None:  # Qwen3, Gemma 3: each head's q and k normed before RoPE
            qk = torch.cat((self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])), dim=2)
        qk = apply_rope(qk, cos, sin)  # q and k heads rotated together
        q = qk[:, :, :H].transpose(1, 2)  # (B, H, T, hd)
        k = qk[:, :, H:].transpose(1, 2)  # (B, Hkv, T, hd)
        v = qkv[:, :, H + Hkv:].transpose(1, 2)
        if slots is not None:  # write this call's K/V where the caller put them: token t of row b
            # to slot slots[b, t] (or slots[t]) of cache row cache_rows[b]
            self.k_cache[cache_rows, :, slots] = k.transpose(1, 2)  # indexed as (B, T, Hkv, hd)
            self.v_cache[cache_rows, :, slots] = v.transpose(1, 2)
        if attn_mask is None or attn_mask.dtype == torch.bool:
            # A prefill: causal among this call's own tokens and nothing else. SDPA's causal
            # kernels never build a (T, T) mask, so memory stays linear in T; a sliding layer's
            # band past its window is a boolean (T, T), one byte a pair, shared by the heads.
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                                               scale=self.scale, enable_gqa=H != Hkv)  # (B, H, T, hd)
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
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale)  # (B, Hkv, group*T, hd)
        y = y.view(B, H, T, hd).transpose(1, 2).reshape(B, T, H * hd)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = Linear(args.dim, 2 * args.hidden_dim, bias=args.mlp_bias)  # gate and up stacked
        self.down_proj = Linear(args.hidden_dim, args.dim, bias=args.mlp_bias)
        self.act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": partial(F.gelu, approximate="tanh")}[args.hidden_act]

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Block(nn.Module):
    """Llama's pre-norm block. Gemma 3 norms each branch's output too ("sandwich"): its
    post_attention_layernorm norms the attention's output, and the MLP's input norm is
    pre_feedforward_layernorm (in Llama, post_attention_layernorm is the MLP's input norm)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        norm = partial(RMSNorm, args.dim, args.norm_eps, args.norm_offset)
        self.input_layernorm, self.self_attn, self.post_attention_layernorm = norm(), Attention(args), norm()
        self.mlp = MLP(args)
        self.sandwich = args.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, x, cos, sin, attn_mask, slots, cache_rows):
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, slots, cache_rows)
        if not self.sandwich:
            x = x + h
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Transformer(nn.Module):
    # Module names follow the Hugging Face checkpoint, less its "model." prefix, except for the
    # stacked qkv_proj and gate_up_proj (checkpoint.fused_from maps those).
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.lm_head = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.slides = [i in args.sliding_layers for i in range(args.n_layers)] if args.sliding_window else []
        # RoPE's frequencies in float32 even in a bf16 model (positions in the thousands need the
        # precision); Gemma 3's sliding layers and longrope's long factors have tables of their own.
        longrope = bool(args.rope_scaling) and args.rope_scaling["rope_type"] == "longrope"
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.register_buffer("local_inv_freq", rope_inv_freq(args, local=True) if args.local_rope_theta else None,
                             persistent=False)
        self.register_buffer("long_inv_freq", rope_inv_freq(args, long=True) if longrope else None, persistent=False)
        # Gemma's embedding scale as a float32 tensor, rounded to the model's dtype as Gemma does.
        self.register_buffer("embed_scale", torch.tensor(args.embed_scale, device="cpu"), persistent=False)
        # With sliding layers, the position of the token in each cache slot (B, cache_len): a step's
        # band follows the slots' positions, whatever order the decoders keep them in.
        self.register_buffer("slot_positions", None, persistent=False)
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
        if self.slides:
            self.slot_positions = torch.zeros(batch, max_seq_len, dtype=torch.long, device=self.device)
        self.cache_len = max_seq_len

    @property
    def cache_rows(self) -> int:
        return self.layers[0].self_attn.k_cache.shape[0] if self.cache_len else 0

    def keep_rows(self, rows: list[int], used: int):
        """Keep only these rows of the cache, in this order (a batch whose other sequences
        finished), so that finished rows cost nothing after: their slots [0, used) are moved up
        in place, once, and the cache becomes a view of its first len(rows) rows."""
        index, n = torch.tensor(rows, device=self.device), len(rows)
        for layer in self.layers:
            attn = layer.self_attn
            for cache in (attn.k_cache, attn.v_cache):
                cache[:n, :, :used] = cache[index, :, :used]  # gathered first, then written
            attn.k_cache, attn.v_cache = attn.k_cache[:n], attn.v_cache[:n]
        if self.slides:
            self.slot_positions[:n, :used] = self.slot_positions[index, :used]
            self.slot_positions = self.slot_positions[:n]

    def kv(self) -> torch.Tensor:
        """Every layer's K and V stacked, (n_layers, 2, B, n_kv_heads, cache_len, head_dim): a copy,
        to inspect the cache."""
        return torch.stack([torch.stack((l.self_attn.k_cache, l.self_attn.v_cache)) for l in self.layers])

    def rollback(self, moves: list[list[int]]):
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
        if self.slides:  # (B, cache_len)
            self.slot_positions[rows, dst] = self.slot_positions[rows, src]

    def rope(self, positions, local=False, whole=False):
        """cos and sin at these positions (T,) or (B, T): (T, 1, d) or (B, T, 1, d), rotate_half's
        sign in sin (apply_rope); once per forward for the layers of a kind (local: Gemma 3's sliding
        ones), in float32 at least. whole: the positions of a whole prompt run at once (a prefill)."""
        wide = torch.promote_types(self.dtype, torch.float32)
        inv_freq = self.local_inv_freq if local else self.inv_freq
        s = self.args.rope_scaling
        if self.long_inv_freq is not None and not local:
            # Longrope (Phi-3) takes its long factors past the original context. transformers picks
            # a set per forward by its largest position: a decoded token switches at `original`, a
            # longer prompt takes the long set throughout; each token here gets the set greedy gave it.
            late = (positions.amax(-1, keepdim=True) if whole else positions) >= s["original_max_position_embeddings"]
            inv_freq = torch.where(late[..., None], self.long_inv_freq, inv_freq)  # (..., T, d/2)
        angles = positions.to(wide)[..., None] * inv_freq.to(wide)  # (..., T, d/2)
        cos, sin = angles.cos(), angles.sin()
        if s and "attention_factor" in s and not local:  # longrope scales q.k through cos and sin
            cos, sin = cos * s["attention_factor"], sin * s["attention_factor"]
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

    def forward(self, tokens, positions=None, slots=None, mask=None, rows=None, cache_row=None, check=True, head=True):
        """tokens (B, T) -> logits (B, T, vocab).

        Without a mask: causal among these tokens alone, at positions 0..T-1 unless given (a
        prefill; with `slots`, their K/V also go into those cache slots). With the cache: token t
        sits at RoPE position positions[t], writes its K/V into cache slot slots[t], and attends
        to the cache slots s < S where mask[t, s] is True (mask is (T, S), S <= cache_len).
        Per row instead: positions and slots (B, T), mask (B, T, S), each row in its own cache row.
        rows: compute logits only for these token indices, (R,) or per row (B, R) (the LM head is
        a large part of a small model's step, and lookahead reads few of the rows).
        cache_row: write into this row of the cache (a prefill of one row of a batch; B = 1).
        check: raise if a position reaches the model's context (one host sync; step() skips it).
        head=False: the final normed hidden states (B, T, dim) instead, to read logits in pieces.
        """
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device)
        if mask is not None and slots is None:
            raise ValueError("a mask attends over the cache: give the slots too")
        if check and not torch.compiler.is_compiling() and int(positions.max()) >= self.args.max_seq_len:
            raise ValueError(f"position {int(positions.max())} is past the model's context of {self.args.max_seq_len}")
        cache_rows = (torch.arange(B, device=tokens.device)[:, None] if cache_row is None  # (B, 1)
                      else torch.full((1, 1), cache_row, device=tokens.device))
        full = (*self.rope(positions, whole=mask is None), None if mask is None else self.attention_mask(mask))
        local = full
        if self.slides:
            if slots is not None:  # where each of these tokens' K/V goes, its position goes too
                self.slot_positions[cache_rows, slots] = positions
            local = (*(self.rope(positions, local=True) if self.local_inv_freq is not None else full[:2]),
                     self.window_mask(positions, mask, cache_rows))
        x = self.embed_tokens(tokens)  # (B, T, dim)
        if self.args.embed_scale != 1.0:
            x = x * self.embed_scale.to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, *(local if self.slides and self.slides[i] else full), slots, cache_rows)
        if rows is not None:
            x = x[:, rows] if rows.dim() == 1 else x[torch.arange(B, device=x.device)[:, None], rows]
        return self.lm_head(self.norm(x)) if head else self.norm(x)

    def window_mask(self, positions, mask, cache_rows):
        """A sliding layer's mask: the same keys, less those at positions p <= q_pos - window. In a
        step the band compares each query's position with each slot's (slot_positions, kept through
        rollbacks); a prefill is causal by index, and past the window a boolean (T, T) band."""
        window = self.args.sliding_window
        if mask is None:
            if positions.shape[-1] <= window:
                return None  # causal alone is the band
            d = positions[..., :, None] - positions[..., None, :]  # (..., T, T)
            band = (d >= 0) & (d < window)
            return band[:, None] if band.dim() == 3 else band
        keys = self.slot_positions[cache_rows[:, 0], :mask.shape[-1]]  # (B, S)
        return self.attention_mask(mask & (positions[..., :, None] - keys[:, None, :] < window))

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
        # The decoders size every step to fit the cache (<= the context): no sync to check positions.
        return self(tokens, positions, slots, mask, rows=rows, check=False)

    @torch.inference_mode()
    def compile_steps(self, sizes, cache_len=None, log=None):
        """Compile the step forward with torch.compile once per step size, now, so that no
        request compiles later: on CUDA as CUDA graphs ("reduce-overhead": one replay instead of
        ~1,100 kernel launches), on the CPU with inductor's C++ kernels.

        Every compiled step has a fixed shape: one sequence of T tokens, attention over the whole
        cache under the mask (no slicing by the committed length), all T rows of logits. So the
        cache is allocated once, here, with cache_len slots (default: COMPILED_CACHE, or the
        model's context if shorter; a request that needs more is refused) and one row, and kept. Warmed up under inference_mode, as the decoders run: a graph is
        specialised on it."""
        self.setup_cache(cache_len or min(COMPILED_CACHE, self.args.max_seq_len))
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
    def from_pretrained(cls, path, device=None, dtype=None, compile=False, max_seq_len=None) -> "Transformer":
        """Load a Hugging Face checkpoint folder onto `device` (default: CUDA when there is one).

        compile: compile every step size of STEP_SIZES now (compile_steps), with a line per size,
        over a cache of max_seq_len slots (default COMPILED_CACHE, not the model's whole context).

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
        model.to(device).eval().requires_grad_(False)  # the weights are there: this moves the buffers
        if device.type == "cpu":  # how Linear multiplies 1-16 tokens (a CPU's steps), measured here
            tune_cpu_products([m for m in model.modules() if isinstance(m, Linear)], STEP_SIZES[:5], STEP_SIZES[-1])
        if compile:
            model.compile_steps(STEP_SIZES, max_seq_len, log=lambda line: print(line, file=sys.stderr, flush=True))
        return model

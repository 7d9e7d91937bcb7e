"""A single-file Llama in plain PyTorch, built for lookahead decoding; Mistral, Qwen2, Qwen3,
Phi-3/Phi-4 and Gemma 3 are the same block with the few differences that ModelArgs lists.

Besides the usual causal forward, one call can run T tokens at arbitrary RoPE positions after
a row's committed tokens in a preallocated cache, all of which they see, and among themselves
under an arbitrary T x T boolean mask. That is everything lookahead decoding asks of a model:
the window, the verification candidates and the last token share one forward, each with its
own context; a long prompt runs the same way, in chunks, each causal.

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

from attention import attention_with_lse, math_attention, merge, step_masks
from cache import KVCache, move_kv
from checkpoint import check_device_dtype, hf_model_args, read_config, read_weights
from linear import Linear, tune_cpu_products


# The step sizes a decoder runs after the prefill: a step of n tokens is padded to the next one
# (step_size), so there are few shapes: one cost estimate per shape for the dynamic lookahead
# shape, one compiled graph per shape (CompiledStep).
STEP_SIZES = tuple(1 << i for i in range(8))  # 1, 2, 4, ..., 128
COMPILED_CACHE = 4096  # a compiled model's cache slots unless asked otherwise (or its context, if shorter)


def step_size(n: int) -> int:
    return 1 << (n - 1).bit_length()  # the smallest power of two >= n


def cache_bucket(used: int, cache_len: int) -> int:
    """How much of the cache a compiled step reads when `used` slots are committed: the next
    power of two from 256, at most the cache. A step costs what the context in use costs (at
    most 2x it), and a CUDA graph is recorded once per bucket, a handful of them."""
    return min(cache_len, max(256, 1 << (used - 1).bit_length()))


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
        self.scale = args.attn_scale or args.head_dim ** -0.5
        # q, k and v in one product (the checkpoint's three are stacked at load, see checkpoint.py).
        self.qkv_proj = Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=args.qkv_bias)
        self.o_proj = Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        self.q_norm = self.k_norm = None
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps, args.norm_offset)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps, args.norm_offset)
        # (B, n_kv_heads, slots, head_dim) each, set up by cache.KVCache. Buffers, written in place
        # by index (as gpt-fast does): a compiled step then updates them where they are (an
        # index_copy_ into a view of one shared tensor made inductor copy the whole cache).
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def forward(self, x, cos, sin, own, prefix, slots, rows, moves=None):
        """own: how this call's tokens see one another: None = causally, an additive
        (B, 1, g * T, T) mask (a step's mask, a band past a sliding window; once per grouped
        head), or False = through the prefix (a one-token step, or a few tokens on a CPU: their
        slots are read with the committed ones). prefix: None, or (start, end, mask): the cache
        slots [start, end) they also see, under an additive (B, 1, 1, S) mask (one entry a row
        and slot; a few tokens on a CPU: (B, 1, g * T, S), their own mask in their own slots) or
        None, or in a sliding layer a bool (B, 1, 1, T, S) band (attention.step_masks builds
        them). slots: None (no cache), or (batch (B, 1), slots (B, T)): row b's token t keeps its
        K/V in slot slots[b, t] (built once a forward). rows: this call's rows of the cache (a
        slice). moves: the previous step's roll back, (B, 2, M) cache slots (from, to) of each
        row, done here before anything reads or writes the cache."""
        B, T, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        g = H // Hkv  # grouped-query attention: K/V head j serves query heads j*g .. (j+1)*g - 1
        qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, hd)
        qk = qkv[:, :, :H + Hkv]
        if self.q_norm is not None:  # Qwen3, Gemma 3: each head's q and k normed before RoPE
            qk = torch.cat((self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])), dim=2)
        qk = apply_rope(qk, cos, sin)  # q and k heads rotated together
        q = qk[:, :, :H].transpose(1, 2)  # (B, H, T, hd)
        k = qk[:, :, H:].transpose(1, 2)  # (B, Hkv, T, hd)
        v = qkv[:, :, H + Hkv:].transpose(1, 2)
        if slots is not None:
            batch, slot = slots
            if moves is not None:  # the step before's roll back: its accepted K/V next to its committed ones
                for cache in (self.k_cache[rows], self.v_cache[rows]):
                    move_kv(cache, batch, moves[:, 0], moves[:, 1])
            # Keep this call's K/V: token t of row b in slot slot[b, t] of its cache row.
            index = (batch, slice(None), slot)  # as (B, T, Hkv, hd)
            self.k_cache[rows][index] = k.transpose(1, 2)  # a view of the buffer, written in place
            self.v_cache[rows][index] = v.transpose(1, 2)
        if own is None and prefix is None:  # a whole prompt: SDPA's causal kernel, memory linear in T
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=g > 1)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))
        return self.o_proj(self.attend(q, k, v, own, prefix, rows).to(x.dtype).transpose(1, 2).reshape(B, T, H * hd))

    def attend(self, q, k, v, own, prefix, rows):
        """q (B, H, T, hd), this call's k and v (B, Hkv, T, hd) -> (B, H, T, hd). The attention
        splits where its mask does, into parts that merge exactly (merge):

          keys:  [ committed prefix: all of it for every token | this call's T tokens ]
                   one mask entry a slot (a band if sliding)     a T x T mask
        """
        B, H, T, hd = q.shape
        Hkv = self.n_kv_heads
        g = H // Hkv
        parts = []  # (out (B, H, T, hd), lse (B, H, T, 1)) of each part
        if own is None:  # causal (a prompt's chunk): its K/V repeated for the grouped heads
            parts.append(attention_with_lse(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), self.scale,
                                            causal=True))
        elif own is not False:  # a step: the g heads of a K/V head as one query of g*T rows, under own's g masks
            out, lse = attention_with_lse(q.reshape(B, Hkv, g * T, hd), k, v, self.scale, own)
            parts.append((out.reshape(B, H, T, hd), lse.reshape(B, H, T, 1)))
        if prefix is not None:
            start, end, mask = prefix
            kc, vc = self.k_cache[rows, :, start:end], self.v_cache[rows, :, start:end]  # views, (B, Hkv, S, hd)
            if mask is not None and mask.dtype == torch.bool:  # a sliding layer's band: per token, in math
                out, lse = math_attention(q.view(B, Hkv, g, T, hd), kc, vc, self.scale, mask)
            else:  # the g heads of a K/V head folded into one query of g*T rows: K/V read once, not copied
                out, lse = attention_with_lse(q.reshape(B, Hkv, g * T, hd), kc, vc, self.scale, mask)
            parts.append((out.reshape(B, H, T, hd), lse.reshape(B, H, T, 1)))
        return merge(*parts) if len(parts) == 2 else parts[0][0]


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

    def forward(self, x, cos, sin, own, prefix, slots, rows, moves=None):
        h = self.self_attn(self.input_layernorm(x), cos, sin, own, prefix, slots, rows, moves)
        if not self.sandwich:
            x = x + h
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Rope(nn.Module):
    """RoPE's cos and sin at any positions, from frequencies kept in float32 even in a bf16 model
    (positions in the thousands need the precision); Gemma 3's sliding layers and longrope's long
    factors have tables of their own."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        longrope = bool(args.rope_scaling) and args.rope_scaling["rope_type"] == "longrope"
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.register_buffer("local_inv_freq", rope_inv_freq(args, local=True) if args.local_rope_theta else None,
                             persistent=False)
        self.register_buffer("long_inv_freq", rope_inv_freq(args, long=True) if longrope else None, persistent=False)

    def forward(self, positions, dtype, local=False, last=None):
        """cos and sin at these positions (T,) or (B, T): (T, 1, d) or (B, T, 1, d), rotate_half's
        sign in sin (apply_rope); once per forward for the layers of a kind (local: Gemma 3's sliding
        ones), in float32 at least. last: (B, 1), the last position of the prompt these positions
        belong to (a prefill, in one call or in chunks); None: decoded tokens, each by its own."""
        wide = torch.promote_types(dtype, torch.float32)
        inv_freq = self.local_inv_freq if local else self.inv_freq
        s = self.args.rope_scaling
        if self.long_inv_freq is not None and not local:
            # Longrope (Phi-3) takes its long factors past the original context. transformers picks
            # a set per forward by its largest position: a decoded token switches at `original`, a
            # longer prompt takes the long set throughout; each token here gets the set greedy gave it.
            late = (positions if last is None else last) >= s["original_max_position_embeddings"]
            inv_freq = torch.where(late[..., None], self.long_inv_freq, inv_freq)  # (..., T, d/2)
        angles = positions.to(wide)[..., None] * inv_freq.to(wide)  # (..., T, d/2)
        cos, sin = angles.cos(), angles.sin()
        if s and "attention_factor" in s and not local:  # longrope scales q.k through cos and sin
            cos, sin = cos * s["attention_factor"], sin * s["attention_factor"]
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return cos[..., None, :].to(dtype), sin[..., None, :].to(dtype)


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
        self.rope = Rope(args)
        # Gemma's embedding scale as a float32 tensor, rounded to the model's dtype as Gemma does.
        self.register_buffer("embed_scale", torch.tensor(args.embed_scale, device="cpu"), persistent=False)
        self.cache = KVCache((layer.self_attn for layer in self.layers), args)
        self.compiled = None  # a CompiledStep, see compile_steps

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def forward(self, tokens, positions=None, committed=None, mask=None, committed_range=None, read=None, cache_row=None,
                prompt_end=None, check=True, head=True, moves=None):
        """tokens (B, T) -> logits (B, T, vocab).

        Without `committed`: causal among these tokens alone, at positions 0..T-1 unless given (B, T)
        or (T,), and no cache. With committed (B, 1): row b has committed[b] tokens in slots
        [0, committed[b]) of its cache row, slot s holding position s; this call's token t sits at
        RoPE position positions[b, t], writes its K/V into slot committed[b] + t, and attends to
        the committed slots and to this call's tokens: causally (mask None: a prompt, or a chunk
        of one after the chunks before it) or where mask[b, t, u] is True (B, T, T): a decoding
        step's tree and window, any shape of them.
        committed_range: (least, most) of committed, known on the host: the cache slots read (default: read
        from committed, a host sync; a compiled step passes a bucket).
        read: compute logits only at these token indices, (R,) or per row (B, R) (the LM head is
        a large part of a small model's step, and lookahead reads few of the positions).
        cache_row: this call's one sequence is row cache_row of the cache (a prefill of a batch).
        prompt_end: the last position of the prompt a chunk belongs to (longrope's factors follow it).
        check: raise if a position reaches the model's context (one host sync; step() skips it).
        head=False: the final normed hidden states (B, T, dim) instead, to read logits in pieces.
        moves: (B, 2, M) slots, K/V copied from moves[b, 0, i] to moves[b, 1, i] of row b in
        every layer first: the step before's roll back (Attention.forward).
        """
        (B, T), dev = tokens.shape, tokens.device
        positions = (torch.arange(T, device=dev) if positions is None else positions).expand(B, T)
        if check and not torch.compiler.is_compiling() and int(positions.max()) >= self.args.max_seq_len:
            raise ValueError(f"position {int(positions.max())} is past the model's context of {self.args.max_seq_len}")
        slots, rows, lo, hi = None, None, 0, 0
        if committed is not None:
            slots = torch.arange(B, device=dev)[:, None], committed + torch.arange(T, device=dev)  # (B, 1), (B, T)
            lo, hi = committed_range if committed_range is not None else (int(committed.min()), int(committed.max()))
            rows = slice(0, B) if cache_row is None else slice(cache_row, cache_row + 1)
        full, local = self.layer_inputs(positions, committed, mask, lo, hi, prompt_end)
        x = self.embed_tokens(tokens)  # (B, T, dim)
        if self.args.embed_scale != 1.0:
            x = x * self.embed_scale.to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, *(local if self.slides and self.slides[i] else full), slots, rows, moves)
        if read is not None:
            x = x[:, read] if read.dim() == 1 else x[torch.arange(B, device=dev)[:, None], read]
        return self.lm_head(self.norm(x)) if head else self.norm(x)

    def layer_inputs(self, positions, committed, mask, lo, hi, prompt_end):
        """(cos, sin, own, prefix) for the global layers and for the sliding ones (the same tuple
        where none slides): built once a forward, shared by every layer of a kind."""
        last = None
        if mask is None:  # a prompt: longrope takes one set of factors for all of it
            last = (positions.amax(-1, keepdim=True) if prompt_end is None
                    else positions.new_full((positions.shape[0], 1), prompt_end))  # (B, 1)
        g = self.args.n_heads // self.args.n_kv_heads  # query heads a K/V head serves: its mask rows, repeated
        full = (*self.rope(positions, self.dtype, last=last), *step_masks(positions, committed, mask, lo, hi, self.dtype,
                                                                          groups=g))
        if not self.slides:
            return full, full
        local = (*(self.rope(positions, self.dtype, local=True) if self.rope.local_inv_freq is not None else full[:2]),
                 *step_masks(positions, committed, mask, lo, hi, self.dtype, self.args.sliding_window, g))
        return full, local

    def step(self, tokens, positions, committed, mask, committed_range, read=None, moves=None):
        """One decoding step of B rows: forward(tokens (B, T), positions (B, T), committed (B, 1),
        mask (B, T, T), committed_range, moves (B, 2, M) or None) -> logits (B, R, V) at `read` (B, R). A
        compiled size replays its graph (CompiledStep); anything else runs eagerly."""
        if self.compiled is not None and tokens.shape[1] in self.compiled.sizes:
            return self.compiled(tokens, positions, committed, mask, committed_range, read, moves)
        # The decoders size every step to fit the cache (<= the context): no sync to check positions.
        return self(tokens, positions, committed, mask, committed_range, read=read, check=False, moves=moves)

    def compile_steps(self, sizes, cache_len=None, log=None, backend="inductor"):
        """Compile the step for these sizes now (CompiledStep), over a cache of cache_len slots
        (backend: torch.compile's; "eager" traces the same graphs and compiles nothing)."""
        self.compiled = CompiledStep(self, sizes, cache_len, log, backend)

    @classmethod
    def from_pretrained(cls, path, device=None, dtype=None, compile=False, max_seq_len=None) -> "Transformer":
        """Load a Hugging Face checkpoint folder onto `device` (default: CUDA when there is one).

        compile: compile every step size of STEP_SIZES now (compile_steps), with a line per size,
        over a cache of max_seq_len slots (default COMPILED_CACHE, not the model's whole context).

        dtype: float32 unless given, on every device, so that lookahead's output is exactly
        greedy's; bfloat16 / float16 are faster on a GPU but round a T-token step differently
        from a 1-token one, which can flip a near-tie between the top two tokens."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        check_device_dtype(device, dtype or torch.float32)
        args = ModelArgs.from_hf_config(read_config(path))
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


class CompiledStep:
    """The step forward compiled with torch.compile once per step size, at load, so that no
    request compiles later: on CUDA as CUDA graphs ("reduce-overhead": one replay instead of
    ~1,100 kernel launches), on the CPU with inductor's C++ kernels.

    A compiled step is one sequence of T tokens and computes all T positions' logits; the cache
    is allocated once, here, with cache_len slots (default: COMPILED_CACHE, or the model's
    context if shorter; a request that needs more is refused) and one row, and kept. The width
    of cache a step reads is a symbol of the graph (dynamic=True), rounded up to a bucket of the
    committed length (cache_bucket), so one graph serves every bucket; CUDA records one
    replay per size and bucket, the first time it comes up. Warmed up under inference_mode, as the
    decoders run: a graph is specialised on it. The logits it returns are the graph's own
    buffers, overwritten by the next replay: read them before the next step.

    Every step takes the step before's roll back as MOVES (from, to) slot pairs (padded with a
    slot copied onto itself): inside the graph, never a launch of its own per layer.

    How many graphs: torch.compile keeps one list of graphs per Python function, and every
    CompiledStep shares `bucketed_step`. Sizes 2 and up share one graph (T is a symbol; size 1
    is always a graph of its own), so a model needs two; each further model in the process (a
    draft model, a second shape) two more. Dynamo allows recompile_limit graphs a function (8 by
    default) and, with fullgraph=True, raises at the next one: so each size a CompiledStep adds
    raises that allowance by one, the most it could ever need."""

    MOVES = 16  # accepted guesses a step's roll back moves inside the graph (more: done eagerly, step_inputs.pack_inputs)

    @torch.inference_mode()
    def __init__(self, model: Transformer, sizes, cache_len=None, log=None, backend="inductor"):
        self.model, dev = model, model.device
        slots = cache_len or min(COMPILED_CACHE, model.args.max_seq_len)
        # One slot more than requests may use, never read: a read of [0, width) is then never the
        # whole buffer, which the graph would otherwise be specialised on (a second graph).
        model.cache.setup(slots + 1, spare=True)
        model.cache.slots, model.cache.frozen = slots, True
        self.mode = "reduce-overhead" if dev.type == "cuda" and backend == "inductor" else None
        self.step = torch.compile(self.bucketed_step, fullgraph=True, dynamic=True, mode=self.mode, backend=backend)
        self.still = torch.zeros(1, 2, self.MOVES, dtype=torch.long, device=dev)  # no moves: slot 0 onto itself
        self.sizes = ()
        for T in sizes:
            self.add(T, log)

    @torch.inference_mode()
    def add(self, T: int, log=None):
        """Compile (or reuse the graph of) the T-token step and warm it up: model.step replays
        it from now on."""
        start, dev = time.perf_counter(), self.model.device
        dynamo = torch._dynamo.config  # one graph more allowed (the class docstring says why)
        dynamo.recompile_limit += 1
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, dynamo.recompile_limit)
        idx = torch.arange(T, device=dev)[None]  # (1, T)
        mask = torch.ones(1, T, T, dtype=torch.bool, device=dev).tril()
        # Positions and committed as distinct tensors, as the decoders pass them: a graph
        # guarded on the two being one tensor would be compiled again at the first request.
        for _ in range(3 if self.mode else 1):  # CUDA graphs record on the second or third call
            self.step(torch.zeros(1, T, dtype=torch.long, device=dev), 1 + idx,
                      torch.ones(1, 1, dtype=torch.long, device=dev), mask, self.still.clone(),
                      cache_bucket(1, self.model.cache.slots))
        self.sizes += (T,)
        log and log(f"compiled the {T}-token step in {time.perf_counter() - start:.1f} s")

    def bucketed_step(self, tokens, positions, committed, mask, moves, width):
        """The compiled function: every position's logits, reading cache slots [0, width)."""
        return self.model(tokens, positions, committed, mask, (0, width), check=False, moves=moves)

    def __call__(self, tokens, positions, committed, mask, committed_range, read=None, moves=None):
        # A graph is specialised on its inputs' strides too, and on which of them are one tensor:
        # fresh contiguous copies, as at the warm-up (a few small copies a step).
        moves = self.still if moves is None else moves
        inputs = [t.clone(memory_format=torch.contiguous_format) for t in (tokens, positions, committed, mask, moves)]
        logits = self.step(*inputs, cache_bucket(committed_range[1], self.model.cache.slots))
        return logits if read is None else logits[torch.arange(len(read), device=read.device)[:, None], read]

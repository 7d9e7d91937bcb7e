"""Attention in parts that merge exactly: what lets a decoding step's mask cost what its
distinct part costs.

A step's T tokens see two sets of keys: the committed prefix, all of it for every token of a
row (one mask entry a slot, or none), and the step's own T tokens, under a per-token T x T mask.
Each part runs as its own attention and returns, with its output, each query's log-sum-exp: the
log of its softmax's normaliser. Two parts then merge into attention over both sets at once:

    out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b) = lerp(out_b, out_a, sigmoid(lse_a - lse_b))

so no (T, S) mask is ever built, and grouped-query heads share one mask entry per token. On a
CPU a step of a few tokens is the exception (step_masks, ONE_CALL_CPU): there one fused call over
both sets under one small mask costs less than two calls and a merge.
"""
import torch
import torch.nn.functional as F


def attention_with_lse(q, k, v, scale, mask=None, causal=False):
    """softmax(q k^T * scale + mask) v and each query's log-sum-exp (the softmax's normaliser),
    so that attention over two disjoint sets of keys merges exactly (merge). q (B, h, M, hd),
    k and v (B, h, S, hd), mask additive, broadcast to (B, h, M, S) (on a GPU its last
    dimension may run past S: additive pads it, and the columns past S are never read). Fused
    through the kernels SDPA itself calls, which return the log-sum-exp too (no (M, S) scores in
    memory); in plain math elsewhere (float64 on a GPU: the fused kernel takes float32, float16
    and bfloat16 only). Returns out (B, h, M, hd) and lse (B, h, M, 1), float32 at least."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                              scale=scale)
        return out, lse[..., None]
    if q.device.type == "cuda" and q.dtype != torch.float64:
        if torch.compiler.is_compiling():  # one opaque op: the graph never sees its slices (efficient_attention_op)
            return efficient_attention_op(q, k, v, mask, scale, causal)
        return efficient_attention(q, k, v, scale, mask, causal)
    return plain_attention_with_lse(q, k, v, scale, None if mask is None else mask[..., :k.shape[2]], causal)


def plain_attention_with_lse(q, k, v, scale, mask=None, causal=False):
    """attention_with_lse in plain math (float64 on a GPU): the same shapes."""
    keep = None if mask is None else mask == 0  # (B, h, M, S) or broadcast to it
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()[None, None]  # (1, 1, M, S)
    out, lse = math_attention(q[:, :, None], k, v, scale, None if keep is None else keep[:, :, None])
    return out[:, :, 0], lse[:, :, 0]


def efficient_attention(q, k, v, scale, mask=None, causal=False):
    """attention_with_lse through the CUDA memory-efficient kernel (it also runs on meta tensors,
    which is how a CPU checks its shapes). The kernel pads lse's rows to a multiple of 32."""
    bias = None if mask is None else efficient_bias(mask, (*q.shape[:3], k.shape[2]))
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal,
                                                                      scale=scale)[:2]
    return out, lse.narrow(-1, 0, q.shape[2])[..., None]


@torch.library.custom_op("lookahead::efficient_attention", mutates_args=())
def efficient_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """efficient_attention as one operation that torch.compile does not look into. Inside it,
    the mask's padding and lse's padded rows are sliced off: views whose layout depends on
    whether the step's size (times the grouped heads) is a multiple of 16 or 32, which a
    compiled graph would guard on, one graph more for each answer. Outside, both results are
    fresh contiguous tensors, whatever the size."""
    out, lse = efficient_attention(q, k, v, scale, mask, causal)
    return out.contiguous(), lse.contiguous()


@efficient_attention_op.register_fake
def _(q, k, v, mask, scale, causal):
    return q.new_empty(q.shape), q.new_empty((*q.shape[:3], 1), dtype=torch.float32)


def efficient_bias(mask, shape):
    """An additive mask as the efficient kernel reads it in place: (B, h, M, S) for shape, its
    rows starting on 16-element boundaries; a broadcast view (no copy) where the mask's rows
    already are (additive builds them so on a GPU), else an aligned copy."""
    S = shape[-1]
    view = mask[..., :S].expand(shape)
    if view.stride(-1) == 1 and all(stride % 16 == 0 for stride, n in zip(view.stride()[:-1], view.shape[:-1]) if n > 1):
        return view  # (additive's masks start where their storage does)
    aligned = mask.new_zeros(*mask.shape[:-1], -(-S // 16) * 16)
    aligned[..., :S] = mask[..., :S]
    return aligned[..., :S].expand(shape)


def math_attention(q, k, v, scale, keep):
    """Attention in plain math, where a mask is per token over few keys: a sliding layer's band.
    q (B, Hkv, g, M, hd): the g query heads of each K/V head side by side, so that grouped heads
    share K/V without a copy; k, v (B, Hkv, S, hd); keep: bool, broadcast to (B, Hkv, g, M, S),
    (B, 1, 1, M, S) here, one entry a token whatever the heads. A query with no key gets out 0
    and lse -inf (merge gives it no weight). Returns out (B, Hkv, g, M, hd), lse (..., M, 1)."""
    B, Hkv, g, M, hd = q.shape
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(wide).reshape(B, Hkv, g * M, hd) @ k.to(wide).transpose(-1, -2)) * scale  # (B, Hkv, g*M, S)
    scores = scores.view(B, Hkv, g, M, -1)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    p = (scores - lse.nan_to_num(neginf=0.0)).exp()
    return (p.view(B, Hkv, g * M, -1) @ v.to(wide)).view(B, Hkv, g, M, hd), lse


def merge(a, b):
    """Attention over the keys of a and of b together, from each one's (out, lse): a's share of
    the joint softmax's mass is e^lse_a / (e^lse_a + e^lse_b) = sigmoid(lse_a - lse_b)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    wide = lse_a.dtype
    return torch.lerp(out_b.to(wide), out_a.to(wide), torch.sigmoid(lse_a - lse_b))


# The most tokens a step may hold for its own keys to be read with the committed ones in one call
# on a CPU (step_masks): SmolLM2-135M on a 2-core EPYC, 200 tokens committed, a step of 2 to 64
# tokens took 2-6% less time so; 128 tokens, or 2,500 committed and 8 tokens, the same or more
# (docs/PERFORMANCE.md).
ONE_CALL_CPU = 32


def step_masks(positions, committed, mask, lo: int, hi: int, dtype, sliding_window=None, groups=1):
    """What a call's tokens attend to in the layers of one kind (sliding_window: a sliding layer's
    width), as (own, prefix) for model.Attention: built once a forward, in the dtype the kernels
    read, shared by those layers.

    own: None (causal), False (a one-token step, or a few tokens on a CPU: their slots are read
    with the committed ones, under prefix's mask), or an additive (B, 1, groups * T, T) mask:
    the T x T mask once for each of the `groups` query heads that share a K/V head, as Attention
    folds them into one query of groups * T rows (so that no layer copies K or V for its grouped
    heads). prefix: None, or (start, end, mask) over
    cache slots [start, end): one entry a row and slot (B, 1, 1, S), or none at all when every
    row sees every slot read, or with own False for a few tokens on a CPU [ committed | own ]
    (B, 1, groups * T, S); a sliding layer's band (keys at q_pos - sliding_window < p <= q_pos) is
    per token, a bool (B, 1, 1, T, S)."""
    B, T = positions.shape
    own = None  # causal
    if mask is not None or (sliding_window and T > sliding_window):
        keep = torch.ones(B, T, T, dtype=torch.bool, device=positions.device).tril() if mask is None else mask
        if sliding_window:
            keep = keep & (positions[:, :, None] - positions[:, None, :] < sliding_window)
        own = additive(keep.repeat(1, groups, 1), dtype)[:, None]  # (B, 1, groups * T, T; on a GPU padded to 16)
    if committed is None or hi == 0:
        return own, None
    end = hi
    if mask is not None and T == 1 and lo == hi:  # one token a row, every row as long: its own
        own, end = False, hi + 1  # slot read with the committed ones, one fused call and no mask
        committed = committed + 1
    elif mask is not None and lo == hi and T <= ONE_CALL_CPU and not sliding_window and positions.device.type == "cpu":
        # A few tokens a row on a CPU, every row as long: their own slots, just written after the
        # committed ones, read with them in one fused call under one (groups * T, hi + T) mask
        # [ committed: 0 | own ]. On a CPU two calls and a merge cost more than this mask.
        both = own.new_zeros(B, 1, groups * T, hi + T)
        both[..., hi:] = own
        return False, (0, hi + T, both)
    start = max(0, lo - sliding_window + 1) if sliding_window else 0
    slot = torch.arange(start, end, device=positions.device)
    seen = slot < committed  # (B, S): each row's committed slots
    if sliding_window:
        band = seen[:, None, :] & (positions[:, :, None] - slot < sliding_window)  # (B, T, S)
        return own, (start, end, band[:, None, None])
    return own, (start, end, None if lo == hi else additive(seen, dtype)[:, None, None])  # (B, 1, 1, S)


def additive(keep, dtype, padded=None):
    """A boolean mask as attention's additive one: 0 where kept, -inf elsewhere. On a GPU
    (padded, by default where keep is on CUDA) its last dimension is rounded up to 16, the
    added columns masked too and never read: every row then starts on a 16-element boundary,
    where efficient_bias reads it in place in every layer, and it is a tensor of its own, not a
    view of a wider one (a compiled step would guard on the view's layout)."""
    if not (keep.device.type == "cuda" if padded is None else padded):
        return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))
    S = keep.shape[-1]
    keep = F.pad(keep, (0, -(-S // 16) * 16 - S))  # (..., S rounded up to 16): False past S
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))

"""The KV cache: every layer's keys and values, allocated once and written in place.

Each layer's K and V are buffers of its Attention, (rows, n_kv_heads, slots, head_dim): a row
per sequence of a batch, slot s holding the token at position s of that row. A decoding step
writes its tokens' K/V right after a row's committed slots; the roll back then moves the
accepted ones down to follow the committed ones (the next step's forward does it, in every layer
before it reads the cache), and whatever it did not keep lies past the committed length,
overwritten by the next step. Nothing is reallocated, nothing concatenated.
"""
import torch


class KVCache:
    """The model's cache, over its layers' Attention buffers (k_cache, v_cache). Buffers, not
    plain tensors: a compiled step then writes them where they are (a static address)."""

    def __init__(self, attentions, args):
        self.attentions, self.args = list(attentions), args
        self.slots = 0  # 0: none set up (the decoders track what is committed)
        self.frozen = False  # a compiled model keeps the cache it was compiled with

    def setup(self, slots: int, rows: int = 1, spare: bool = False):
        """Allocate (rows, n_kv_heads, slots, head_dim) K and V for each layer; spare: one slot
        past the model's context (a compiled cache's, never read)."""
        if slots > self.args.max_seq_len + spare:
            raise ValueError(f"cache of {slots} exceeds the model's context of {self.args.max_seq_len}")
        if self.frozen:
            raise ValueError("a compiled model keeps the cache it was compiled with")
        a, like = self.args, self.attentions[0].qkv_proj.weight
        for attn in self.attentions:
            attn.k_cache, attn.v_cache = (torch.zeros(rows, a.n_kv_heads, slots, a.head_dim, dtype=like.dtype,
                                                      device=like.device) for _ in "kv")
        self.slots = slots

    @property
    def rows(self) -> int:
        return self.attentions[0].k_cache.shape[0] if self.slots else 0

    def keep_rows(self, rows: list[int], used: int):
        """Keep only these rows, in this order (a batch whose other sequences finished), so that
        finished rows cost nothing after: their slots [0, used) move up in place, once, and each
        buffer becomes a view of its first len(rows) rows."""
        index, n = torch.tensor(rows, device=self.attentions[0].k_cache.device), len(rows)
        for attn in self.attentions:
            for cache in (attn.k_cache, attn.v_cache):
                cache[:n, :, :used] = cache[index, :, :used]  # gathered first, then written
            attn.k_cache, attn.v_cache = attn.k_cache[:n], attn.v_cache[:n]

    def rollback(self, moves: list[list[tuple[int, int]]]):
        """Copy row b's K/V from slot `from` to slot `to` for each (from, to) of moves[b]
        (lookahead.rollback_moves), in every layer: one gather and scatter per layer for all
        rows, now. The engine defers them into the next step's forward instead
        (model.Attention's `moves`, the same move_kv); this is for when no forward follows."""
        n, dev = max(map(len, moves)), self.attentions[0].k_cache.device
        if not n:
            return
        pairs = torch.tensor([m + [(0, 0)] * (n - len(m)) for m in moves], device=dev)  # (B, n, 2); (0, 0): a no-op
        rows = torch.arange(len(moves), device=dev)[:, None]
        for attn in self.attentions:
            for cache in (attn.k_cache, attn.v_cache):
                move_kv(cache, rows, pairs[..., 0], pairs[..., 1])

    def kv(self) -> torch.Tensor:
        """Every layer's K and V stacked, (n_layers, 2, rows, n_kv_heads, slots, head_dim): a
        copy, to inspect the cache."""
        return torch.stack([torch.stack((a.k_cache, a.v_cache)) for a in self.attentions])


def move_kv(cache, rows, moves_from, moves_to):
    """The roll back's copy in one layer's K or V (B, n_kv_heads, slots, head_dim): row rows[b]'s
    slot moves_from[b, i] to moves_to[b, i], every one gathered before any is written, so moves
    that overlap (a slot both read and written) are safe."""
    cache[rows, :, moves_to] = cache[rows, :, moves_from]

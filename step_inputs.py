"""A step's inputs as the engine builds them: every row's tokens, positions and mask written
into one buffer kept from step to step, read by the forward through views made once per layout,
sent to a device in one copy. lookahead.step_mask is the same mask, built plainly (tested equal).

    [ row 0's (T x T) mask | row 1's | ... | ints: tokens, positions, C, read, moves ]

A step's mask follows from its shape but for the trie's part: the window's and the padding's
entries are made once per shape (mask_template) and copied in; a guess's entries are its
parent's plus itself. Plain Python over bytes: no tensor is made on the host for a layout seen
before (docs/PERFORMANCE.md, host work a step).
"""
import weakref
from array import array
from functools import lru_cache

import torch

@lru_cache(maxsize=None)
def window_layout(W: int, L: int):
    """The window's part of lookahead.step_mask as bytes, made once per (W, L): for each of its
    W*L tokens, what it attends to among the window's W*L (1 = may attend; each also attends to
    `last`), and its position after C: token (level l, column j) sees level 0 up to column j and
    its own column up to level l, at C + 1 + j + l."""
    queries, offsets = [], []
    for level in range(L):
        for j in range(W):
            line = bytearray(W * L)
            line[:j + 1] = b"\1" * (j + 1)  # level 0, columns 0..j
            for up in range(1, level + 1):
                line[up * W + j] = 1  # own column, levels 1..level
            queries.append(bytes(line))
            offsets.append(1 + j + level)
    return queries, offsets


@lru_cache(maxsize=512)
def mask_template(n: int, w: int, L: int, size: int):
    """A row's (size x size) mask after a trie of n nodes, but for the trie's own queries (zero;
    row_inputs fills them): the window's w columns x L levels (window_layout, past the trie;
    each also attends to `last`), then padding (itself only); and their positions after C.
    They follow from the shape alone, so a step copies them in at once."""
    T = n + w * L
    mask, offsets = bytearray(size * size), [0] * (size - n)
    if L:
        queries, offsets[:T - n] = window_layout(w, L)
        for q, line in enumerate(queries, start=n):
            mask[q * size] = 1  # `last`
            mask[q * size + n:q * size + T] = line
    for p in range(T, size):
        mask[p * size + p] = 1
    return bytes(mask), offsets


def row_inputs(tree, window, w: int, size: int, mask=None):
    """One row's step laid out as

        [ trie: last, guesses | window: w columns x L levels | padding ]

    -> tokens, positions after C (lists of `size`), the (size x size) mask as bytes (query by
    query, 1 = may attend; lookahead.step_mask's, padded), written into `mask` where given (the
    step's buffer: the mask is the step's largest input, so it is written once, where the
    forward reads it), and the positions whose logits are read: every trie node, then the
    newest window level. Padding attends only to itself."""
    n, L = len(tree), len(window) if w else 0
    template, offsets = mask_template(n, w, L, size)
    if mask is None:
        mask = bytearray(template)
    else:
        mask[:] = template
    mask[0] = 1
    for i in range(1, n):  # a guess sees what its parent sees, and itself
        p = tree.parent[i]
        mask[i * size:i * size + n] = mask[p * size:p * size + n]
        mask[i * size + i] = 1
    tokens = tree.tokens + [t for level in window[:L] for t in level[:w]] + [0] * (size - n - w * L)
    read = list(range(n)) + list(range(n + (L - 1) * w, n + L * w))
    return tokens, tree.depth + offsets, mask, read


# A row's inputs after the masks, in the buffer's order, and how many int64s each takes for a
# step of T tokens with room for S moves: pack_inputs writes them in this order, StepBuffer.views
# splits them by these sizes, step_buffer makes room by their sum. The one place they are defined.
ROW_INTS = ("tokens", "positions", "committed", "read", "moves")


def row_ints(T: int, S: int) -> tuple[int, ...]:
    """The sizes of ROW_INTS: T tokens, T positions, 1 committed length, T read (padded), and
    S moves from then S moves to."""
    return T, T, 1, T, 2 * S


class StepBuffer:
    """Where a step's inputs are written: one host buffer kept from step to step (on a GPU, with
    a device twin that one copy fills). For B rows of T tokens and room for S moves it holds the
    rows' (T x T) masks, then each row's ints at fixed places (ROW_INTS),

        [ tokens: T | positions: T | committed: 1 | read: T | moves from: S | moves to: S ]

    so the tensors a step reads are views made once per (B, T, S) and kept, the positions read
    (R of T) and the moves (M of S) kept slices of them: a step makes no tensor on the host. A
    model keeps its buffer from one request to the next (step_buffer), so the views a request
    needs were mostly made before.

    On a GPU the host buffer is page-locked (pinned) and the copy asynchronous: a greedy step's
    one sync is reading its predictions. The host buffer is written again only by the next step,
    after those predictions were read, so the copy has finished by then."""

    def __init__(self, device: torch.device):
        self.device, self.layouts, self.read_slices, self.move_slices = device, {}, {}, {}
        self.pinned = device.type == "cuda"
        self.host, self.pinned_host = bytearray(), None  # pinned_host: the pinned tensor under `host`

    def masks(self, B: int, T: int) -> list[memoryview]:
        """Where each row's mask goes (row_inputs writes it)."""
        self.room(B * T * T)
        buffer = memoryview(self.host)
        return [buffer[b * T * T:(b + 1) * T * T] for b in range(B)]

    def room(self, end: int):
        if end > len(self.host):  # a larger step than any before: a new buffer (what it holds kept), new views
            old, n = self.host, 2 * end
            if self.pinned:
                self.pinned_host = torch.zeros(n, dtype=torch.uint8, pin_memory=True)
                self.host = memoryview(self.pinned_host.numpy())
            else:
                self.host = bytearray(n)
            self.host[:len(old)] = old
            self.layouts, self.read_slices, self.move_slices = {}, {}, {}

    def load(self, ints: array, B: int, T: int, S: int, R: int, M: int) -> tuple:
        """Write the step's ints (int64) after the masks -> tokens (B, T), positions (B, T),
        committed (B, 1), the mask (B, T, T), read (B, R), moves (B, 2, M) or None."""
        start = self.ints_at(B, T)
        end = start + 8 * len(ints)
        self.room(end)
        memoryview(self.host)[start:end] = memoryview(ints).cast("B")
        layout = self.layouts.get((B, T, S))
        if layout is None:
            layout = self.layouts[B, T, S] = self.views(B, T, S, start, end)
        copy, (tokens, positions, C, reads, moves, mask) = layout
        if copy is not None:
            copy[0].copy_(copy[1], non_blocking=True)  # the step's one host-to-device copy: no sync
        read = self.read_slices.get((B, T, S, R))  # each kept apart: R changes most steps, M seldom
        if read is None:
            read = self.read_slices[B, T, S, R] = reads[:, :R]
        moved = self.move_slices.get((B, T, S, M))
        if moved is None:
            moved = self.move_slices[B, T, S, M] = moves[:, :, :M] if M else None
        return tokens, positions, C, mask, read, moved

    @staticmethod
    def ints_at(B: int, T: int) -> int:
        """Where a step's ints start in the buffer: 8-aligned after its B (T x T) masks."""
        return -(-B * T * T // 8) * 8

    def views(self, B: int, T: int, S: int, start: int, end: int):
        """A layout's tensors, over the host buffer itself on the CPU; elsewhere over a device
        buffer of its own, with the (device, host) pair that load copies between."""
        data = source = (self.pinned_host[:end] if self.pinned_host is not None
                         else torch.frombuffer(self.host, dtype=torch.uint8, count=end))
        copy = None
        if self.device.type != "cpu":
            data = torch.empty(end, dtype=torch.uint8, device=self.device)
            copy = data, source
        numbers = data[start:end].view(torch.int64).view(B, -1)
        tokens, positions, C, reads, moves = numbers.split_with_sizes(row_ints(T, S), 1)  # ROW_INTS
        return copy, (tokens, positions, C, reads, moves.view(B, 2, S), data[:B * T * T].view(torch.bool).view(B, T, T))


# Each process keeps one StepBuffer per model: a request reuses the views earlier ones made.
STEP_BUFFERS = weakref.WeakKeyDictionary()


def step_buffer(model, B: int, T: int) -> StepBuffer:
    """The model's StepBuffer (a new one where none is kept, or the model moved to another
    device), with room for B rows of T tokens: one that grew mid-request would remake its views."""
    buffer = STEP_BUFFERS.get(model)
    if buffer is None or buffer.device != model.device:
        buffer = STEP_BUFFERS[model] = StepBuffer(model.device)
    buffer.room(StepBuffer.ints_at(B, T) + 8 * B * sum(row_ints(T, max(16, T))))  # (moves' room S <= max(16, T))
    return buffer


def pack_inputs(model, rows, parts: list, T: int, buffer: StepBuffer):
    """The step's inputs: its ints (int64) written into the buffer after the masks (on a
    device, sent in ONE host-to-device copy: one a tensor would be a sync point each on a GPU)
    and read as tokens (B, T), positions (B, T), committed (B, 1), the in-step mask (B, T, T),
    the committed_range of committed lengths (host), the positions read (B, R) and the step before's roll
    back, (B, 2, M) slots (from, to), padded with slot 0 onto itself (None: none); the rows'
    moves, sent, are cleared. parts: each row's row_inputs, its mask written in buffer.masks."""
    # The rows' most positions read (R) and moves (M), and least and most committed lengths: one
    # loop, as after a CPU forward each generator expression's code starts cold.
    B, R, M, low, high = len(rows), 0, 0, rows[0].C, rows[0].C
    for row, (*_, read) in zip(rows, parts):
        R, M, low, high = max(R, len(read)), max(M, len(row.moves)), min(low, row.C), max(high, row.C)
    if model.compiled is not None and M:  # a compiled step takes a fixed number of moves
        if M > model.compiled.MOVES:  # more than its graph takes: done eagerly, once
            rollback_now(model, rows)
        M = model.compiled.MOVES
    S = max(16, 1 << (M - 1).bit_length())  # room for the moves: 16, or a power of two past it
    ints = array("q")
    for row, (tokens, offsets, _, read) in zip(rows, parts):
        moves = row.moves + [(0, 0)] * (S - len(row.moves))
        ints.fromlist(tokens + [row.C + o for o in offsets] + [row.C] + read + read[:1] * (T - len(read)) +
                      [s for s, _ in moves] + [d for _, d in moves])  # in ROW_INTS' order, row_ints' sizes
        row.moves = []
    tokens, positions, C, mask, read, moves = buffer.load(ints, B, T, S, R, M)
    return tokens, positions, C, mask, (low, high), read, moves


def rollback_now(model, rows):
    """Roll back the rows' last step now, eagerly (rows are leaving the cache, or the request
    ends): what the next forward would have done."""
    if any(row.moves for row in rows):
        model.cache.rollback([row.moves for row in rows])
    for row in rows:
        row.moves = []



"""Lookahead decoding (Fu, Bailis, Stoica, Zhang, ICML 2024, arXiv 2402.02057), exactly greedy.

Greedy decoding is the fixed point of y_i = argmax p(. | prompt, y_<i) for all future i at once.
Jacobi iteration guesses many future tokens and refines them in parallel; each refined guess
drags an n-gram behind it. Lookahead decoding keeps a 2-D window of those guesses, pools the
n-grams they trace, and in the SAME forward verifies the pooled n-grams that start with the last
token: what verification accepts is exactly what greedy decoding produces.

Words (one meaning each):
  step       one forward of the model, after which 1 to N tokens are committed
  row        one prompt of a batch (its state: a Sequence); a single prompt is a batch of one
  C, last    a row's committed length; `last` is its newest committed token, in slot C
  guess      a guessed token waiting for verification: a node of the trie
  candidate  a chain of guesses continuing `last`, from one draft source (drafts.py)
  window     W columns x (N-1) levels of tokens refined by Jacobi iteration; its columns' tokens
             plus the model's prediction after them are n-grams (N tokens)
  pool       the n-grams seen so far, by first token; those starting with `last` are candidates
  trie       the candidates merged on shared prefixes: each distinct guess is run once
  commit     append the accepted guesses and the model's next token to the output
  roll back  keep only the committed tokens' K/V in the cache
  shape      what a step runs: window columns, guesses, tokens in all (the paper's W, N, G)
  policy     who chooses the shape (shape.py): the paper's FixedShape, or the DynamicShape

One step (lookahead_step), numbered as in the code:

    1 propose -> 2 plan -> 3 inputs -> 4 forward -> 5 verify -> 6 window -> 7 commit -> 8 roll back
    (pool,       (shape)   (tokens,    (the        (the model's  (Jacobi     (accepted    (keep the
     Jacobi                 one mask)   model)      own choice)   update,     guesses +    committed
     guess: trie)                                                 pool)       next token)  K/V)

Up to the divider: the algorithm for one greedy sequence. After it: batches, sampling, and
what other draft sources (drafts.py) and the dynamic policy (shape.py) need.
"""
import random
import time
import weakref
from array import array
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from decoding import Generation, before_step, check_requests, drop_finished, ensure_cache, per_row
from drafts import Candidate, DraftSource, predictions, prefill_with_rankings, token_back
from sampling import Sampling, verify_sampled
from shape import Shape, shape_policy


class NGramPool(DraftSource):
    """The paper's draft source: n-grams seen so far (the prompt's, the window's, the committed
    text's) by first token, at most `cap` a key, least recently seen evicted first. Each keeps the
    tokens seen right before it and whether the window made it."""

    def __init__(self, cap: int):
        self.cap = cap
        self.by_key: dict[int, dict] = {}  # first token -> {rest: [tokens before it, from window?]}, oldest first

    def remember(self, memory):
        self.by_key = memory.ngrams  # shared: what other rows and requests pooled (drafts.Memory)

    def add(self, ngram, before=None, from_window=False):
        if self.cap == 0:
            return
        key, rest = ngram[0], tuple(ngram[1:])
        entries = self.by_key.get(key)
        if entries is None:
            entries = {}
        self.by_key[key] = entries  # (written again: a Memory keeps the recently written)
        entry = entries.pop(rest, None)  # (a plain dict, least recent first: it touches less memory than an OrderedDict)
        if entry is None:
            entry = [(), from_window]  # (the tokens seen before it: a tuple, as most have one; a set is 4x the memory)
            if len(entries) >= self.cap:  # (>=: a shared Memory may hold what a larger cap pooled)
                del entries[next(iter(entries))]
        entries[rest] = entry
        if before is not None and before not in entry[0]:
            entry[0] += (before,)

    def ranked(self, key, before=None) -> list[tuple]:
        """The continuations of `key` as (rest, seen after `before`?, from the window?): those seen
        after `before` (the token before `key` now: two tokens of context pick better) first, most
        recent first in each."""
        entries = [(rest, before in seen, win) for rest, (seen, win) in reversed(self.by_key.get(key, {}).items())]
        return [e for e in entries if e[1]] + [e for e in entries if not e[1]]

    def propose(self, seq, k):  # "pool2": seen after the token before `last` too (likelier); "pool1": not
        return [Candidate(rest[:k], "pool2", win, prior=0.5) if after else Candidate(rest[:k], "pool1", win, prior=0.3)
                for rest, after, win in self.ranked(seq.tokens[-1], token_back(seq, 2))]


class JacobiGuess(DraftSource):
    """This project's addition beside the paper's pooled n-grams: the model's own predictions
    left over from the step before. The rows after the first rejected guess predicted what
    follows the commit from a context wrong in one token: as in Jacobi decoding, a guess for the
    next step, and often right.

        accepted   last  a0         rejected: a1 (the model said b)   commits a0, b
        rows       a1 -> p1, a2 -> p2            Jacobi guess next step: [p1, p2]
    """

    def __init__(self):
        self.guess = []

    def propose(self, seq, k):
        return [Candidate(tuple(self.guess[:k]), "jacobi")] if self.guess else []

    def observe(self, seq, step):
        tree = step.tree
        rejected = next(iter(tree.children[step.path[-1] if step.path else 0].values()), None)
        self.guess = [step.pred[v] for v in tree.first_chain(rejected)] if rejected else []


class Tree:
    """The trie of one step's guesses: the candidates merged on shared prefixes.

    Node 0 is `last`; every other node is a guess whose context is its chain of ancestors, at
    position C + depth. Candidates that share a prefix share its nodes, so a step verifies all
    of them for the price of their distinct tokens:

        candidates  a b c  |  a b d  |  a e f  |  g h i        last
                                                            /        \\
        trie                                               a           g
                                                         /   \\         \\
                                                        b     e         h
                                                       / \\     \\         \\
                                                      c   d     f         i

    Children keep the candidates' order (dicts keep insertion order), so the first child is
    the best-ranked candidate through a node; origin[node] is that candidate's index."""

    def __init__(self, last: int, candidates=()):
        self.tokens, self.parent, self.depth, self.origin = [last], [-1], [0], [None]
        self.children: list[dict] = [{}]  # node -> {token: child node}
        self.candidates: list[Candidate] = []
        for candidate in candidates:
            self.add(candidate)

    def add(self, candidate: Candidate):
        if not candidate.tokens:
            return
        v = 0
        for tok in candidate.tokens:
            child = self.children[v].get(tok)
            if child is None:
                child = len(self.tokens)
                self.children[v][tok] = child
                self.tokens.append(tok)
                self.parent.append(v)
                self.depth.append(self.depth[v] + 1)
                self.origin.append(len(self.candidates))
                self.children.append({})
            v = child
        self.candidates.append(candidate)

    def __len__(self):
        return len(self.tokens)

    def first_chain(self, node) -> list[int]:
        """Node, its first child, that one's first child, ...: the best-ranked candidate's rest."""
        out = [node]
        while self.children[out[-1]]:
            out.append(next(iter(self.children[out[-1]].values())))
        return out


@lru_cache(maxsize=None)
def window_layout(W: int, L: int):
    """The window's part of a step's mask, built once per shape: each of its W*L rows as bytes over
    the window's W*L columns (1 = may attend; every row also attends to `last`), and each row's
    position after C.

    Row r = (level l, column j) attends to `last`, to level 0 up to column j, and to its own
    column up to level l; it stands at position C + 1 + j + l. W=3, L=2; 'x' = may attend:

                      last  level 0   level 1      position
                       .   a0 a1 a2  b0 b1 b2      (C + ...)
        level 0    a0  x   x                          1
                   a1  x   x  x                       2
                   a2  x   x  x  x                    3
        level 1    b0  x   x         x                2
                   b1  x   x  x         x             3
                   b2  x   x  x  x         x          4

    Level 0 is a guessed continuation of `last` (a causal run); level l, column j was predicted
    from level l-1, column j a step ago."""
    rows, offsets = [], []
    for level in range(L):
        for j in range(W):
            row = bytearray(W * L)
            row[:j + 1] = b"\1" * (j + 1)  # level 0, columns 0..j
            for up in range(1, level + 1):
                row[up * W + j] = 1  # own column, levels 1..level
            rows.append(bytes(row))
            offsets.append(1 + j + level)
    return rows, offsets


@lru_cache(maxsize=512)
def mask_template(n: int, w: int, L: int, size: int):
    """A row's (size x size) mask after a trie of n nodes, but for the trie's own rows (zero;
    step_inputs fills them): the window's w columns x L levels (window_layout, past the trie;
    each row also attends to `last`), then padding (itself only); and those rows' positions
    after C. They follow from the shape alone, so a step copies them in at once (made once per
    shape)."""
    T = n + w * L
    block, offsets = bytearray(size * size), [0] * (size - n)
    if L:
        rows, offsets[:T - n] = window_layout(w, L)
        for r, row in enumerate(rows, start=n):
            block[r * size] = 1  # `last`
            block[r * size + n:r * size + T] = row
    for p in range(T, size):
        block[p * size + p] = 1
    return bytes(block), offsets


def step_inputs(tree: Tree, window, w: int, size: int, block=None):
    """One row's step laid out as

        [ trie: last, guesses | window: w columns x L levels | padding ]

    -> tokens, positions after C (lists of `size`), the (size x size) in-step mask as bytes
    (row-major, 1 = may attend), written into `block` where given (the step's buffer: the mask
    is the step's largest input, so it is written once, where the forward reads it), and the
    positions whose logits are read: every trie node (the logits at node i predict the token
    after it), then the newest window level (its predictions are the next level). Padding
    attends only to itself. Plain Python and one buffer: a step's host work is this, not a few
    dozen small tensor operations."""
    n, L = len(tree), len(window) if w else 0
    template, offsets = mask_template(n, w, L, size)  # the window's rows and the padding's: fixed by the shape
    if block is None:
        block = bytearray(template)
    else:
        block[:] = template
    block[0] = 1
    for i in range(1, n):  # a guess sees what its parent sees, and itself
        p = tree.parent[i]
        block[i * size:i * size + n] = block[p * size:p * size + n]
        block[i * size + i] = 1
    tokens = tree.tokens + [t for level in window[:L] for t in level[:w]] + [0] * (size - n - w * L)
    read = list(range(n)) + list(range(n + (L - 1) * w, n + L * w))
    return tokens, tree.depth + offsets, block, read


def verify_greedy(tree: Tree, pred) -> tuple[list[int], int]:
    """5. Greedy verification -> (accepted nodes, bonus token), pred[i] the model's next token
    after node i. From `last`, follow the child the model predicted while there is one: those
    guesses are greedy's tokens, and the prediction after the last of them comes free."""
    path, v = [], 0
    while (child := tree.children[v].get(pred[v])) is not None:
        path.append(child)
        v = child
    return path, pred[v]


@dataclass
class Verified:
    """What one row's step did, for the draft sources, the policy and --explain."""
    tree: Tree
    w: int  # window columns run
    read: list[int]  # the token at every position read: the trie's nodes, the newest window level
    pred: list[int]  # the model's next token after each
    rankings: list[list[int]] | None  # its best tokens after each, if a draft source reads them
    path: list[int]  # the accepted nodes
    committed: list[int]
    slots: list[int]  # the cache slots holding the committed tokens' K/V (`last`'s first)
    shape: Shape = None
    window: list = None  # its levels as run
    pooled: list = None  # the n-grams its columns completed

    @property
    def winner(self) -> int | None:  # the candidate whose guesses were accepted (the first through them)
        return self.tree.origin[self.path[-1]] if self.path else None


class Sequence:
    """One row's state: committed tokens, window, pool, draft sources."""

    def __init__(self, prompt_ids, max_new_tokens, policy, sampling, seed, stop, dev, output_ngrams, drafts, memory):
        self.prompt, self.max_new, self.stop, self.N = list(prompt_ids), max_new_tokens, stop, policy.N
        self.sampling, self.output_ngrams = sampling, output_ngrams
        self.C = len(prompt_ids)  # committed slots: `last` (tokens[-1]) sits at slot and position C
        self.tokens = []
        self.out = Generation(self.tokens, 0, 0.0)  # the same list: its tokens grow with commit
        self.window = []  # up to N-1 levels; a new column starts from a random prompt token (seeded)
        self.window_rng, self.rng = random.Random(seed), random.Random(seed + 1)
        self.gen = torch.Generator(dev).manual_seed(seed)  # sampling's draws, seeded like the window
        # The sources, the pool's first (the paper's); each step the policy asks some or all of them.
        self.pool = NGramPool(policy.pool_cap)
        self.sources = sorted(drafts(self) if drafts else [self.pool, JacobiGuess()], key=lambda s: s is not self.pool)
        for source in {self.pool, *self.sources} if memory is not None else ():
            source.remember(memory)  # what they learn outlives the request (drafts.Memory)
        # The pool starts with the prompt's n-grams: answers copy their prompt.
        for i in range(len(self.prompt) - self.N + 1):
            self.pool.add(self.prompt[i:i + self.N], self.prompt[i - 1] if i else None)
        self.asked, self.jacobi = self.sources, next((s for s in self.sources if isinstance(s, JacobiGuess)), None)
        self.spent = {s: 0.0 for s in self.sources}  # seconds in each source's hooks (the policy weighs them)
        self.made_by = {}  # Candidate.source label -> the source that proposed it
        self.worth_guessing = 0  # guesses the coming steps are expected to hold (set before each step)
        self.moves = []  # the last step's roll back, (from, to) cache slots, done by the next forward

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new or bool(self.tokens) and self.tokens[-1] in self.stop

    def propose(self, policy) -> list[Candidate]:
        """The asked sources' candidates in the sources' order, as many of each as the policy
        takes, none past max_new_tokens."""
        k, out = self.max_new - len(self.tokens) - 1, []
        for source in self.asked if k > 0 else ():
            start = time.perf_counter()
            for c in source.propose(self, k)[:policy.takes(source is self.pool)]:
                if not c.tokens:
                    continue
                if len(c.tokens) > k or type(c.tokens) is not tuple:  # (only then: a replace costs ~2 us)
                    c = replace(c, tokens=tuple(c.tokens[:k]))
                out.append(c)
                self.made_by[c.source] = source
            self.spent[source] += time.perf_counter() - start
        return out

    def observed(self, step):
        """Every source sees the step (asked this step or not); its seconds counted."""
        for source in self.sources:
            start = time.perf_counter()
            source.observe(self, step)
            self.spent[source] += time.perf_counter() - start

    def inputs(self, tree: Tree, w: int, size: int, block):
        """step_inputs with w window columns (a new one starts from a random prompt token), the
        mask written into `block`."""
        if w:
            fresh = lambda n: [self.window_rng.choice(self.prompt) for _ in range(n)]
            self.window = [level if len(level) == w else level[:w] + fresh(w - len(level))
                           for level in self.window] or [fresh(w)]
        return step_inputs(tree, self.window, w, size, block)

    def advance(self, tree: Tree, w: int, pred: list[int], rankings, path: list[int], bonus: int,
                shape: Shape) -> Verified:
        """6 and 7, once verification accepted `path` and `bonus`; the K/V to keep (8) are in
        `slots`: `last`'s, then each accepted node i's, in slot C + i."""
        slots = [self.C] + [self.C + v for v in path]
        self.moves = [(s, d) for d, s in enumerate(slots, start=self.C) if s != d]  # 8, for the next forward
        self.C += len(slots)
        window = self.window[:] if w else []  # (its levels, w long, are never changed: new ones replace them)
        read = tree.tokens + (window[-1] if w else [])
        # 6. The window moves on before the commit pools the committed text's n-grams.
        pooled = self.update_window(tree.tokens[0], pred[len(tree):len(tree) + w])
        # 7. Commit, stopping exactly where greedy would; then every draft source sees the step.
        committed = self.commit([tree.tokens[v] for v in path] + [bonus])
        step = Verified(tree, w, read, pred, rankings, path, committed, slots, shape, window, pooled)
        self.observed(step)
        self.out.steps += 1
        self.out.committed.append(len(committed))
        self.out.shapes.append(shape)
        return step

    def update_window(self, last: int, new_level: list[int]) -> list[list[int]]:
        """6. One Jacobi iteration: the newest level's predictions are a new level; once the
        window is full, each column plus its prediction is an n-gram for the pool (returned), and
        the oldest level drops out. Positions stay relative to `last` (not realigned after a
        multi-token step: acceptance pays, never exactness)."""
        window, pooled = self.window, []
        if not new_level:
            return pooled  # no window this step
        if len(window) == self.N - 1:
            pooled = list(zip(*window, new_level))  # column j, top to bottom, and its prediction
            # column j's trajectory continues level 0 after its column j-1 (or `last`)
            for ngram, before in zip(pooled, [last, *window[0]]):
                self.pool.add(ngram, before, from_window=True)
            window.pop(0)
        window.append(new_level)
        return pooled

    def commit(self, new_tokens) -> list[int]:
        """7. Append tokens, cut where greedy stops (a stop id, max_new_tokens); pool the n-grams
        ending in them. Returns what was kept."""
        new_tokens = new_tokens[:self.max_new - len(self.tokens)]
        new_tokens = new_tokens[:next((i + 1 for i, t in enumerate(new_tokens) if t in self.stop), None)]
        self.tokens += new_tokens
        if self.output_ngrams:  # the text's last N + len(new) tokens: the new n-grams and the token before
            N, k = self.N, self.N + len(new_tokens)
            text = self.tokens[-k:] if len(self.tokens) >= k else self.prompt[len(self.tokens) - k:] + self.tokens
            for end in range(max(N, len(text) - len(new_tokens) + 1), len(text) + 1):
                self.pool.add(text[end - N:end], text[end - N - 1] if end > N else None)
        return new_tokens


def lookahead_step(model, policy, rows: list[Sequence], buffer: "StepBuffer", on_step=None):
    """One forward for every row: the eight parts of the module docstring."""
    start = time.perf_counter()
    limit = before_step(model, policy, rows)  # the most tokens a step may hold: cache and policy
    # 1. Propose: the asked sources' candidates (the pool's n-grams that start with `last`, the
    #    Jacobi guess), merged into the trie.
    trees = [Tree(row.tokens[-1], row.propose(policy)) for row in rows]
    # 2. Plan: the policy picks the guesses and window columns each row runs, padded to one size
    #    T of a small menu (1, 2, 4, ... tokens): the paper's W, N, G (FixedShape) or measured.
    plans = policy.plan(rows, trees, limit)
    T = max(shape.size for *_, shape in plans)
    # 3. Inputs: each row's [trie | window | padding], every token at its own position, under one
    #    mask that gives it exactly its trajectory's context.
    masks = buffer.masks(len(rows), T)  # each row's mask is written where the forward reads it
    parts = [row.inputs(tree, w, T, block) for row, (tree, w, _), block in zip(rows, plans, masks)]
    # 4. Forward: one model call; the logits of the positions read only. It first rolls back
    #    the step before (8), whose indices travel with this step's inputs.
    inputs = pack_inputs(model, rows, parts, T, buffer)
    forward = time.perf_counter()
    logits = model.step(*inputs)  # (B, R, V)
    pred, rankings = predictions(logits, rows)  # the one host sync of a greedy step
    forward = time.perf_counter() - forward
    # 5 to 7. Verify: the longest chain the model agrees with, plus its next token; then the
    #    window's update and the commit (Sequence.advance).
    steps = [row.advance(tree, w, pred[j], rankings[j], *verify(row, tree, pred[j], logits, j), shape)
             for j, (row, (tree, w, shape)) in enumerate(zip(rows, plans))]
    # 8. Roll back: the step wrote K/V for all T tokens; the accepted ones' are exactly what a
    #    one-token-at-a-time run writes (same tokens, positions, context), so they move down next
    #    to `last` (row.moves), and the rest, past the committed length, is overwritten by the
    #    next step. The next forward moves them, in every layer before it reads the cache (in a
    #    compiled step, inside its graph): no host-to-device copy or sync of their own.
    seconds = time.perf_counter() - start
    policy.observe(rows, steps, T, seconds)
    host = time.perf_counter() - start - forward  # all but the forward, argmax and top-k: host work
    for row in rows:
        row.out.host_seconds += host
    for j, step in enumerate(steps):
        on_step and on_step(j, step)


@torch.inference_mode()
def lookahead_decode_batch(model, prompts, max_new_tokens, *, window=None, ngram=None, candidates=None, stop_ids=(),
                           seed=0, temperature=0.0, top_k=0, top_p=1.0, output_ngrams=True, drafts=None, costs=None,
                           memory=None, on_tokens=None, on_step=None) -> list[Generation]:
    """The decode loop: prefill, first token, steps until every row is done; each row's tokens are
    greedy_decode's (sampling: sample_decode's distribution, row b seeded with seed + b). W, N, G
    (window, ngram = 5, candidates): the paper's fixed shape; neither W nor G: the dynamic shape
    (shape.py; `costs` fixes its step costs). output_ngrams: pool the committed text's n-grams.
    drafts(seq) -> the row's draft sources (default: the pool, the Jacobi guess). memory: a
    drafts.Memory the rows' sources share and keep after the request (default: none kept).
    on_tokens(row, new ids), on_step(row, Verified). A finished row leaves the batch."""
    policy = shape_policy(model, window, ngram, candidates, costs)
    sampling = Sampling(temperature, top_k, top_p)
    start = time.perf_counter()
    limits = check_requests(model, prompts, max_new_tokens)
    longest = max(len(p) + m - 1 for p, m in zip(prompts, limits))
    ensure_cache(model, min(model.args.max_seq_len, longest + policy.largest), len(prompts))
    rows = [Sequence(p, m, policy, sampling, seed + b, set(stop_ids), model.device, output_ngrams, drafts, memory)
            for b, (p, m) in enumerate(zip(prompts, limits))]
    start_rows(model, rows, sampling, policy.forecast(len(rows)) - 1, start, on_tokens)
    active = list(range(len(rows)))  # the rows still decoding, in the cache's row order
    buffer = step_buffer(model, len(rows), policy.largest)
    while True:
        if any(rows[b].done for b in active):
            settle(model, [rows[b] for b in active])  # before rows leave the cache, and at the end
        keep = drop_finished(model, active, lambda b: rows[b].done, [row.out for row in rows],
                             max(rows[b].C for b in active), start)
        if not keep:
            for row in rows:  # of the host work, each source's (by name)
                for source, seconds in row.spent.items():
                    row.out.source_seconds[source.name] = row.out.source_seconds.get(source.name, 0.0) + seconds
            return [row.out for row in rows]
        active = [active[j] for j in keep]
        lookahead_step(model, policy, [rows[b] for b in active], buffer,
                       on_step and (lambda j, s: on_step(active[j], s)))
        for b in active:
            on_tokens and on_tokens(b, rows[b].tokens[len(rows[b].tokens) - rows[b].out.committed[-1]:])


@torch.inference_mode()
def lookahead_decode(model, prompt_ids, max_new_tokens, *, on_tokens=None, on_step=None, **options) -> Generation:
    """One prompt: lookahead_decode_batch's row 0, on_tokens(new ids) and on_step(Verified)."""
    return lookahead_decode_batch(model, [prompt_ids], max_new_tokens, on_tokens=per_row(on_tokens),
                                  on_step=on_step and (lambda _, s: on_step(s)), **options)[0]


# ---------------------------------------------------------------------------------------------
# Beyond the paper: batches and sampling. A batch's step is its rows' side by side, row b in
# slots C_b .. C_b+T-1 of its cache row; rows never see each other:
#     row 0   [ last | guesses | window | padding ]
#     row 1   [ last | guesses | window .......... ]
# ---------------------------------------------------------------------------------------------

class StepBuffer:
    """Where a step's inputs are written: one host buffer kept from step to step (on a GPU, with
    a device twin that one copy fills). For B rows of T tokens and room for S moves it holds the
    rows' (T x T) masks, then each row's ints at fixed places,

        [ tokens: T | positions: T | committed: 1 | read: T | moves from: S | moves to: S ]

    so the tensors a step reads are views made once per (B, T, S) and kept, the positions read
    (R of T) and the moves (M of S) kept slices of them: a step makes no tensor on the host,
    where each costs ~10-30 us right after a CPU's forward. A model keeps its buffer from one
    request to the next (step_buffer), so the views a request needs were mostly made before."""

    def __init__(self, device: torch.device):
        self.device, self.host, self.layouts, self.read_slices, self.move_slices = device, bytearray(), {}, {}, {}

    def masks(self, B: int, T: int) -> list[memoryview]:
        """Where each row's mask goes (step_inputs writes it)."""
        self.room(B * T * T)
        buffer = memoryview(self.host)
        return [buffer[b * T * T:(b + 1) * T * T] for b in range(B)]

    def room(self, end: int):
        if end > len(self.host):  # a larger step than any before: a new buffer (what it holds kept), new views
            self.host = bytearray(self.host) + bytearray(2 * end - len(self.host))
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
        copy, (tokens, positions, C, reads, moves, block) = layout
        if copy is not None:
            copy[0].copy_(copy[1])  # the step's one host-to-device copy
        read = self.read_slices.get((B, T, S, R))  # each kept apart: R changes most steps, M seldom
        if read is None:
            read = self.read_slices[B, T, S, R] = reads[:, :R]
        moved = self.move_slices.get((B, T, S, M))
        if moved is None:
            moved = self.move_slices[B, T, S, M] = moves[:, :, :M] if M else None
        return tokens, positions, C, block, read, moved

    @staticmethod
    def ints_at(B: int, T: int) -> int:
        """Where a step's ints start in the buffer: 8-aligned after its B (T x T) masks."""
        return -(-B * T * T // 8) * 8

    def views(self, B: int, T: int, S: int, start: int, end: int):
        """A layout's tensors, over the host buffer itself on the CPU; elsewhere over a device
        buffer of its own, with the (device, host) pair that load copies between."""
        data = source = torch.frombuffer(self.host, dtype=torch.uint8, count=end)
        copy = None
        if self.device.type != "cpu":
            data = torch.empty(end, dtype=torch.uint8, device=self.device)
            copy = data, source
        numbers = data[start:end].view(torch.int64).view(B, -1)
        tokens, positions, C, reads, moves = numbers.split_with_sizes((T, T, 1, T, 2 * S), 1)
        return copy, (tokens, positions, C, reads, moves.view(B, 2, S), data[:B * T * T].view(torch.bool).view(B, T, T))


# Each process keeps one StepBuffer per model: a request reuses the views earlier ones made.
STEP_BUFFERS = weakref.WeakKeyDictionary()


def step_buffer(model, B: int, T: int) -> StepBuffer:
    """The model's StepBuffer (a new one where none is kept, or the model moved to another
    device), with room for B rows of T tokens: one that grew mid-request would remake its views."""
    buffer = STEP_BUFFERS.get(model)
    if buffer is None or buffer.device != model.device:
        buffer = STEP_BUFFERS[model] = StepBuffer(model.device)
    buffer.room(StepBuffer.ints_at(B, T) + 8 * B * (3 * T + 1 + 2 * max(16, T)))  # (moves' room S <= max(16, T))
    return buffer


def pack_inputs(model, rows: list[Sequence], parts: list, T: int, buffer: StepBuffer):
    """The step's inputs: its ints (int64) written into the buffer after the masks (on a
    device, sent in ONE host-to-device copy: one a tensor would be a sync point each on a GPU)
    and read as tokens (B, T), positions (B, T), committed (B, 1), the in-step mask (B, T, T),
    the span of committed lengths (host), the positions read (B, R) and the step before's roll
    back, (B, 2, M) slots (from, to), padded with slot 0 onto itself (None: none); the rows'
    moves, sent, are cleared. parts: each row's step_inputs, its mask written in buffer.masks."""
    B, R = len(rows), max(len(read) for *_, read in parts)
    M = max(len(row.moves) for row in rows)
    if model.compiled is not None and M:  # a compiled step takes a fixed number of moves
        if M > model.compiled.MOVES:  # more than its graph takes: done eagerly, once
            settle(model, rows)
        M = model.compiled.MOVES
    S = max(16, 1 << (M - 1).bit_length())  # room for the moves: 16, or a power of two past it
    ints = array("q")
    for row, (tokens, offsets, _, read) in zip(rows, parts):
        moves = row.moves + [(0, 0)] * (S - len(row.moves))
        ints.fromlist(tokens + [row.C + o for o in offsets] + [row.C] + read + read[:1] * (T - len(read)) +
                      [s for s, _ in moves] + [d for _, d in moves])
        row.moves = []
    tokens, positions, C, block, read, moves = buffer.load(ints, B, T, S, R, M)
    span = min(row.C for row in rows), max(row.C for row in rows)
    return tokens, positions, C, block, span, read, moves


def settle(model, rows: list[Sequence]):
    """Roll back the rows' last step now, eagerly (rows are leaving the cache, or the request
    ends): what the next forward would have done."""
    if any(row.moves for row in rows):
        model.cache.rollback([row.moves for row in rows])
    for row in rows:
        row.moves = []


def verify(row: Sequence, tree: Tree, pred: list[int], logits, j: int) -> tuple[list[int], int]:
    """5. Verify the guesses against the model's own choices (greedy: its argmax; sampling: a
    rejection test on row j's logits that keeps plain sampling's distribution,
    sampling.verify_sampled)."""
    if row.sampling.greedy:
        return verify_greedy(tree, pred)
    return verify_sampled(tree, row.sampling.probs(logits[j, :len(tree)]), row.rng, row.gen)


def start_rows(model, rows: list[Sequence], sampling: Sampling, worth_guessing: int, start: float, on_tokens=None):
    """Prefill every row's prompt and commit its first token."""
    for row in rows:
        row.worth_guessing = worth_guessing
    logits = prefill_with_rankings(model, rows)
    first = sampling.pick(logits, [row.gen for row in rows])[:, 0].tolist()
    for b, row in enumerate(rows):
        row.out.prefill_seconds = time.perf_counter() - start
        kept = row.commit(first[b:b + 1])
        # The sources see the first token as a step with no guesses: every committed token once.
        row.observed(Verified(Tree(row.prompt[-1]), 0, [row.prompt[-1]], first[b:b + 1], None, [], kept, []))
        on_tokens and on_tokens(b, kept)


if __name__ == "__main__":  # the command line lives in cli.py; `python lookahead.py --prompt ...` runs it
    from cli import main
    raise SystemExit(main())

"""Lookahead decoding (Fu, Bailis, Stoica, Zhang, ICML 2024, arXiv 2402.02057), exactly greedy.

Greedy decoding is the fixed point of y_i = argmax p(. | prompt, y_<i) for all future i at once.
Jacobi iteration guesses many future tokens and refines them in parallel; each guess drags an
n-gram behind it. Lookahead decoding keeps a 2-D window of those guesses, pools the n-grams they
trace, and in the SAME forward verifies the pooled n-grams that start with the last token: what
verification accepts is exactly what greedy decoding produces, and a step commits up to N tokens.

Top to bottom: NGramPool; Tree (the candidates); window_layout and step_inputs (the mask);
verify_greedy and verify_sampled; Sequence (a prompt's state: propose, verify, commit/rollback,
the Jacobi guess, the window); lookahead_decode_batch (the loop: one forward per step for all
rows; lookahead_decode is a batch of one). decoding.py has the request, the prefill and the
baselines; shape.py the dynamic shape; cli.py the command line.

Words: a *guess* is one guessed token, a node of the trie; a *candidate* is a chain of guesses
continuing the last token (a pooled n-gram's rest, or the Jacobi guess). The option `guesses`
(G) keeps the paper's name, "guess set size": the candidates a fixed shape verifies.
"""
import random
import time
from collections import OrderedDict
from functools import lru_cache

import torch

from decoding import (Generation, Sampling, check_requests, ensure_cache, mask_width, per_row, prefill, step_room,
                      switch_rope)
from model import step_size
from shape import STEP_COSTS, Acceptance, Shape, StepCosts, choose_shape, step_limits


class NGramPool:
    """n-grams seen so far, keyed by their first token, at most `cap` per key, least recently
    seen evicted first (a repeated one moves to the recent end). Each remembers the tokens seen
    right before it (for ranked) and whether the window made it (the dynamic shape credits it)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.by_key: dict[int, OrderedDict] = {}  # first token -> {rest: [tokens before it, from window?]}

    def add(self, ngram, before=None, from_window=False):
        if self.cap == 0:
            return
        entries = self.by_key.setdefault(ngram[0], OrderedDict())
        rest = tuple(ngram[1:])
        if rest in entries:
            entries.move_to_end(rest)
        else:
            entries[rest] = [set(), from_window]
            if len(entries) > self.cap:
                entries.popitem(last=False)
        if before is not None:
            entries[rest][0].add(before)

    def ranked(self, key, before=None) -> list[tuple]:
        """The continuations of `key` (the n-grams without their first token), as (rest, seen
        after `before`?, from the window?): first those seen after `before`, the token before
        `key` now, then the rest; most recent first in each. Two tokens of context pick better
        than one when there are more n-grams than guesses to verify (measured: the summary prompt
        commits 3.2 tokens per step at 1,4,1 instead of 2.1)."""
        entries = [(rest, before in seen, win) for rest, (seen, win) in reversed(self.by_key.get(key, {}).items())]
        return [e for e in entries if e[1]] + [e for e in entries if not e[1]]


POOL_MIN_PER_KEY = 8  # n-grams kept per key even where fewer are verified, so a small G picks from several


class Tree:
    """The guesses of one step: candidate continuations of `last` merged into a trie.

    Node 0 is `last`; every other node is a guessed token whose context is its chain of
    ancestors, at position C + depth. Candidates that share a prefix share its nodes, so a
    step verifies all of them for the price of their distinct tokens:

        candidates  a b c  |  a b d  |  a e f  |  g h i        last
                                                            /        \\
        trie                                               a           g
                                                         /   \\         \\
                                                        b     e         h
                                                       / \\     \\         \\
                                                      c   d     f         i

    Children keep the candidates' order (dicts keep insertion order), so the first child is
    the best-ranked candidate through a node."""

    def __init__(self, last: int):
        self.tokens, self.parent, self.depth = [last], [-1], [0]
        self.children: list[dict] = [{}]  # node -> {token: child node}
        self.kind = [None]  # "context", "pool" or "jacobi": the source of the first candidate through it
        self.from_window = [False]
        self.chains: list[tuple] = []  # the candidates as given: (tokens, kind, from_window)

    def add(self, chain, kind="pool", from_window=False):
        v = 0
        for tok in chain:
            child = self.children[v].get(tok)
            if child is None:
                child = len(self.tokens)
                self.children[v][tok] = child
                self.tokens.append(tok)
                self.parent.append(v)
                self.depth.append(self.depth[v] + 1)
                self.children.append({})
                self.kind.append(kind)
                self.from_window.append(from_window)
            v = child
        if chain:
            self.chains.append((tuple(chain), kind, from_window))

    def __len__(self):
        return len(self.tokens)

    def rank(self, node) -> int:
        """0 for the first child of its parent, 1 for the second, ..."""
        return list(self.children[self.parent[node]].values()).index(node)

    def keep(self, nodes) -> "Tree":
        """The sub-trie of these nodes (closed under parents), rebuilt from the candidates in
        their order, so each node keeps the source of the first candidate through it."""
        keep = set(nodes) | {0}
        out = Tree(self.tokens[0])
        for chain, kind, from_window in self.chains:
            v, kept = 0, []
            for tok in chain:
                v = self.children[v][tok]
                if v not in keep:
                    break
                kept.append(tok)
            out.add(kept, kind, from_window)
        return out

    def first_chain(self, node) -> list[int]:
        """Node, its first child, that one's first child, ...: the best-ranked candidate's rest."""
        out = [node]
        while self.children[out[-1]]:
            out.append(next(iter(self.children[out[-1]].values())))
        return out


@lru_cache(maxsize=None)
def window_layout(W: int, L: int):
    """The window's part of a step's mask, built once per shape: (W*L, 1 + W*L) over [last, window].

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
    from level l-1, column j a step ago. Returns (mask, position offsets)."""
    mask = torch.zeros(W * L, 1 + W * L, dtype=torch.bool)
    offsets = torch.zeros(W * L, dtype=torch.long)
    mask[:, 0] = True
    for level in range(L):
        for j in range(W):
            r = level * W + j
            mask[r, 1:2 + j] = True  # level 0, columns 0..j
            for up in range(1, level + 1):
                mask[r, 1 + up * W + j] = True  # own column, levels 1..level
            offsets[r] = 1 + j + level
    return mask, offsets


def step_inputs(tree: Tree, window, w: int, size: int):
    """Tokens (size,), positions after C (size,), the (size, size) in-step mask (0/1) and the
    logits rows to read, of one row's step laid out as

        [ tree: last, guesses | window: w columns x L levels | padding ]

    Rows read: every tree node (row i predicts the token after node i), then the newest window
    level (its predictions become the next level). Padding attends only to itself, never read."""
    n, L = len(tree), len(window) if w else 0
    T = n + w * L
    block = torch.zeros(size, size, dtype=torch.long)
    rows, cols = [], []
    ancestors = [[0]]
    for i in range(1, n):  # a guess sees its ancestors and itself
        ancestors.append(ancestors[tree.parent[i]] + [i])
        rows += [i] * len(ancestors[i])
        cols += ancestors[i]
    block[0, 0] = 1
    if rows:
        block[rows, cols] = 1
    offsets = torch.zeros(size, dtype=torch.long)
    offsets[:n] = torch.tensor(tree.depth)
    seq = tree.tokens + [t for level in window[:L] for t in level[:w]] + [0] * (size - T)
    if L:
        wmask, woffsets = window_layout(w, L)
        block[n:T, 0] = wmask[:, 0]
        block[n:T, n:T] = wmask[:, 1:]
        offsets[n:T] = woffsets
    pad = torch.arange(T, size)
    block[pad, pad] = 1
    read = list(range(n)) + list(range(n + (L - 1) * w, n + L * w))
    return torch.tensor(seq), offsets, block, read


def verify_greedy(tree: Tree, pred) -> tuple[list[int], int]:
    """Greedy verification -> (accepted nodes, bonus token). pred[i] is the model's next token
    after node i. From `last`, follow the child whose token the model predicted while there is
    one: those guesses are what greedy decoding produces, and the prediction after the last of
    them is a bonus token the forward already computed."""
    path, v = [], 0
    while (child := tree.children[v].get(pred[v])) is not None:
        path.append(child)
        v = child
    return path, pred[v]


def verify_sampled(tree: Tree, probs, rng, gen) -> tuple[list[int], int]:
    """Lossless verification under sampling -> (accepted nodes, the next sampled token).

    Speculative sampling with one-hot drafts down the trie. With p the model's distribution after
    node v (probs[v], (len(tree), V)), try v's children d1, d2, ... in turn, accepting d_i with
    probability p(d_i) / (1 - S_i), S_i = p(d1) + ... + p(d_i-1): p renormalised without the
    rejected ones. The rejections before it leave probability 1 - S_i, so d_i comes out with
    probability p(d_i); if all are rejected the residual is sampled: every token x has p(x). An
    accepted child continues the walk with the model's distribution given that prefix."""
    p_own = [1.0]  # p_own[i]: probability of node i's token under its parent's distribution
    if len(tree) > 1:
        p_own += probs[tree.parent[1:], tree.tokens[1:]].tolist()  # one host sync for all guesses
    path, v = [], 0
    while tree.children[v]:
        mass, rejected, accepted = 0.0, [], None
        for tok, child in tree.children[v].items():
            if rng.random() * max(1.0 - mass, 1e-12) < p_own[child]:
                accepted = child
                break
            rejected.append(tok)
            mass += p_own[child]
        if accepted is None:  # all rejected: sample the residual and stop here
            residual = probs[v].clone()
            residual[rejected] = 0
            if residual.sum() <= 0:  # only rounding can leave nothing: fall back to p itself
                residual = probs[v]
            return path, torch.multinomial(residual, 1, generator=gen).item()
        path.append(accepted)
        v = accepted
    return path, torch.multinomial(probs[v], 1, generator=gen).item()


class Sequence:
    """One prompt's lookahead state, a row of the batch: committed tokens, pool, window, Jacobi
    guess, acceptance. The loop asks every row for its part of a step (propose, fixed_shape or
    choose_shape, inputs), runs one forward for all, and hands each row its logits (verify)."""

    def __init__(self, prompt_ids, max_new_tokens, N, W, G, dynamic, sampling, seed, stop, dev,
                 output_ngrams, jacobi_guess):
        self.prompt, self.max_new, self.stop = list(prompt_ids), max_new_tokens, stop
        self.N, self.levels, self.W, self.G, self.dynamic = N, N - 1, W, G, dynamic
        self.sampling, self.output_ngrams, self.jacobi_guess = sampling, output_ngrams, jacobi_guess
        self.C = len(prompt_ids)  # committed slots: `last` (tokens[-1]) sits at slot and position C
        self.tokens = []
        self.out = Generation(self.tokens, 0, 0.0)  # the same list: its tokens grow with commit
        self.acceptance = Acceptance()
        # Window: level 0 starts as random prompt tokens (any guess converges; seeded, so runs
        # repeat), and grows a level a step up to N-1; verification does not wait for it.
        self.window_rng, self.rng = random.Random(seed), random.Random(seed + 1)
        self.window = [[self.window_rng.choice(self.prompt) for _ in range(W)]] if W and not dynamic else []
        self.gen = torch.Generator(dev).manual_seed(seed)  # sampling's draws, seeded like the window
        # Pool: seeded with the prompt's own n-grams, which pays off whenever the answer copies
        # (commit adds the n-grams of the committed text as it grows).
        self.pool = NGramPool(max(G, POOL_MIN_PER_KEY) if G else 0)
        for i in range(len(self.prompt) - N + 1):
            self.pool.add(self.prompt[i:i + N], self.prompt[i - 1] if i else None)
        self.context = list(self.prompt)  # and the committed tokens, for output_ngrams
        self.jacobi = []  # the model's predictions left over from the last step (verify)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new or bool(self.tokens) and self.tokens[-1] in self.stop

    def commit(self, new_tokens) -> list[int]:
        """Append committed tokens, cut exactly where greedy would stop (a stop id, or
        max_new_tokens), and pool the n-grams that end in them; return what was kept."""
        new_tokens = new_tokens[:self.max_new - len(self.tokens)]
        new_tokens = new_tokens[:next((i + 1 for i, t in enumerate(new_tokens) if t in self.stop), None)]
        self.tokens += new_tokens
        if self.output_ngrams:
            N, context = self.N, self.context
            context.extend(new_tokens)
            for end in range(max(N, len(context) - len(new_tokens) + 1), len(context) + 1):
                self.pool.add(context[end - N:end], context[end - N - 1] if end > N else None)
        return new_tokens

    def propose(self) -> Tree:
        """1. Propose: a trie of candidate continuations of `last`. Pooled n-grams that start
        with `last`, those seen after the same token as now first, then the Jacobi guess. They
        need not guess past max_new_tokens. (The place to plug in any other draft source.)"""
        last = self.tokens[-1]
        K = min(self.levels, self.max_new - len(self.tokens) - 1)
        before = self.tokens[-2] if len(self.tokens) > 1 else self.prompt[-1]  # the token before `last`
        tree = Tree(last)
        if K > 0:
            pooled = self.pool.ranked(last, before)[:self.G]
            for rest, in_context, from_window in pooled:
                tree.add(rest[:K], "context" if in_context else "pool", from_window)
            if self.jacobi and (self.dynamic or len(pooled) < self.G):
                # A fixed shape pads it to K guesses with its last token (costs a slot, never
                # exactness); the dynamic one leaves that to the chances of real guesses.
                pad = [] if self.dynamic else self.jacobi[-1:] * (K - len(self.jacobi))
                tree.add((self.jacobi + pad)[:K], "jacobi")
        return tree

    def fixed_shape(self, tree: Tree, budget: int) -> tuple[Tree, int, Shape]:
        """2. A fixed shape verifies every guess and runs the whole window; near the end of the
        cache the window sits out and the trie shrinks to what still fits."""
        L = len(self.window)
        w = self.W if step_size(len(tree) + self.W * L) <= budget else 0
        if step_size(len(tree) + w * L) > budget:
            tree = tree.keep(range(1, 1 << (budget.bit_length() - 1)))
        return tree, w, Shape(w, L if w else 0, len(tree) - 1, step_size(len(tree) + w * L))

    def inputs(self, tree: Tree, w: int, size: int):
        """The row's part of the step, padded to `size` (step_inputs). A dynamic window keeps
        its columns while its width stays; narrowed, it loses its rightmost ones; widened, new
        columns start from random prompt tokens, as the first one does."""
        if w and not self.window:
            self.window = [[self.window_rng.choice(self.prompt) for _ in range(w)]]
        elif w and self.dynamic:
            self.window = [level[:w] + [self.window_rng.choice(self.prompt) for _ in range(w - len(level))]
                           for level in self.window]
        return step_inputs(tree, self.window, w, size)

    def verify(self, tree: Tree, w: int, shape: Shape, pred: list[int], logits, on_step=None) -> list[int]:
        """Steps 4 to 7 for this row, given its logits rows (pred: their argmax). Returns the cache
        slots (after C) whose K/V are now committed, in order; the loop moves them (rollback)."""
        n, C = len(tree), self.C
        new_level = pred[n:n + w]

        # 4. Verify the guesses against the model's own choices (greedy: its argmax; sampling:
        #    a rejection test that keeps plain sampling's distribution).
        if self.sampling.greedy:
            path, bonus = verify_greedy(tree, pred)
        else:
            path, bonus = verify_sampled(tree, self.sampling.probs(logits[:n]), self.rng, self.gen)

        # 5. Commit and roll back: `last` is in slot C; the accepted guesses' K/V move from their
        #    slots (node i is in slot C + i) to C+1... as they are: same tokens, same positions,
        #    exactly the committed context, so what a sequential run would have written. The rest
        #    of the step's slots lie past the committed length: overwritten next step.
        src = [C] + [C + v for v in path]
        self.C = C + len(src)
        # The first rejected guess's rows predicted what follows the commit, from a context wrong
        # in one token: as in Jacobi decoding, a guess for the next step, and often right.
        #     accepted   last  a0         rejected: a1 (the model said b)   commits a0, b
        #     rows       a1 -> p1, a2 -> p2            Jacobi guess next step: [p1, p2]
        end = path[-1] if path else 0
        rejected = next(iter(tree.children[end].values()), None)
        self.jacobi = [pred[v] for v in tree.first_chain(rejected)] if rejected and self.jacobi_guess else []
        self.acceptance.record(tree, path, w)
        trace = on_step and self.trace(tree, w, shape, path)  # before the window moves on

        # 6. Jacobi update: the newest level's predictions become a new level; once the window
        #    is full, each column plus its prediction is an N-gram for the pool, and the oldest
        #    level drops out. Its positions stay relative to `last`: after a multi-token step
        #    the window is not realigned with the text (this costs acceptance, never exactness).
        window = self.window
        if w:
            if len(window) == self.levels:
                for j in range(w):
                    # column j's trajectory continues level 0 after its column j-1 (or `last`)
                    self.pool.add([level[j] for level in window] + [new_level[j]],
                                  window[0][j - 1] if j else tree.tokens[0], from_window=True)
                window.pop(0)
            window.append(new_level)

        # 7. Stop exactly where greedy would: at a stop id, or at max_new_tokens.
        new_tokens = self.commit([tree.tokens[v] for v in path] + [bonus])
        on_step and on_step({**trace, "committed": new_tokens})
        self.out.steps += 1
        self.out.committed.append(len(new_tokens))
        self.out.shapes.append(shape)
        return src

    def trace(self, tree, w, shape, path) -> dict:
        """What a step did, for on_step (--trace)."""
        accepted = [tree.tokens[v] for v in path]
        winner = next((g for g, (c, *_) in enumerate(tree.chains) if list(c[:len(accepted)]) == accepted), 0)
        return dict(step=self.out.steps, shape=shape, last=tree.tokens[0],
                    window=[level[:w] for level in self.window[:shape.levels]],
                    candidates=[list(c) for c, *_ in tree.chains], sources=[k for _, k, _ in tree.chains],
                    jacobi=bool(tree.chains) and tree.chains[-1][1] == "jacobi", winner=winner, accepted=len(path))


@torch.inference_mode()
def lookahead_decode(model, prompt_ids, max_new_tokens, window=None, ngram=None, guesses=None, stop_ids=(),
                     seed=0, output_ngrams=True, jacobi_guess=True, on_tokens=None,
                     temperature=0.0, top_k=0, top_p=1.0, on_step=None, costs=None) -> Generation:
    """Several tokens per forward. Greedy by default, and then the tokens equal greedy_decode's;
    with temperature/top_k/top_p the tokens are distributed exactly as sample_decode's.
    window W (columns), ngram N (5 if None: the window's N-1 levels, at most N-1 guesses a
    candidate), guesses G (candidates verified): given W and G, that fixed shape every step (the
    paper's configurations); neither (the default), the dynamic shape: before every step
    choose_shape (shape.py) picks the guesses and window columns for the most expected tokens per
    second, from the acceptance seen and the step costs measured (StepCosts, kept per model;
    `costs` replaces it). The pool starts with the prompt's n-grams; output_ngrams: also those of
    the committed text. jacobi_guess: also verify the predictions left over from the step before
    (with a fixed shape only when the pool offers fewer than G candidates). on_tokens(new ids) as
    tokens are committed; on_step(dict) after each step, for --trace. Measured costs make the
    dynamic shapes, so a seed's sampled tokens (not their distribution) depend on timing: a fixed
    shape or `costs` repeats a sampled run."""
    return lookahead_decode_batch(model, [prompt_ids], max_new_tokens, window, ngram, guesses, stop_ids, seed,
                                  temperature, top_k, top_p, per_row(on_tokens), costs,
                                  output_ngrams, jacobi_guess, on_step and (lambda _, step: on_step(step)))[0]


@torch.inference_mode()
def lookahead_decode_batch(model, prompts, max_new_tokens, window=None, ngram=None, guesses=None, stop_ids=(),
                           seed=0, temperature=0.0, top_k=0, top_p=1.0, on_tokens=None, costs=None,
                           output_ngrams=True, jacobi_guess=True,
                           on_step=None) -> list[Generation]:
    """lookahead_decode for several prompts, one forward per step for all of them: row b is
    exactly its own lookahead_decode (seed + b), with its own window, pool, shape and rollback.

    The step of B rows is their steps side by side, each padded to the batch's size T:

        row 0   [ last | guesses | window | padding ]   slots C0 .. C0+T-1 of cache row 0
        row 1   [ last | guesses | window .......... ]   slots C1 .. C1+T-1 of cache row 1

    A row's mask is its committed slots plus its own block: rows never see each other. The
    dynamic shape chooses T for the batch (costs measured for B-row steps), each row its guesses
    and window within T. A finished row leaves the batch and the cache. on_tokens(row, new ids),
    on_step(row, dict)."""
    dynamic, N, W, G, step_max = step_limits(window, ngram, guesses)
    sampling = Sampling(temperature, top_k, top_p)
    start = time.perf_counter()
    limits = check_requests(model, prompts, max_new_tokens)
    longest = max(len(p) + m - 1 for p, m in zip(prompts, limits))
    ensure_cache(model, min(model.args.max_seq_len, longest + step_max), len(prompts))
    dev, stop = model.device, set(stop_ids)
    rows = [Sequence(p, m, N, W, G, dynamic, sampling, seed + b, stop, dev, output_ngrams, jacobi_guess)
            for b, (p, m) in enumerate(zip(prompts, limits))]

    first = sampling.pick(prefill(model, prompts), [row.gen for row in rows])[:, 0].tolist()
    for b, row in enumerate(rows):
        row.out.prefill_seconds = time.perf_counter() - start
        kept = row.commit(first[b:b + 1])
        on_tokens and on_tokens(b, kept)
    active = list(range(len(rows)))  # the rows still decoding, in the cache's row order
    while True:
        keep = [j for j, b in enumerate(active) if not rows[b].done]
        for j in set(range(len(active))) - set(keep):
            rows[active[j]].out.seconds = time.perf_counter() - start
        if len(keep) < len(active):  # finished rows leave the batch (and the cache)
            if not keep:
                break
            model.keep_rows(keep, max(rows[b].C for b in active))
            active = [active[j] for j in keep]
        step_start = time.perf_counter()
        batch = [rows[b] for b in active]
        B, budget = len(batch), min(step_max, *(step_room(model, row.C) for row in batch))
        for j, row in enumerate(batch):
            switch_rope(model, j, row.C, row.prompt + row.tokens)
        step_costs = costs or STEP_COSTS.setdefault(model, {}).setdefault(B, StepCosts())

        # 1. Every row proposes its guesses (Sequence.propose).
        trees = [row.propose() for row in batch]
        # 2. Shape the step: which guesses and how many window columns each row runs, padded to
        #    a size T of the menu. Dynamic: the best expected tokens per second (choose_shape).
        if dynamic:
            plans = choose_shape([(tree, row.acceptance, len(row.window) or 1, W) for row, tree in zip(batch, trees)],
                                 step_costs, budget)
        else:
            plans = [row.fixed_shape(tree, budget) for row, tree in zip(batch, trees)]
        T = max(shape.size for _, _, shape in plans)

        # 3. One forward over every row's [tree | window | padding] under the combined mask,
        #    built on the device from the rows' in-step blocks (one host-to-device copy).
        parts = [row.inputs(tree, w, T) for row, (tree, w, _) in zip(batch, plans)]
        R = max(len(read) for *_, read in parts)
        packed = torch.cat([torch.cat((seq, offsets, block.flatten(), torch.tensor(read + read[:1] * (R - len(read))),
                                       torch.tensor([row.C]))) for row, (seq, offsets, block, read) in zip(batch, parts)]
                           ).to(dev).view(B, -1)
        seq, offsets, block, read, C = packed.split((T, T, T * T, R, 1), dim=1)
        slots = C + torch.arange(T, device=dev)  # (B, T): row b's step sits in its slots C_b..C_b+T-1
        S = mask_width(model, max(row.C for row in batch) + T)
        mask = (torch.arange(S, device=dev) < C)[:, None].repeat(1, T, 1)  # (B, T, S): the committed slots
        mask.scatter_(2, slots[:, None].expand(B, T, T), block.view(B, T, T).bool())  # and the row's block
        logits = model.step(seq, C + offsets, slots, mask, read)  # (B, R, V)
        pred = logits.argmax(-1).tolist()  # the one host sync per greedy step

        # 4 to 7. Every row verifies and commits its guesses; their K/V move in one copy.
        moves = [row.verify(tree, w, shape, pred[j], logits[j], on_step and (lambda s, b=b: on_step(b, s)))
                 for j, (b, row, (tree, w, shape)) in enumerate(zip(active, batch, plans))]
        model.commit(moves)
        step_costs.record(T, time.perf_counter() - step_start)
        for b, row in zip(active, batch):
            on_tokens and on_tokens(b, row.tokens[len(row.tokens) - row.out.committed[-1]:])
    return [row.out for row in rows]


if __name__ == "__main__":  # the command line lives in cli.py; `python lookahead.py --prompt ...` runs it
    from cli import main
    raise SystemExit(main())

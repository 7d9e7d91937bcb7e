"""Lookahead decoding (Fu, Bailis, Stoica, Zhang, ICML 2024, arXiv 2402.02057), exactly greedy.

Greedy decoding is the fixed point of y_i = argmax p(. | prompt, y_<i) for all future i at once.
Jacobi iteration guesses many future tokens and refines them in parallel; each guess drags an
n-gram behind it. Lookahead decoding keeps a 2-D window of those guesses, pools the n-grams they
trace, and in the SAME forward verifies the pooled n-grams that start with the last token: what
verification accepts is exactly what greedy decoding produces, and a step commits up to N tokens
(a pooled n-gram's; other draft sources' chains may be longer).

One step, as lookahead_step runs it for every row of a batch:

    propose -> plan -> inputs -> forward -> verify -> advance -> roll the cache back
    (drafts)   (shape)  (mask)   (model)   (greedy   (commit, Jacobi     (keep the accepted
                                            or        guess, window,      tokens' K/V)
                                            sampled)  pool)

Top to bottom: Candidate and DraftSource (what every source of guesses implements), NGramPool
and JacobiGuess (the two built-in ones); Tree; window_layout and step_inputs (the mask); the two
verifications; Sequence (a prompt's state); lookahead_step and the decoders. What each step runs
is a policy, shape.py's FixedShape (the paper's W, N, G) or DynamicShape; decoding.py has the
request, the prefill and the baselines.

Words: a *guess* is one guessed token, a node of the trie; a *candidate* is a chain of guesses
continuing the last token, from one draft source (a pooled n-gram's rest, the Jacobi guess).
The fixed shape's `candidates` is the paper's G, its "guess set size".
"""
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from decoding import (Generation, Sampling, check_requests, drop_finished, ensure_cache, per_row, prefill,
                      step_room, switch_rope)
from shape import Shape, shape_policy


@dataclass(frozen=True)
class Candidate:
    """A chain of guesses continuing `last`, and who made it: `source` names the draft source
    (the dynamic shape learns how often each source's guesses are right); from_window marks an
    n-gram the lookahead window made (it credits the window)."""
    tokens: tuple
    source: str
    from_window: bool = False


class DraftSource:
    """Where guesses come from. `drafts(seq)` makes each row's sources when a request starts;
    before every step propose(seq, k) returns candidate continuations of seq.tokens[-1], best
    first, each of at most k guesses (what is left before max_new_tokens; the source knows how
    far its guesses are worth making; seq.room is the most guesses the policy expects a step to
    hold soon, one rung above the recent steps, for a source whose guesses cost it to make); after
    it observe(seq, step) sees the Verified step (with the model's top_k best tokens after every
    row read, if top_k > 0). Any source is exact: verification accepts only the guesses greedy
    decoding would produce."""

    top_k = 0

    def propose(self, seq: "Sequence", k: int) -> list[Candidate]:
        return []

    def wants_rankings(self, room: int) -> bool:
        """With top_k > 0: whether the model's top_k after every row is worth reading before steps
        of `room` guesses: after every row a step reads (Verified.top, else None) and, as the
        request starts, after every prompt token (observe_prefill; that is the LM head over the
        whole prompt, 20% of SmolLM2's prefill, 60% of Gemma 3's)."""
        return True

    def observe_prefill(self, seq: "Sequence", top: list[list[int]]):
        """The model's top_k best tokens after every prompt token, once, if it wants_rankings."""

    def observe(self, seq: "Sequence", step: "Verified"):
        pass


def token_back(seq, n: int) -> int:
    """The n-th token from the end of prompt + tokens (n >= 1), without joining the two."""
    return seq.tokens[-n] if n <= len(seq.tokens) else seq.prompt[len(seq.tokens) - n]


class NGramPool(DraftSource):
    """n-grams seen so far (Sequence adds the prompt's, the window's and the committed text's),
    keyed by their first token, at most `cap` per key, least recently seen evicted first. Each
    remembers the tokens seen right before it (for ranked) and whether the window made it."""

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
        """The continuations of `key` as (rest, seen after `before`?, from the window?): those seen
        after `before` (the token before `key` now) first, most recent first in each. Two tokens of
        context pick better than one (the summary prompt: 3.2 tokens per step at 1,4,1, not 2.1)."""
        entries = [(rest, before in seen, win) for rest, (seen, win) in reversed(self.by_key.get(key, {}).items())]
        return [e for e in entries if e[1]] + [e for e in entries if not e[1]]

    def propose(self, seq, k):
        """The pooled n-grams that start with `last`: "pool2" those that also matched the token
        before it (two tokens of context), "pool1" the others."""
        return [Candidate(rest[:k], "pool2" if after else "pool1", win)
                for rest, after, win in self.ranked(seq.tokens[-1], token_back(seq, 2))]


class JacobiGuess(DraftSource):
    """The model's own predictions left over from the step before. The first rejected guess's
    rows predicted what follows the commit from a context wrong in one token: as in Jacobi
    decoding, a guess for the next step, and often right.

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

    def keep(self, nodes) -> "Tree":
        """The sub-trie of these nodes (closed under parents), rebuilt from the candidates in
        their order, so each node keeps the first candidate through it."""
        keep = set(nodes) | {0}
        out = self.replaced(())
        for candidate in self.candidates:
            v, kept = 0, []
            for tok in candidate.tokens:
                v = self.children[v][tok]
                if v not in keep:
                    break
                kept.append(tok)
            out.add(replace(candidate, tokens=tuple(kept)))
        return out

    def replaced(self, candidates) -> "Tree":
        """The trie of other candidates for the same `last`."""
        return Tree(self.tokens[0], candidates)

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


@dataclass
class Verified:
    """What one row's step did, for the draft sources, the policy and the loop: the trie run and
    w window columns, the token at every row read (read: the trie's nodes, then the newest window
    level's) and the model's prediction after each (pred; top: its best tokens there, if a source
    asked), the accepted nodes (path), the tokens committed, and the cache slots (after C)
    holding the committed K/V."""
    tree: Tree
    w: int
    read: list[int]
    pred: list[int]
    top: list[list[int]] | None
    path: list[int]
    committed: list[int]
    slots: list[int]


class Sequence:
    """One prompt's lookahead state, a row of the batch: committed tokens, window, n-gram pool,
    draft sources. The loop asks every row to propose, runs one forward for all, and hands each
    row what verification decided (advance)."""

    def __init__(self, prompt_ids, max_new_tokens, N, pool_cap, sampling, seed, stop, dev, output_ngrams, drafts):
        self.prompt, self.max_new, self.stop, self.N = list(prompt_ids), max_new_tokens, stop, N
        self.sampling, self.output_ngrams = sampling, output_ngrams
        self.C = len(prompt_ids)  # committed slots: `last` (tokens[-1]) sits at slot and position C
        self.tokens = []
        self.out = Generation(self.tokens, 0, 0.0)  # the same list: its tokens grow with commit
        # Window: up to N-1 levels of columns; a column's level 0 starts as a random prompt token
        # (any guess converges; seeded, so runs repeat). Verification does not wait for it to fill.
        self.window = []
        self.window_rng, self.rng = random.Random(seed), random.Random(seed + 1)
        self.gen = torch.Generator(dev).manual_seed(seed)  # sampling's draws, seeded like the window
        # Pool: seeded with the prompt's own n-grams, which pays off whenever the answer copies
        # (commit adds the n-grams of the committed text as it grows).
        self.pool = NGramPool(pool_cap)
        for i in range(len(self.prompt) - N + 1):
            self.pool.add(self.prompt[i:i + N], self.prompt[i - 1] if i else None)
        self.sources = drafts(self) if drafts else [self.pool, JacobiGuess()]  # the paper's two sources
        self.room = 0  # the most guesses the next step may hold (the policy's room, set before it proposes)

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
            N, text = self.N, self.prompt + self.tokens
            for end in range(max(N, len(text) - len(new_tokens) + 1), len(text) + 1):
                self.pool.add(text[end - N:end], text[end - N - 1] if end > N else None)
        return new_tokens

    def propose(self) -> list[Candidate]:
        """1. Propose: every draft source's continuations of `last`, in the sources' order (the
        pool's, then the Jacobi guess). None need guess past max_new_tokens; how far short of it
        a chain stops is its source's choice (a pooled n-gram's rest is N-1 guesses, token
        recycling's up to 6), how many of its guesses are worth a step the policy's."""
        k = self.max_new - len(self.tokens) - 1
        if k <= 0:
            return []
        return [replace(c, tokens=tuple(c.tokens[:k])) for s in self.sources for c in s.propose(self, k) if c.tokens]

    def inputs(self, tree: Tree, w: int, size: int):
        """The row's part of the step, padded to `size` (step_inputs), with w window columns: a
        new column starts from a random prompt token; a narrowed window loses its rightmost ones."""
        if w:
            fresh = lambda n: [self.window_rng.choice(self.prompt) for _ in range(n)]
            self.window = [level[:w] + fresh(w - len(level)) for level in self.window] or [fresh(w)]
        return step_inputs(tree, self.window, w, size)

    def advance(self, tree: Tree, w: int, pred: list[int], top, path: list[int], bonus: int, shape: Shape,
                on_step=None) -> Verified:
        """5 to 7 for this row, once verification accepted `path` and the `bonus` token."""
        # 5. Roll back: `last` is in slot C; the accepted guesses' K/V move from their slots (node
        #    i is in slot C + i) to C+1... as they are: same tokens, same positions, exactly the
        #    committed context, so what a sequential run would have written. The rest of the
        #    step's slots lie past the committed length: overwritten next step.
        slots = [self.C] + [self.C + v for v in path]
        self.C += len(slots)
        # Before the window moves on: the tokens of the rows read, and the trace.
        read = tree.tokens + (self.window[-1][:w] if w else [])
        trace = on_step and self.trace(tree, w, shape, path)
        self.jacobi_update(tree.tokens[0], pred[len(tree):len(tree) + w])
        # 7. Commit, stopping exactly where greedy would: at a stop id, or at max_new_tokens;
        #    then every draft source sees the step.
        step = Verified(tree, w, read, pred, top, path, self.commit([tree.tokens[v] for v in path] + [bonus]), slots)
        for source in self.sources:
            source.observe(self, step)
        on_step and on_step({**trace, "committed": step.committed})
        self.out.steps += 1
        self.out.committed.append(len(step.committed))
        self.out.shapes.append(shape)
        return step

    def jacobi_update(self, last: int, new_level: list[int]):
        """6. The window's Jacobi update: the newest level's predictions become a new level; once
        the window is full, each column plus its prediction is an N-gram for the pool, and the
        oldest level drops out. Its positions stay relative to `last`: after a multi-token step
        the window is not realigned with the text (this costs acceptance, never exactness)."""
        window = self.window
        if not new_level:
            return  # no window this step
        if len(window) == self.N - 1:
            for j in range(len(new_level)):
                # column j's trajectory continues level 0 after its column j-1 (or `last`)
                self.pool.add([level[j] for level in window] + [new_level[j]], window[0][j - 1] if j else last,
                              from_window=True)
            window.pop(0)
        window.append(new_level)

    def trace(self, tree, w, shape, path) -> dict:
        """What a step did, for on_step (--trace)."""
        accepted = [tree.tokens[v] for v in path]
        winner = next((g for g, c in enumerate(tree.candidates) if list(c.tokens[:len(accepted)]) == accepted), 0)
        return dict(step=self.out.steps, shape=shape, last=tree.tokens[0],
                    window=[level[:w] for level in self.window[:shape.levels]],
                    candidates=[list(c.tokens) for c in tree.candidates],
                    sources=[c.source for c in tree.candidates], winner=winner, accepted=len(path))


def verify(row: Sequence, tree: Tree, pred: list[int], logits) -> tuple[list[int], int]:
    """4. Verify the guesses against the model's own choices (greedy: its argmax; sampling: a
    rejection test that keeps plain sampling's distribution)."""
    if row.sampling.greedy:
        return verify_greedy(tree, pred)
    return verify_sampled(tree, row.sampling.probs(logits[:len(tree)]), row.rng, row.gen)


def pack_inputs(model, batch: list[Sequence], parts: list, T: int):
    """The step's inputs for every row, built on the host and sent in ONE host-to-device copy
    (five tensors a row would be five copies, each a sync point on a GPU): tokens (B, T),
    positions (B, T), committed (B, 1), the in-step block mask (B, T, T), the span of committed
    lengths (on the host) and the logits rows to read (B, R). Row b's step sits in slots C_b ..
    C_b+T-1, after its committed ones, which all its tokens see: only the block is per token."""
    dev, B = model.device, len(batch)
    R = max(len(read) for *_, read in parts)
    packed = torch.cat([torch.cat((seq, offsets, block.flatten(), torch.tensor(read + read[:1] * (R - len(read))),
                                   torch.tensor([row.C]))) for row, (seq, offsets, block, read) in zip(batch, parts)]
                       ).to(dev).view(B, -1)
    tokens, offsets, block, read, C = packed.split((T, T, T * T, R, 1), dim=1)
    span = min(row.C for row in batch), max(row.C for row in batch)
    return tokens, C + offsets, C, block.reshape(B, T, T).bool(), span, read


def lookahead_step(model, policy, batch: list[Sequence], on_step=None):
    """One forward for every row: propose, plan, inputs, forward, verify, advance, roll back."""
    start = time.perf_counter()
    budget = min(policy.largest, *(step_room(model, row.C) for row in batch))
    room = min(budget, policy.room(len(batch))) - 1  # guesses: all of the step but `last`
    for j, row in enumerate(batch):
        switch_rope(model, j, row.C, row.prompt + row.tokens)
        row.room = room
    # 1. Every row proposes its candidates (Sequence.propose), merged into a trie.
    trees = [Tree(row.tokens[-1], row.propose()) for row in batch]
    # 2. The policy shapes the step: which guesses and how many window columns each row runs,
    #    padded to one size T of the menu (FixedShape: the paper's; DynamicShape: measured).
    plans = policy.plan(batch, trees, budget)
    T = max(shape.size for _, _, shape in plans)
    # 3. One forward over every row's [tree | window | padding] under the combined mask.
    parts = [row.inputs(tree, w, T) for row, (tree, w, _) in zip(batch, plans)]
    logits = model.step(*pack_inputs(model, batch, parts, T))  # (B, R, V)
    k = max((s.top_k for row in batch for s in row.sources if s.top_k and s.wants_rankings(row.room)), default=0)
    if k:  # the argmax and the top-k, in one host sync
        best = torch.cat((logits.argmax(-1, keepdim=True), logits.topk(k, dim=-1).indices), dim=-1).tolist()
        pred, top = [[r[0] for r in rows] for rows in best], [[r[1:] for r in rows] for rows in best]
    else:
        pred, top = logits.argmax(-1).tolist(), [None] * len(batch)  # the one host sync per greedy step
    # 4 to 7. Every row verifies its guesses and advances; then the cache keeps what each committed.
    steps = [row.advance(tree, w, pred[j], top[j], *verify(row, tree, pred[j], logits[j]), shape,
                         on_step and (lambda s, j=j: on_step(j, s)))
             for j, (row, (tree, w, shape)) in enumerate(zip(batch, plans))]
    model.rollback([step.slots for step in steps])
    policy.observe(batch, steps, T, time.perf_counter() - start)


def start_rows(model, rows: list[Sequence], sampling: Sampling, room: int, start: float, on_tokens=None):
    """Prefill every row's prompt and commit its first token; the draft sources that want the
    model's top-k after every prompt token before steps of `room` guesses see it."""
    readers = [[s for s in row.sources if s.top_k and s.wants_rankings(room)] for row in rows]
    k = max((s.top_k for sources in readers for s in sources), default=0)
    prompts = [row.prompt for row in rows]
    logits, tops = prefill(model, prompts, k) if k else (prefill(model, prompts), None)
    first = sampling.pick(logits, [row.gen for row in rows])[:, 0].tolist()
    for b, row in enumerate(rows):
        for source in readers[b]:
            source.observe_prefill(row, tops[b])
        row.out.prefill_seconds = time.perf_counter() - start
        kept = row.commit(first[b:b + 1])
        on_tokens and on_tokens(b, kept)


@torch.inference_mode()
def lookahead_decode(model, prompt_ids, max_new_tokens, *, window=None, ngram=None, candidates=None, stop_ids=(),
                     seed=0, temperature=0.0, top_k=0, top_p=1.0, output_ngrams=True, drafts=None, costs=None,
                     on_tokens=None, on_step=None) -> Generation:
    """Several tokens per forward: greedy_decode's tokens (sampling with temperature/top_k/top_p:
    sample_decode's distribution). window W, ngram N (default 5), candidates G: that fixed shape
    every step (the paper's); neither W nor G: the dynamic shape, chosen per step from the
    acceptance seen and the step costs measured (`costs` replaces them; with measured costs a
    seed's sampled tokens depend on timing). output_ngrams: pool the committed text's n-grams too
    (the prompt's always). drafts(seq) -> the row's DraftSources (default: the pool, the Jacobi
    guess). on_tokens(new ids) as tokens are committed; on_step(dict) after each step (--trace)."""
    return lookahead_decode_batch(model, [prompt_ids], max_new_tokens, window=window, ngram=ngram,
                                  candidates=candidates, stop_ids=stop_ids, seed=seed, temperature=temperature,
                                  top_k=top_k, top_p=top_p, output_ngrams=output_ngrams, drafts=drafts, costs=costs,
                                  on_tokens=per_row(on_tokens), on_step=on_step and (lambda _, s: on_step(s)))[0]


@torch.inference_mode()
def lookahead_decode_batch(model, prompts, max_new_tokens, *, window=None, ngram=None, candidates=None, stop_ids=(),
                           seed=0, temperature=0.0, top_k=0, top_p=1.0, output_ngrams=True, drafts=None, costs=None,
                           on_tokens=None, on_step=None) -> list[Generation]:
    """lookahead_decode for several prompts, one forward per step for all of them: row b is
    exactly its own lookahead_decode (seed + b), with its own window, pool, shape and rollback.

    The step of B rows is their steps side by side, each padded to the batch's size T:

        row 0   [ last | guesses | window | padding ]   slots C0 .. C0+T-1 of cache row 0
        row 1   [ last | guesses | window .......... ]   slots C1 .. C1+T-1 of cache row 1

    A row's mask is its committed slots plus its own block: rows never see each other. A finished
    row leaves the batch and the cache. on_tokens(row, new ids), on_step(row, dict)."""
    policy = shape_policy(model, window, ngram, candidates, costs)
    sampling = Sampling(temperature, top_k, top_p)
    start = time.perf_counter()
    limits = check_requests(model, prompts, max_new_tokens)
    longest = max(len(p) + m - 1 for p, m in zip(prompts, limits))
    ensure_cache(model, min(model.args.max_seq_len, longest + policy.largest), len(prompts))
    rows = [Sequence(p, m, policy.N, policy.pool_cap, sampling, seed + b, set(stop_ids), model.device, output_ngrams,
                     drafts) for b, (p, m) in enumerate(zip(prompts, limits))]

    start_rows(model, rows, sampling, policy.room(len(rows)) - 1, start, on_tokens)
    active = list(range(len(rows)))  # the rows still decoding, in the cache's row order
    while True:  # finished rows leave the batch (and the cache)
        keep = drop_finished(model, active, lambda b: rows[b].done, [row.out for row in rows],
                             max(rows[b].C for b in active), start)
        if not keep:
            return [row.out for row in rows]
        active = [active[j] for j in keep]
        lookahead_step(model, policy, [rows[b] for b in active], on_step and (lambda j, s: on_step(active[j], s)))
        for b in active:
            on_tokens and on_tokens(b, rows[b].tokens[len(rows[b].tokens) - rows[b].out.committed[-1]:])


if __name__ == "__main__":  # the command line lives in cli.py; `python lookahead.py --prompt ...` runs it
    from cli import main
    raise SystemExit(main())

"""Lookahead decoding (Fu, Bailis, Stoica, Zhang, ICML 2024, arXiv 2402.02057) for one prompt,
greedy, in the paper's fixed shape: this file is the paper, read top to bottom.

Greedy decoding is the fixed point of y_i = argmax p(. | prompt, y_<i) for all future i at once.
Jacobi iteration guesses many future tokens and refines them all in parallel; each refined guess
drags an n-gram behind it. Lookahead decoding keeps a 2-D window of those guesses, pools the
n-grams they trace, and in the SAME forward verifies the pooled n-grams that start with the last
token: what verification accepts is exactly what greedy decoding produces.

Words (one meaning each):
  step       one forward of the model, after which 1 to N tokens are committed
  last       the newest committed token: the next step runs it first
  C          the slot and position of `last`: as many tokens as the text holds before it
             (the prompt and the tokens committed so far, less `last`)
  slot       a place in the KV cache: slot s holds the keys and values of the text's token s
  position   a token's RoPE position: the committed text's token s sits at position s; a token
             of a step sits at C + the length of its context within the step
  guess      a guessed token waiting for verification: a node of the trie
  candidate  a chain of guesses continuing `last`: the rest of a pooled n-gram
  read       the step's tokens whose next-token predictions are computed: the trie and the
             window's newest level (the model's `read=` keyword takes their indices)
  window     W columns x (N-1) levels of tokens refined by Jacobi iteration; each column plus
             the model's prediction after it is an n-gram (N tokens)
  pool       the n-grams seen so far, by first token; those starting with `last` are candidates
  trie       the candidates merged on shared prefixes: each distinct guess is run once
  mask       the step's (T x T) booleans: mask[q, k] says whether token q may attend to token k
  commit     append the accepted guesses and the model's next token to the output
  roll back  keep in the cache only the committed tokens' K/V
  W, N, G    the paper's window columns, n-gram size, candidates verified a step

One step (lookahead_step), numbered as in the code:

    1 candidates  the pool's n-grams that start with `last`, merged into a trie
    2 window      the columns to run
    3 inputs      tokens, positions, one mask
    4 forward     the model
    5 verify      the longest chain of guesses the model itself agrees with
    6 Jacobi      a new window level; full columns' n-grams pooled
    7 commit      the accepted guesses and the model's next token
    8 roll back   keep the committed tokens' K/V

engine.py runs the same parts fast, for batches, other draft sources, sampling and a shape
chosen per step; test_lookahead.py proves the two take the same steps.
"""
import random
import time
from dataclasses import dataclass

import torch

from decoding import Generation, check_requests

POOL_LEAST = 8  # n-grams the pool keeps a key at least: a few to rank from even for a small G


def pool_cap(G: int) -> int:
    """How many n-grams the pool keeps a key: G, at least POOL_LEAST (none where G is 0)."""
    return max(G, POOL_LEAST) if G else 0


class NGramPool:
    """The n-grams seen so far (the prompt's, the window's, the committed text's) by first token,
    at most `cap` a key, the least recently seen dropped first. Each keeps the tokens seen right
    before it. Beyond the paper (which verifies a key's latest n-grams): those seen after the
    token before `last` now go first, as two tokens of context pick better than one."""

    def __init__(self, cap: int):
        self.cap = cap
        self.by_key: dict[int, dict] = {}  # first token -> {rest: tokens before it}, oldest first

    def add(self, ngram, before=None):
        if self.cap == 0:
            return
        key, rest = ngram[0], tuple(ngram[1:])
        entries = self.by_key.setdefault(key, {})
        seen = entries.pop(rest, None)  # seen again: it moves to the end, the most recent
        if seen is None:
            seen = ()
            if len(entries) == self.cap:
                del entries[next(iter(entries))]
        entries[rest] = seen if before is None or before in seen else seen + (before,)

    def add_text(self, text, new: int, N: int):
        """Pool the n-grams of `text` that end in its last `new` tokens, each with the token
        before it (none at the text's start)."""
        for end in range(max(N, len(text) - new + 1), len(text) + 1):
            self.add(text[end - N:end], text[end - N - 1] if end > N else None)

    def ranked(self, key, before=None) -> list[tuple]:
        """The continuations of `key`: those seen after `before` first, the latest first in each."""
        entries = list(reversed(self.by_key.get(key, {}).items()))  # the latest first
        after = [rest for rest, seen in entries if before in seen]
        return after + [rest for rest, seen in entries if before not in seen]


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

    Children keep the candidates' order (dicts keep insertion order): a node's first child is
    the best-ranked candidate through it."""

    def __init__(self, last: int, candidates=()):
        self.tokens, self.parent, self.depth = [last], [-1], [0]
        self.children: list[dict] = [{}]  # node -> {token: child node}
        for chain in candidates:
            self.add(chain)

    def add(self, chain):
        """Merge one candidate, a chain of guesses continuing `last`."""
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
            v = child

    def __len__(self):
        return len(self.tokens)


def fill_window(window: list[list[int]], W: int, prompt: list[int],
                rng: random.Random) -> list[list[int]]:
    """The window's levels with W columns each: a column it lacks (at the start, every column)
    starts from a random prompt token, its later levels then grown by the steps. A new window
    has one level."""
    fresh = lambda n: [rng.choice(prompt) for _ in range(n)]
    levels = [level if len(level) == W else level[:W] + fresh(W - len(level)) for level in window]
    return levels or [fresh(W)]


def step_mask(tree: Tree, W: int, L: int) -> tuple[torch.Tensor, list[int]]:
    """3. The step's (T x T) mask over [ trie | window: L levels of W columns ], T = len(tree) +
    W*L, and each token's position after C. Every token sees exactly its own trajectory: a
    guess its ancestors, the window's token (level l, column j) `last`, level 0 up to column j
    (a causal run continuing `last`) and its own column above it (the levels it came from).
    W=3, L=2 after a trie of `last` and one guess g; 'x' = may attend:

                     last  g   a0 a1 a2  b0 b1 b2      position (C + ...)
        trie   last   x                                  0
               g      x    x                             1
        level 0  a0   x        x                         1
                 a1   x        x  x                      2
                 a2   x        x  x  x                   3
        level 1  b0   x        x         x               2
                 b1   x        x  x         x            3
                 b2   x        x  x  x         x         4

    The committed text is not in this mask: every token of the step sees all of it."""
    n, T = len(tree), len(tree) + W * L
    mask = [[False] * T for _ in range(T)]
    for q in range(n):  # a guess: its chain of ancestors, and itself
        k = q
        while k != -1:
            mask[q][k] = True
            k = tree.parent[k]
    for level in range(L):
        for j in range(W):
            q = n + level * W + j
            mask[q][0] = True  # `last`
            for column in range(j + 1):
                mask[q][n + column] = True  # level 0, columns 0..j
            for up in range(1, level + 1):
                mask[q][n + up * W + j] = True  # its own column, levels 1..level
    return torch.tensor(mask), tree.depth + [1 + j + level for level in range(L) for j in range(W)]


def verify_greedy(tree: Tree, pred: list[int]) -> tuple[list[int], int]:
    """5. Greedy verification -> (accepted nodes, bonus token), pred[i] the model's next token
    after node i. From `last`, follow the child the model predicted while there is one: those
    guesses are greedy's tokens, and the prediction after the last of them comes free."""
    path, v = [], 0
    while (child := tree.children[v].get(pred[v])) is not None:
        path.append(child)
        v = child
    return path, pred[v]


def update_window(window: list[list[int]], new_level: list[int], last: int, N: int) -> list[tuple]:
    """6. One Jacobi iteration, in place: the newest level's predictions are a new level; once
    the window is full (N-1 levels), each column plus its prediction is an n-gram, returned
    with the token before it for the pool, and the oldest level drops out. Positions stay
    relative to `last`, not realigned after a multi-token step: that costs acceptance, never
    exactness.

        level 0   a0 a1 a2        column j + its prediction p_j -> n-gram (a_j b_j ... p_j),
        level 1   b0 b1 b2        seen after a_{j-1} (a column continues level 0 to its left,
        new       p0 p1 p2        or `last`)
    """
    completed = []
    if len(window) == N - 1:
        ngrams = zip(*window, new_level)  # column j, top to bottom, and its prediction
        completed = list(zip(ngrams, [last, *window[0]]))
        window.pop(0)
    window.append(new_level)
    return completed


def commit(prompt, tokens: list[int], new, max_new: int, stop, pool: NGramPool | None,
           N: int) -> list[int]:
    """7. Append `new` to `tokens`, cut exactly where greedy stops (at a stop id, at max_new
    tokens), and pool the n-grams that end in it (none where pool is None). Returns what was
    kept."""
    new = new[:max_new - len(tokens)]
    new = new[:next((i + 1 for i, t in enumerate(new) if t in stop), None)]
    tokens += new
    if pool is not None:  # the text's last N + len(new) tokens: the new n-grams and what precedes
        k = N + len(new)
        pool.add_text(tokens[-k:] if len(tokens) >= k else prompt[len(tokens) - k:] + tokens,
                      len(new), N)
    return new


def rollback_moves(C: int, path: list[int]) -> list[tuple[int, int]]:
    """8. The roll back's cache moves, (from, to) slots: the step wrote trie node v's K/V in
    slot C + v, and the accepted nodes' are exactly what a one-token-at-a-time run writes (same
    tokens, positions, context), so the i-th accepted moves next to `last`'s, to C + 1 + i.
    The rest lies past the committed length, overwritten by the next step.

        slots  C    C+1  C+2  C+3  C+4            C    C+1  C+2
               last  a    b    x    c     ->      last  a    c       path: a, c -> [(C+4, C+2)]
    """
    return [(C + v, C + 1 + i) for i, v in enumerate(path) if v != 1 + i]


@dataclass
class StepRecord:
    """What one step did: what --explain prints, and what the two implementations compare."""
    C: int  # the slot and position of `last` when the step ran
    tree: Tree
    window: list  # its levels as run, W tokens each (none: no window)
    pred: list[int]  # the model's next token after each trie node, then each newest-level token
    path: list[int]  # the accepted nodes
    committed: list[int]
    pooled: list  # the n-grams the window's columns completed


@dataclass
class State:
    """One prompt's decoding: the committed text, C (the slot and position of `last`), the
    window and the pool."""
    prompt: list[int]
    tokens: list[int]
    C: int
    window: list
    pool: NGramPool
    rng: random.Random  # new window columns start from random prompt tokens


def lookahead_step(model, s: State, W: int, N: int, G: int, max_new: int, stop) -> StepRecord:
    """One forward, the eight parts of the module docstring."""
    last, C, dev = s.tokens[-1], s.C, model.device
    # 1. Candidates: the pool's first G n-grams that start with `last` (those seen after the
    #    token before it first), none past max_new, merged into the trie.
    K = min(N - 1, max_new - len(s.tokens) - 1)
    before = s.tokens[-2] if len(s.tokens) > 1 else s.prompt[-1]
    tree = Tree(last, [rest[:K] for rest in s.pool.ranked(last, before)[:G]] if K > 0 else [])
    if C + len(tree) + W * (N - 1) > model.args.max_seq_len:
        tree, W = Tree(last), 0  # near the context's end, no room for guesses: `last` alone
    # 2. The window: W columns, as many levels as it has grown (1 to N-1).
    if W:
        s.window = fill_window(s.window, W, s.prompt, s.rng)
    levels = s.window[:] if W else []  # as run: update_window changes s.window
    size, L = len(tree), len(levels)
    # 3. Inputs: [ trie | window ], every token at its own position, under one mask.
    mask, offsets = step_mask(tree, W, L)
    tokens = tree.tokens + [t for level in levels for t in level]
    read = list(range(size)) + list(range(size + (L - 1) * W, size + L * W))  # trie, newest level
    # 4. Forward: the step's tokens fill slots C .. C+T-1, each seeing every committed slot
    #    too; the logits at the tokens read only.
    logits = model(torch.tensor([tokens], device=dev),
                   positions=torch.tensor([[C + o for o in offsets]], device=dev),
                   committed=torch.tensor([[C]], device=dev), mask=mask[None].to(dev),
                   committed_range=(C, C), read=torch.tensor(read, device=dev))  # (1, R, V)
    pred = logits[0].argmax(-1).tolist()
    # 5. Verify: the longest chain of guesses the model agrees with, plus its next token.
    path, bonus = verify_greedy(tree, pred)
    # 6. Jacobi: the newest level's predictions are the next level; a full window's columns
    #    are n-grams, pooled.
    completed = update_window(s.window, pred[size:size + W], last, N) if W else []
    for ngram, before_it in completed:
        s.pool.add(ngram, before_it)
    # 7. Commit, stopping exactly where greedy would; the committed text's n-grams are pooled.
    new = [tree.tokens[v] for v in path] + [bonus]
    committed = commit(s.prompt, s.tokens, new, max_new, stop, s.pool, N)
    # 8. Roll back: the accepted guesses' K/V move next to `last`'s; `last` moves on past them.
    model.cache.rollback([rollback_moves(C, path)])
    s.C += 1 + len(path)
    return StepRecord(C, tree, levels, pred, path, committed, [ngram for ngram, _ in completed])


@torch.inference_mode()
def lookahead_decode(model, prompt_ids, max_new_tokens, *, window, ngram, candidates,
                     stop_ids=(), on_step=None) -> Generation:
    """Greedy decoding's tokens for one prompt, 1 to N of them a forward: the paper's W, N, G
    (window, ngram, candidates). on_step(StepRecord) after each step. engine.generate is the
    same decode, fast and with more options."""
    W, N, G = window, ngram, candidates
    if N < 2 or W < 0 or G < 0:
        raise ValueError(f"need ngram >= 2, window >= 0 and candidates >= 0 (got {W}, {N}, {G})")
    start, prompt = time.perf_counter(), list(prompt_ids)
    # A bad request gets a clear error; max_new_tokens comes back cut to what the context holds.
    max_new = check_requests(model, [prompt], max_new_tokens)[0]
    scaling = model.args.rope_scaling or {}
    if (scaling.get("rope_type") == "longrope"
            and len(prompt) + max_new > scaling["original_max_position_embeddings"]):
        raise ValueError("this request crosses Phi-3's longrope switch: engine.generate runs it")
    slots = min(model.args.max_seq_len, len(prompt) + max_new + (W + G) * (N - 1))
    if model.cache.slots < slots or model.cache.rows != 1:
        model.cache.setup(slots)
    # The prompt fills slots 0 .. P-1, causally; its last logits give the first token.
    dev = model.device
    logits = model(torch.tensor([prompt], device=dev),
                   committed=torch.zeros(1, 1, dtype=torch.long, device=dev),
                   committed_range=(0, 0), prompt_end=len(prompt) - 1,
                   read=torch.tensor([len(prompt) - 1], device=dev))
    s = State(prompt, [], len(prompt), [], NGramPool(pool_cap(G)), random.Random(0))
    s.pool.add_text(prompt, len(prompt), N)  # answers copy their prompt
    stop = set(stop_ids)
    commit(prompt, s.tokens, logits[0, -1:].argmax(-1).tolist(), max_new, stop, s.pool, N)
    out = Generation(s.tokens, 0, 0.0, prefill_seconds=time.perf_counter() - start)
    while len(s.tokens) < max_new and s.tokens[-1] not in stop:
        step = lookahead_step(model, s, W, N, G, max_new, stop)
        out.steps += 1
        out.committed.append(len(step.committed))
        on_step and on_step(step)
    out.seconds = time.perf_counter() - start
    return out


if __name__ == "__main__":  # the command line lives in cli.py: `python lookahead.py --prompt ...`
    from cli import main
    raise SystemExit(main())

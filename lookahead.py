"""Lookahead decoding (Fu, Bailis, Stoica, Zhang, ICML 2024, arXiv 2402.02057), exactly greedy.

Greedy decoding is the fixed point of y_i = argmax p(. | prompt, y_<i) for all future i at
once. Jacobi iteration guesses many future tokens and refines them in parallel; each guess
drags an n-gram behind it. Lookahead decoding keeps a 2-D window of those guesses, collects
the n-grams they trace into a pool, and in the SAME forward pass verifies the pooled n-grams
that start with the last token. Whatever verification accepts is exactly what greedy decoding
would have produced, so the output is unchanged; a step just commits up to N tokens.

Read it top to bottom: Generation; greedy_decode and sample_decode (the baselines); NGramPool;
Tree (the candidates as a trie); window_layout and step_inputs (the attention mask);
verify_greedy and verify_sampled; StepCosts, Acceptance and choose_shape (the dynamic shape);
lookahead_decode (propose, shape, one forward, verify, commit/rollback, the Jacobi guess, the
window update). The command line is cli.py.
"""
import math
import random
import statistics
import sys
import time
import weakref
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from model import STEP_SIZES, Transformer, step_size


@dataclass
class Generation:
    tokens: list[int]  # the new ids; a stop id, when generated, is the last one
    steps: int  # forward passes after the prefill
    seconds: float  # wall time, prefill included
    accepted: list[int] = field(default_factory=list)  # tokens committed by each step
    shapes: list = field(default_factory=list)  # lookahead: each step's Shape
    prefill_seconds: float = 0.0  # of `seconds`: the prompt's forward and the first token

    @property
    def tokens_per_step(self) -> float:
        """The compression ratio: 1.0 for greedy, up to N for lookahead."""
        return sum(self.accepted) / self.steps if self.steps else 1.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """The tokens after the first, per second of decoding (the prefill left out)."""
        decode = self.seconds - self.prefill_seconds
        return (len(self.tokens) - 1) / decode if decode > 0 else 0.0

    @property
    def histogram(self) -> dict[int, int]:
        """How many steps committed 1, 2, ... tokens."""
        return dict(sorted(Counter(self.accepted).items()))


def check_requests(model: Transformer, prompts, max_new_tokens: int) -> list[int]:
    """Validate a batch of requests before any work; return how many tokens each may generate
    (the context bounds it)."""
    context = model.args.max_seq_len
    if not prompts:
        raise ValueError("no prompts given")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    for i, prompt_ids in enumerate(prompts):
        which = f" (prompt {i + 1} of {len(prompts)})" if len(prompts) > 1 else ""
        if not prompt_ids:
            raise ValueError(f"the prompt is empty{which}")
        if min(prompt_ids) < 0 or max(prompt_ids) >= model.args.vocab_size:
            raise ValueError(f"prompt ids must lie in [0, {model.args.vocab_size}){which}")
        if len(prompt_ids) >= context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {context}{which}")
    if len(prompts) > 1 and model.compiled_step is not None:
        raise ValueError("a compiled model decodes one sequence at a time; load it without compile for a batch")
    # The last generated token never needs a K/V slot, so m tokens need len(prompt) + m - 1.
    return [min(max_new_tokens, context - len(p)) for p in prompts]


def ensure_cache(model: Transformer, needed: int, rows: int):
    """Reuse the model's KV cache when it has the rows and is long enough; else allocate once,
    with headroom for longer requests."""
    if model.cache_len < needed or model.cache_rows != rows:
        grown = 2 * model.cache_len if model.cache_rows == rows else 0
        model.setup_cache(min(model.args.max_seq_len, max(needed, grown, 256)), rows)


def prefill(model: Transformer, prompts) -> torch.Tensor:
    """Run each prompt through the model, prompt b filling slots [0, P_b) of cache row b; return
    the logits (B, V) that predict each first new token. Causal without a mask (model.forward),
    so a long prompt costs memory linear in its length; one prompt at a time, so that prompts
    of different lengths cost the sum of their lengths, not B times the longest."""
    logits = []
    for b, prompt_ids in enumerate(prompts):
        P = len(prompt_ids)
        idx = torch.arange(P, device=model.device)
        tokens = torch.tensor([prompt_ids], device=model.device)  # (1, P)
        logits.append(model(tokens, idx, idx, rows=idx[-1:], cache_row=b)[:, -1])
    return torch.cat(logits)  # (B, V)


@dataclass(frozen=True)
class Sampling:
    """Temperature, top-k (0 = off) and top-p (1 = off). Temperature 0 or top_k 1 is greedy."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k, top-p."""
        logits = logits.float() / self.temperature
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1])).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1:
            # Keep the most likely tokens until their mass reaches top_p (the one crossing it too).
            sorted_logits, order = logits.sort(-1, descending=True)
            p = sorted_logits.softmax(-1)
            drop = p.cumsum(-1) - p >= self.top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        return logits.softmax(-1)

    def pick(self, logits: torch.Tensor, generators) -> torch.Tensor:
        """(B, V) logits -> (B, 1) tokens: the argmax when greedy, else a draw from probs with
        row b's own generator."""
        if self.greedy:
            return logits.argmax(-1, keepdim=True)
        probs = self.probs(logits)
        return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])[:, None]


GREEDY = Sampling(temperature=0)


def one_by_one(model, prompts, max_new_tokens, stop_ids, on_tokens, sampling, seed=0) -> list[Generation]:
    """Prefill, then one token per forward for each row, reusing the cache. Row b's last token
    sits at slot and position C[b]; every step runs every unfinished row's last token."""
    start = time.perf_counter()
    limits = check_requests(model, prompts, max_new_tokens)
    ensure_cache(model, max(len(p) + m - 1 for p, m in zip(prompts, limits)), len(prompts))
    stop, dev = set(stop_ids), model.device
    gens = [torch.Generator(dev).manual_seed(seed + b) for b in range(len(prompts))]

    next_tokens = sampling.pick(prefill(model, prompts), gens)  # (B, 1): stays on the device as the input
    tokens = [[t] for t in next_tokens[:, 0].tolist()]
    out = [Generation(t, 0, 0.0, prefill_seconds=time.perf_counter() - start) for t in tokens]
    C = torch.tensor([[len(p)] for p in prompts], device=dev)  # (B, 1)
    lengths = [len(p) for p in prompts]  # C on the host, for the mask's width
    active = list(range(len(prompts)))  # the rows still decoding, in the cache's row order
    for b in active:
        on_tokens and on_tokens(b, tokens[b])
    while True:
        keep = [j for j, b in enumerate(active) if len(tokens[b]) < limits[b] and tokens[b][-1] not in stop]
        for j in set(range(len(active))) - set(keep):
            out[active[j]].seconds = time.perf_counter() - start
        if len(keep) < len(active):  # finished rows leave the batch (and the cache)
            if not keep:
                return out
            active, C, next_tokens = [active[j] for j in keep], C[keep], next_tokens[keep]
            model.keep_rows(keep, max(lengths) + 1)
        S = mask_width(model, max(lengths[b] for b in active) + 1)
        mask = (torch.arange(S, device=dev) <= C)[:, None]  # (B, 1, S): the committed slots and its own
        logits = model.step(next_tokens, C, C, mask)  # (B, 1, V)
        next_tokens = sampling.pick(logits[:, -1], [gens[b] for b in active])
        C = C + 1
        for b, t in zip(active, next_tokens[:, 0].tolist()):  # the one host sync per step
            tokens[b].append(t)
            lengths[b] += 1
            out[b].steps += 1
            out[b].accepted.append(1)
            on_tokens and on_tokens(b, [t])


def mask_width(model: Transformer, end: int) -> int:
    """How much of the cache a step attends over: up to its last slot, or (compiled, a fixed
    shape) the whole cache."""
    return model.cache_len if model.compiled_step is not None else end


def per_row(on_tokens):
    """A single sequence's on_tokens(ids) as a batch's on_tokens(row, ids)."""
    return on_tokens and (lambda _, ids: on_tokens(ids))


@torch.inference_mode()
def greedy_decode(model, prompt_ids, max_new_tokens, stop_ids=(), on_tokens=None) -> Generation:
    """The baseline: one token per forward. Lookahead must reproduce it token for token."""
    return one_by_one(model, [prompt_ids], max_new_tokens, stop_ids, per_row(on_tokens), GREEDY)[0]


@torch.inference_mode()
def greedy_decode_batch(model, prompts, max_new_tokens, stop_ids=(), on_tokens=None) -> list[Generation]:
    """greedy_decode for several prompts in one forward per step; on_tokens(row, new ids)."""
    return one_by_one(model, prompts, max_new_tokens, stop_ids, on_tokens, GREEDY)


@torch.inference_mode()
def sample_decode(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, seed=0,
                  stop_ids=(), on_tokens=None) -> Generation:
    """Plain sampling, one token per forward: the distribution lookahead sampling must keep."""
    sampling = Sampling(temperature, top_k, top_p)
    return one_by_one(model, [prompt_ids], max_new_tokens, stop_ids, per_row(on_tokens), sampling, seed)[0]


class NGramPool:
    """n-grams seen so far, keyed by their first token, at most `cap` per key, least recently
    seen evicted first. A repeated n-gram moves to the most recent end instead of duplicating.
    Each n-gram also remembers the tokens seen right before it, to rank it (see get), and
    whether the lookahead window produced it (the dynamic shape credits the window for it)."""

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


# The pool keeps at least this many n-grams per key even when fewer are verified per step, so
# that a small G picks from several.
POOL_MIN_PER_KEY = 8


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

    Level 0 is a guessed continuation of `last` (a causal run). The token in level l, column j
    was predicted from level l-1, column j one step ago, so its trajectory is level 0 up to
    column j, then its own column up to level l. Returns (mask, position offsets)."""
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
    level (its predictions become the next level). Padding tokens attend only to themselves and
    their rows are never read. Built on the host; the loop copies all rows' in one transfer."""
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
    """Greedy verification -> (accepted nodes, bonus token).

    pred[i] is the model's own next token after node i. From `last`, follow the child whose
    token the model predicted, as long as there is one: those guesses are exactly what greedy
    decoding would produce, and the prediction after the last of them is a bonus token the
    forward already computed."""
    path, v = [], 0
    while (child := tree.children[v].get(pred[v])) is not None:
        path.append(child)
        v = child
    return path, pred[v]


def verify_sampled(tree: Tree, probs, rng, gen) -> tuple[list[int], int]:
    """Lossless verification under sampling -> (accepted nodes, the next sampled token).

    Speculative sampling with one-hot drafts, node by node down the trie. With p the model's
    distribution after node v, try v's children d1, d2, ... in turn: accept d_i with probability
    p(d_i) / (1 - p(d1) - ... - p(d_i-1)), i.e. p renormalised after zeroing the rejected ones.
    Token d_i then comes out with probability
        (1 - S_i) * p(d_i) / (1 - S_i) = p(d_i),   S_i = p(d1) + ... + p(d_i-1)
    (the product of the rejection probabilities before it telescopes to 1 - S_i), and when all
    are rejected the residual is sampled, so every token x comes out with probability p(x).
    After an acceptance the walk continues from that child, with the model's distribution given
    that prefix: every committed token is distributed as plain sampling's.
    probs: (len(tree), V), row i the distribution after node i."""
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


class StepCosts:
    """Seconds per step of each size of the menu (step_size), measured as the decoder runs them.

    A size's estimate is the median of its last 8 steps (the least of the first 3: a shape's
    first runs can be slow). A size run fewer than twice, or not yet, is assumed to cost what
    the largest measured smaller size costs, times the growth seen between the two largest
    measured sizes for each doubling (optimistic where the growth was flat, so it gets tried),
    and only one size above the largest one measured twice is ever considered: the decoder climbs
    the menu one rung at a time and stops where a wider step no longer pays. On a CPU it stops
    after a rung or two; where steps are free (a GPU at small sizes) it goes wide.
    `table` fixes the estimates instead (a cost model for tests and experiments: sizes not in
    it are never chosen)."""

    def __init__(self, table: dict[int, float] | None = None):
        self.table = table
        self.samples: dict[int, deque] = {}

    @classmethod
    def flat(cls, largest: int = STEP_SIZES[-1]) -> "StepCosts":
        """Every size up to `largest` costs the same: what the policy does where steps are free."""
        return cls({1 << i: 1.0 for i in range(largest.bit_length())})

    def record(self, size: int, seconds: float):
        if self.table is None:
            self.samples.setdefault(size, deque(maxlen=8)).append(seconds)

    def estimate(self, size: int) -> float | None:
        """Expected seconds of a step of this size, None where it is not to be tried yet."""
        if self.table is not None:
            return self.table.get(size)
        seen = self.samples.get(size, ())
        if len(seen) >= 2:  # trusted; the first runs of a shape can be slow (allocation), so min
            return min(seen) if len(seen) < 4 else statistics.median(seen)
        if not self.samples:
            return 1.0 if size <= 2 else None  # the first step: the cheapest sizes
        trusted = [s for s, v in self.samples.items() if len(v) >= 2]
        if size > 2 * max(trusted, default=1):
            return None  # one rung at a time
        below = sorted(s for s in trusted if s < size)
        if below:  # assume the growth last seen from one size to the next goes on
            c1 = self.estimate(below[-1])
            growth = max(1.0, c1 / self.estimate(below[-2])) if len(below) > 1 else 1.0
            guess = c1 * growth ** math.log2(size / below[-1])
        else:
            guess = min(min(v) for v in self.samples.values())
        return min(guess, seen[0]) if seen else guess


# Each process keeps one cost table per model, so a request starts from what earlier ones measured.
STEP_COSTS = weakref.WeakKeyDictionary()


class Acceptance:
    """How often a guess was right when its parent was, in this request, per (source, depth,
    rank among its siblings): the probability a dynamic step gives each guess. Starts from a
    prior worth two observations: a pooled n-gram seen after the same token as now 0.5, another
    pooled one or the Jacobi guess 0.3; each further sibling half its elder's."""

    PRIOR = {"context": 0.5, "pool": 0.3, "jacobi": 0.3}

    def __init__(self):
        self.hits, self.trials = Counter(), Counter()
        self.window_tokens = 0  # tokens committed through n-grams the window made
        self.window_columns = 0  # window columns run, summed over steps

    @staticmethod
    def key(tree: Tree, node: int):
        return tree.kind[node], min(tree.depth[node], 4), min(tree.rank(node), 2)

    def p(self, key) -> float:
        kind, _, rank = key
        prior = self.PRIOR[kind] / 2 ** rank
        return (self.hits[key] + 2 * prior) / (self.trials[key] + 2)

    def record(self, tree: Tree, path: list[int], w: int):
        """After a step: every guess whose parent was accepted was tested; those on the path hit."""
        on_path = set(path)
        for v in [0] + path:
            for child in tree.children[v].values():
                key = self.key(tree, child)
                self.trials[key] += 1
                self.hits[key] += child in on_path
        self.window_tokens += sum(tree.from_window[v] for v in path)
        self.window_columns += w

    def window_yield(self) -> float:
        """Tokens a window column is worth per step: committed through its n-grams, per column
        run (prior: 0.02, worth 50 column-steps)."""
        return (self.window_tokens + 1.0) / (self.window_columns + 50)


@dataclass
class Shape:
    """What a step ran: window columns x levels, guesses in the trie, tokens padded to `size`,
    and (dynamic steps) the tokens it was expected to commit and its estimated cost against the
    cheapest step."""
    window: int
    levels: int
    guesses: int
    size: int
    expected: float = 0.0
    cost: float = 0.0


def step_values(tree: Tree, acceptance: Acceptance, levels: int, max_window: int, budget: int):
    """What a step of each size of the menu (up to budget) is worth to one row: {size: (expected
    tokens, n guesses, w window columns)} for the best step that fits in it, and the guesses in
    order of value (the best n are order[:n]).

    A guess is worth its chance to be accepted: the product of its ancestors' chances to be
    right given their parents (Acceptance). The best-ranked candidate's guesses are worth more:
    when it is rejected near its start, its rows become the next step's Jacobi guess, so each
    also carries the chance that the guess it leaves is accepted then. A child is never worth
    more than its parent, so the best k guesses for a budget of k are the k most valuable, and
    a step of size T with w columns of L levels expects
        1 + (the value of its T-1-w*L best guesses) + w * (what a window column yields)
    tokens. Every window width is tried; what fits in a size fits, padded, in the next."""
    chance = [1.0] * len(tree)
    for i in range(1, len(tree)):  # parents come before children
        chance[i] = chance[tree.parent[i]] * acceptance.p(acceptance.key(tree, i))
    value = chance[:]
    if tree.children[0]:  # the best-ranked candidate also leaves the next step's Jacobi guess
        first = tree.first_chain(next(iter(tree.children[0].values())))
        rejected, reach = 1 - chance[first[0]], 1.0
        for depth, i in enumerate(first, 1):
            reach *= acceptance.p(("jacobi", min(depth, 4), 0))
            value[i] += rejected * reach
    order = sorted(range(1, len(tree)), key=lambda i: (-value[i], tree.depth[i]))
    prefix = [0.0]
    for i in order:
        prefix.append(prefix[-1] + value[i])
    col_value = acceptance.window_yield()
    best, size = {}, 1
    while size <= budget:
        here, w = best.get(size // 2, (1.0, 0, 0)), 0  # `last` alone, or a smaller step padded
        while w <= max_window and 1 + w * levels <= size:
            n = min(len(order), size - 1 - w * levels)
            expected = 1 + prefix[n] + w * col_value
            if expected > here[0]:
                here = (expected, n, w)
            w = 2 * w if w else 1
        best[size] = here
        size *= 2
    return order, best


def choose_shape(rows, costs: StepCosts, budget: int) -> list[tuple[Tree, int, Shape]]:
    """The dynamic policy: the step size T that maximises the expected committed tokens per
    second, i.e. the sum over the batch's rows of what a step of size T is worth to each
    (step_values), over what it costs (costs.estimate(T)); then each row's best guesses and
    window columns within T. rows: (tree, acceptance, window levels, max window) for each.
    Returns each row's (trie of the guesses kept, window columns, Shape)."""
    values = [step_values(tree, acc, levels, max_window, budget) for tree, acc, levels, max_window in rows]
    cheapest = min((c for s in (1, 2) if (c := costs.estimate(s))), default=1.0)
    rate, T, size = 0.0, 1, 1  # `last` alone, should a cost model offer no size at all
    while size <= budget:
        cost = costs.estimate(size)
        if cost is not None and sum(best[size][0] for _, best in values) / cost > rate:
            rate, T = sum(best[size][0] for _, best in values) / cost, size
        size *= 2
    shapes = []
    for (tree, _, levels, _), (order, best) in zip(rows, values):
        expected, n, w = best[T]
        shape = Shape(w, levels if w else 0, n, T, expected, (costs.estimate(T) or cheapest) / cheapest)
        shapes.append((tree.keep(order[:n]), w, shape))
    return shapes


# The dynamic shape's limits: window columns, pooled n-grams per key, tokens per step.
MAX_WINDOW, MAX_CANDIDATES, MAX_STEP = 16, 16, STEP_SIZES[-1]


class Sequence:
    """One prompt's lookahead state (a row of the batch): its committed tokens, n-gram pool,
    window, Jacobi guess and acceptance. The decode loop (lookahead_decode_batch) asks every
    row for its part of a step (propose, shape, inputs), runs one forward for all rows, and
    hands each row its logits (verify, which commits and updates the window)."""

    def __init__(self, prompt_ids, max_new_tokens, N, W, G, dynamic, sampling, seed, stop, dev,
                 prompt_ngrams, output_ngrams, jacobi_guess):
        self.prompt, self.max_new, self.stop = list(prompt_ids), max_new_tokens, stop
        self.N, self.levels, self.W, self.G, self.dynamic = N, N - 1, W, G, dynamic
        self.sampling, self.output_ngrams, self.jacobi_guess = sampling, output_ngrams, jacobi_guess
        self.C = len(prompt_ids)  # committed slots: `last` (tokens[-1]) sits at slot and position C
        self.tokens, self.out = [], Generation([], 0, 0.0)
        self.acceptance = Acceptance()
        # Window: level 0 starts as random prompt tokens (any guess converges; these are cheap
        # and seeded, so runs repeat). It grows a level per step until it has N-1; verification
        # does not wait for it, since the pool already holds the prompt's n-grams.
        self.window_rng, self.rng = random.Random(seed), random.Random(seed + 1)
        self.window = [[self.window_rng.choice(self.prompt) for _ in range(W)]] if W and not dynamic else []
        self.gen = torch.Generator(dev).manual_seed(seed)  # sampling's draws, seeded like the window
        # Pool: seeded with the prompt's own n-grams, which pays off whenever the answer copies
        # (commit adds the n-grams of the committed text as it grows).
        self.pool = NGramPool(max(G, POOL_MIN_PER_KEY) if G else 0)
        if prompt_ngrams:
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
        for i, t in enumerate(new_tokens):
            if t in self.stop:
                new_tokens = new_tokens[:i + 1]
                break
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
                # A fixed shape pads it to K guesses with its last token (a guess costs a slot,
                # never exactness); the dynamic one leaves that to the chances of real guesses.
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

        # 5. Commit and roll back: `last` is already in slot C; the accepted guesses' K/V move
        #    from their slots (node i sits in slot C + i) to C+1... They can be kept as they
        #    are: same tokens, same positions, attending to exactly the committed context, so
        #    they are what a sequential run would have written. Nothing else survives: the rest
        #    of this step's slots lie past the committed length and are overwritten next step.
        src = [C] + [C + v for v in path]
        self.C = C + len(src)
        # The first rejected guess's rows predicted the tokens that follow what is committed
        # now, from a context that is wrong in one token; as in Jacobi decoding, they are a
        # guess for the next step, and often right (the pool is often empty for `last`).
        #     accepted   last  a0         rejected: a1 (the model said b)   commits a0, b
        #     rows       a1 -> p1, a2 -> p2            Jacobi guess next step: [p1, p2]
        end = path[-1] if path else 0
        rejected = next(iter(tree.children[end].values()), None)
        self.jacobi = [pred[v] for v in tree.first_chain(rejected)] if rejected and self.jacobi_guess else []
        self.acceptance.record(tree, path, w)
        trace = on_step and self.trace(tree, w, shape, path)  # before the window moves on

        # 6. Jacobi update: the newest level's predictions become a new level; once the window
        #    is full, each column plus its prediction is an N-gram for the pool, and the oldest
        #    level drops out.
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
        self.out.accepted.append(len(new_tokens))
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
                     seed=0, prompt_ngrams=True, output_ngrams=True, jacobi_guess=True, on_tokens=None,
                     temperature=0.0, top_k=0, top_p=1.0, on_step=None, costs=None) -> Generation:
    """Several tokens per forward. Greedy by default, and then the tokens equal greedy_decode's;
    with temperature/top_k/top_p the tokens are distributed exactly as sample_decode's.

    The shape of a step: W window columns, n-grams of length N (the window has N-1 levels and
    a candidate at most N-1 guesses), at most G candidates verified.
    - window=None and guesses=None (the default): dynamic. Before every step the decoder
      chooses which guesses to verify and how many window columns to run, to maximise the
      expected committed tokens per second (choose_shape), from two online estimates: how
      often each kind of guess was right in this request (Acceptance), and what a step of
      each size costs on this device (StepCosts, kept per model across requests; `costs`
      replaces it). The window keeps its columns while its width stays; narrowed, it loses
      its rightmost columns; widened, new columns start from random prompt tokens, as the
      first one does. N is `ngram` (default 5).
    - window and guesses given: that fixed shape every step (the paper's configurations).
    prompt_ngrams / output_ngrams: also pool the n-grams of the prompt / of the text committed
    so far (text that repeats itself or copies the prompt is then accepted whole).
    jacobi_guess: also verify the model's own predictions left over from the step before
    (Sequence.verify); with a fixed shape only when the pool offers fewer than G candidates.
    on_tokens(new ids) is called as tokens are committed; on_step(dict) after each step with
    what it did (shape, window, candidates, whether the last one is the Jacobi guess, winner,
    guesses accepted, tokens committed), for tracing.
    With measured costs the dynamic shapes depend on timing, and so do sampled tokens for a
    seed (their distribution does not): give a fixed shape or `costs` to repeat a sampled run."""
    return lookahead_decode_batch(model, [prompt_ids], max_new_tokens, window, ngram, guesses, stop_ids, seed,
                                  temperature, top_k, top_p, per_row(on_tokens), costs, prompt_ngrams,
                                  output_ngrams, jacobi_guess, on_step and (lambda _, step: on_step(step)))[0]


@torch.inference_mode()
def lookahead_decode_batch(model, prompts, max_new_tokens, window=None, ngram=None, guesses=None, stop_ids=(),
                           seed=0, temperature=0.0, top_k=0, top_p=1.0, on_tokens=None, costs=None,
                           prompt_ngrams=True, output_ngrams=True, jacobi_guess=True,
                           on_step=None) -> list[Generation]:
    """lookahead_decode for several prompts, one forward per step for all of them: row b is
    exactly its own lookahead_decode (seed + b), with its own window, pool, shape and rollback.

    The step of B rows is their steps side by side, each padded to the batch's size T:

        row 0   [ last | guesses | window | padding ]   slots C0 .. C0+T-1 of cache row 0
        row 1   [ last | guesses | window .......... ]   slots C1 .. C1+T-1 of cache row 1

    Each row's mask is its own committed slots plus its own block, so rows never see each
    other. The dynamic shape chooses T for the batch (costs measured for steps of B rows), and
    each row the guesses and window it runs within T. A finished row leaves the batch and the
    cache. on_tokens(row, new ids),
    on_step(row, dict)."""
    dynamic = window is None and guesses is None
    if not dynamic and (window is None or guesses is None):
        raise ValueError("a fixed shape needs both window and guesses (neither: the dynamic shape)")
    N = 5 if ngram is None else ngram
    W, G = (MAX_WINDOW, MAX_CANDIDATES) if dynamic else (window, guesses)
    if W < 0 or N < 2 or G < 0:
        raise ValueError(f"need window >= 0, ngram >= 2, guesses >= 0 (got {W}, {N}, {G})")
    sampling = Sampling(temperature, top_k, top_p)
    start = time.perf_counter()
    limits = check_requests(model, prompts, max_new_tokens)
    step_max = min(MAX_STEP, step_size(2 + (W + G) * (N - 1))) if dynamic else step_size(1 + (W + G) * (N - 1))
    longest = max(len(p) + m - 1 for p, m in zip(prompts, limits))
    ensure_cache(model, min(model.args.max_seq_len, longest + step_max), len(prompts))
    dev, stop = model.device, set(stop_ids)
    rows = [Sequence(p, m, N, W, G, dynamic, sampling, seed + b, stop, dev, prompt_ngrams, output_ngrams,
                     jacobi_guess) for b, (p, m) in enumerate(zip(prompts, limits))]

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
            model.keep_rows(keep, max(rows[b].C for b in active) + step_max)
            active = [active[j] for j in keep]
        step_start = time.perf_counter()
        batch = [rows[b] for b in active]
        B, budget = len(batch), min(step_max, model.cache_len - max(row.C for row in batch))
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
                                       torch.tensor([row.C]))) for row, (seq, offsets, block, read) in zip(batch, parts)])
        packed = packed.to(dev).view(B, -1)
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
        if any(src != list(range(src[0], src[0] + len(src))) for src in moves):
            n = max(map(len, moves))
            src = [m + m[-1:] * (n - len(m)) for m in moves]  # repeating a move changes nothing
            dst = [list(range(m[0], m[0] + len(m))) + [m[0] + len(m) - 1] * (n - len(m)) for m in moves]
            model.commit(*torch.tensor([src, dst], device=dev))
        step_costs.record(T, time.perf_counter() - step_start)
        for b, row in zip(active, batch):
            on_tokens and on_tokens(b, row.tokens[len(row.tokens) - row.out.accepted[-1]:])
    for row in rows:
        row.out.tokens = row.tokens
    return [row.out for row in rows]


if __name__ == "__main__":  # the command line lives in cli.py; `python lookahead.py --prompt ...` runs it
    from cli import main
    sys.exit(main())

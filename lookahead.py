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


def check_request(model: Transformer, prompt_ids, max_new_tokens: int) -> int:
    """Validate a request; return how many tokens may be generated (the context bounds it)."""
    context = model.args.max_seq_len
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if min(prompt_ids) < 0 or max(prompt_ids) >= model.args.vocab_size:
        raise ValueError(f"prompt ids must lie in [0, {model.args.vocab_size})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if len(prompt_ids) >= context:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {context}")
    # The last generated token never needs a K/V slot, so m tokens need len(prompt) + m - 1.
    return min(max_new_tokens, context - len(prompt_ids))


def ensure_cache(model: Transformer, needed: int):
    """Reuse the model's KV cache when it is big enough; else allocate once, with headroom."""
    if model.cache_len < needed:
        model.setup_cache(min(model.args.max_seq_len, max(needed, 2 * model.cache_len, 256)))


def committed_mask(model: Transformer, rows: int) -> torch.Tensor:
    """A (rows, cache_len) mask buffer for the steps: True over the committed slots [0, C),
    False past them; a step writes its own block after C, and clears it again."""
    mask = torch.zeros(rows, model.cache_len, dtype=torch.bool, device=model.device)
    mask[:, :model.committed] = True
    return mask


def mask_width(model: Transformer, end: int) -> int:
    """How much of the cache a step attends over: up to its last slot, or (compiled, a fixed
    shape) the whole cache."""
    return model.cache_len if model.compiled_step is not None else end


def prefill(model: Transformer, prompt_ids) -> torch.Tensor:
    """Run the prompt through the model, filling cache slots [0, P); return the logits (1, 1, V)
    that predict the first new token. Causal without a mask (model.forward), so a long prompt
    costs memory linear in its length."""
    P = len(prompt_ids)
    idx = torch.arange(P, device=model.device)
    logits = model(torch.tensor([prompt_ids], device=model.device), idx, idx, rows=[P - 1])
    model.committed = P
    return logits


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

    def pick(self, logits: torch.Tensor, generator=None) -> torch.Tensor:
        """(R, V) logits -> (R, 1) tokens: the argmax when greedy, else a draw from probs."""
        if self.greedy:
            return logits.argmax(-1, keepdim=True)
        return torch.multinomial(self.probs(logits), 1, generator=generator)


GREEDY = Sampling(temperature=0)


def one_by_one(model, prompt_ids, max_new_tokens, stop_ids, on_tokens, pick) -> Generation:
    """Prefill, then one token per forward, reusing the cache; pick(logits (1, V)) -> (1, 1)."""
    start = time.perf_counter()
    max_new_tokens = check_request(model, prompt_ids, max_new_tokens)
    ensure_cache(model, len(prompt_ids) + max_new_tokens - 1)
    stop = set(stop_ids)
    slots = torch.arange(model.cache_len, device=model.device)

    next_token = pick(prefill(model, prompt_ids)[:, -1])  # (1, 1): stays on the device as the next input
    tokens = [next_token.item()]
    prefill_seconds = time.perf_counter() - start
    mask = committed_mask(model, 1)
    on_tokens and on_tokens(tokens[-1:])
    steps = 0
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        C = model.committed  # the last token sits at position and slot C
        mask[:, C] = True
        logits = model.step(next_token, slots[C:C + 1], slots[C:C + 1], mask[:, :mask_width(model, C + 1)])
        next_token = pick(logits[:, -1])
        model.committed = C + 1
        tokens.append(next_token.item())  # the one host sync per step
        steps += 1
        on_tokens and on_tokens(tokens[-1:])
    return Generation(tokens, steps, time.perf_counter() - start, [1] * steps, prefill_seconds=prefill_seconds)


@torch.inference_mode()
def greedy_decode(model, prompt_ids, max_new_tokens, stop_ids=(), on_tokens=None) -> Generation:
    """The baseline: one token per forward. Lookahead must reproduce it token for token."""
    return one_by_one(model, prompt_ids, max_new_tokens, stop_ids, on_tokens, GREEDY.pick)


@torch.inference_mode()
def sample_decode(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, seed=0,
                  stop_ids=(), on_tokens=None) -> Generation:
    """Plain sampling, one token per forward: the distribution lookahead sampling must keep."""
    sampling = Sampling(temperature, top_k, top_p)
    if sampling.greedy:
        return greedy_decode(model, prompt_ids, max_new_tokens, stop_ids, on_tokens)
    gen = torch.Generator(model.device).manual_seed(seed)
    return one_by_one(model, prompt_ids, max_new_tokens, stop_ids, on_tokens,
                      lambda logits: sampling.pick(logits, gen))


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

    def get(self, key, before=None) -> list[tuple]:
        """The continuations of `key` (the n-grams without their first token): first those seen
        after `before`, the token before `key` now, then the rest; most recent first in each.
        Two tokens of context pick better than one when there are more n-grams than guesses to
        verify (measured: the summary prompt commits 3.2 tokens per step at 1,4,1 instead of 2.1)."""
        return [rest for rest, _, _ in self.ranked(key, before)]

    def ranked(self, key, before=None) -> list[tuple]:
        """get's order, each as (rest, seen after `before`?, from the window?)."""
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

    def path(self, node) -> list[int]:
        """The tokens from `last` (excluded) down to node."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parent[node]
        return out[::-1]

    def node(self, tokens) -> int:
        v = 0
        for tok in tokens:
            v = self.children[v][tok]
        return v

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


def step_inputs(tree: Tree, window, w: int, size: int, C: int, dev):
    """Tokens (1, size), positions (size,), the (size, size) in-step mask and the logits rows to
    read, of one step laid out as

        [ tree: last, guesses | window: w columns x L levels | padding ]

    Rows read: every tree node (row i predicts the token after node i), then the newest window
    level (its predictions become the next level). Padding tokens attend only to themselves and
    their rows are never read. Built on the host and copied to the device in one transfer."""
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
    packed = torch.cat((torch.tensor(seq), C + offsets, block.flatten(), torch.tensor(read))).to(dev)
    seq, positions, block, read = packed.split((size, size, size * size, len(read)))
    return seq[None], positions, block.view(size, size).bool(), read


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


def choose_shape(tree: Tree, acceptance: Acceptance, costs: StepCosts, levels: int, max_window: int,
                 budget: int) -> tuple[Tree, int, Shape]:
    """The dynamic policy: the step (guesses kept, window columns) that maximises the expected
    committed tokens per second.

    A guess is worth its chance to be accepted: the product of its ancestors' chances to be
    right given their parents (Acceptance). The best-ranked candidate's guesses are worth more:
    when it is rejected near its start, its rows become the next step's Jacobi guess, so each
    also carries the chance that the guess it leaves is accepted then. A child is never worth
    more than its parent, so the best k guesses for a budget of k are the k most valuable, and
    a step of size T expects
        1 + (the value of its T-1-w*L best guesses) + w * (what a window column yields)
    tokens at the cost costs.estimate(T). Every size of the menu and every window width is
    tried; padding is never chosen where a smaller size holds the same step."""
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
    cheapest = min((c for s in (1, 2) if (c := costs.estimate(s))), default=1.0)
    best = (0.0, 0, 0, Shape(0, 0, 0, 1))  # `last` alone, should a cost model offer no size at all
    size = 1
    while size <= budget:
        cost = costs.estimate(size)
        if cost is not None:
            w = 0
            while w <= max_window and 1 + w * levels <= size:
                n = min(len(order), size - 1 - w * levels)
                if n + w * levels + 1 > size // 2 or size == 1:  # a smaller size holds it otherwise
                    expected = 1 + prefix[n] + w * col_value
                    if expected / cost > best[0]:
                        best = (expected / cost, n, w, Shape(w, levels if w else 0, n, size, expected,
                                                             cost / cheapest))
                w = 2 * w if w else 1
        size *= 2
    _, n, w, shape = best
    return tree.keep(order[:n]), w, shape


# The dynamic shape's limits: window columns, pooled n-grams per key, tokens per step.
MAX_WINDOW, MAX_CANDIDATES, MAX_STEP = 16, 16, STEP_SIZES[-1]


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
    (step 5 below); with a fixed shape only when the pool offers fewer than G candidates.
    on_tokens(new ids) is called as tokens are committed; on_step(dict) after each step with
    what it did (shape, window, candidates, whether the last one is the Jacobi guess, winner,
    guesses accepted, tokens committed), for tracing.
    With measured costs the dynamic shapes depend on timing, and so do sampled tokens for a
    seed (their distribution does not): give a fixed shape or `costs` to repeat a sampled run."""
    dynamic = window is None and guesses is None
    if not dynamic and (window is None or guesses is None):
        raise ValueError("a fixed shape needs both window and guesses (neither: the dynamic shape)")
    N = 5 if ngram is None else ngram
    W, G = (MAX_WINDOW, MAX_CANDIDATES) if dynamic else (window, guesses)
    if W < 0 or N < 2 or G < 0:
        raise ValueError(f"need window >= 0, ngram >= 2, guesses >= 0 (got {W}, {N}, {G})")
    sampling = Sampling(temperature, top_k, top_p)
    start = time.perf_counter()
    max_new_tokens = check_request(model, prompt_ids, max_new_tokens)
    levels = N - 1  # a full window has N-1 levels; with the new prediction they make N-grams
    step_max = min(MAX_STEP, step_size(2 + (W + G) * levels)) if dynamic else step_size(1 + (W + G) * levels)
    ensure_cache(model, min(model.args.max_seq_len, len(prompt_ids) + max_new_tokens - 1 + step_max))
    dev, stop = model.device, set(stop_ids)
    slots = torch.arange(model.cache_len, device=dev)
    costs = costs or STEP_COSTS.setdefault(model, StepCosts())
    acceptance = Acceptance()

    # Window: level 0 starts as random prompt tokens (any guess converges; these are cheap and
    # seeded, so runs repeat). It grows a level per step until it has N-1; verification does not
    # wait for it, since the pool already holds the prompt's n-grams.
    window_rng, rng = random.Random(seed), random.Random(seed + 1)
    window = [[window_rng.choice(prompt_ids) for _ in range(W)]] if W and not dynamic else []
    # Pool: seeded with the prompt's own n-grams, which pays off whenever the answer copies
    # (step 7 below adds the n-grams of the committed text as it grows).
    pool = NGramPool(max(G, POOL_MIN_PER_KEY) if G else 0)
    if prompt_ngrams:
        for i in range(len(prompt_ids) - N + 1):
            pool.add(prompt_ids[i:i + N], prompt_ids[i - 1] if i else None)

    gen = torch.Generator(dev).manual_seed(seed)  # sampling's draws, seeded like the window
    tokens = [sampling.pick(prefill(model, prompt_ids)[0], gen).item()]
    prefill_seconds = time.perf_counter() - start
    # The step's mask is [committed cache: all True | step block | rest: False]; one buffer
    # serves every step.
    mask_buf = committed_mask(model, step_max)
    on_tokens and on_tokens(tokens[-1:])
    context = list(prompt_ids)  # and the committed tokens, for output_ngrams

    def pool_output(new_tokens):  # pool the n-grams that end in the new tokens
        context.extend(new_tokens)
        for end in range(max(N, len(context) - len(new_tokens) + 1), len(context) + 1):
            pool.add(context[end - N:end], context[end - N - 1] if end > N else None)

    if output_ngrams:
        pool_output(tokens)
    steps, accepted_lengths, shapes = 0, [], []
    jacobi = []  # the model's predictions left over from the last step (step 5)
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        step_start = time.perf_counter()
        C, last = model.committed, tokens[-1]  # `last` sits at position and slot C
        budget = model.cache_len - C

        # 1. Propose: a trie of candidate continuations of `last`. Pooled n-grams that start with
        #    `last`, those seen after the same token as now first, then the Jacobi guess (step 5).
        #    They need not guess past max_new_tokens.
        K = min(levels, max_new_tokens - len(tokens) - 1)
        before = tokens[-2] if len(tokens) > 1 else prompt_ids[-1]  # the token before `last`
        tree = Tree(last)
        if K > 0:
            pooled = pool.ranked(last, before)[:G]
            for rest, in_context, from_window in pooled:
                tree.add(rest[:K], "context" if in_context else "pool", from_window)
            if jacobi and (dynamic or len(pooled) < G):
                # A fixed shape pads it to K guesses with its last token (a guess costs a slot,
                # never exactness); the dynamic one leaves that to the chances of real guesses.
                tree.add((jacobi if dynamic else jacobi + jacobi[-1:] * (K - len(jacobi)))[:K], "jacobi")

        # 2. Shape the step: which guesses and how many window columns, padded to a size of the
        #    menu. Dynamic: the best expected tokens per second. Fixed: all of them; near the
        #    end of the cache the window sits out and the trie shrinks to what still fits.
        if dynamic:
            tree, w, shape = choose_shape(tree, acceptance, costs, len(window) or 1, W, min(budget, step_max))
            if w and not window:
                window = [[window_rng.choice(prompt_ids) for _ in range(w)]]
            elif w:  # narrowed: drop the rightmost columns; widened: new random columns
                window = [level[:w] + [window_rng.choice(prompt_ids) for _ in range(w - len(level))]
                          for level in window]
        else:
            w = W if step_size(len(tree) + W * len(window)) <= budget else 0
            if step_size(len(tree) + w * len(window)) > budget:
                tree = tree.keep(range(1, 1 << (budget.bit_length() - 1)))
            shape = Shape(w, len(window) if w else 0, len(tree) - 1, 0)
        n, L = len(tree), len(window) if w else 0
        size = shape.size = step_size(n + w * L)

        # 3. One forward over [tree | window | padding] under the combined mask. Logits rows
        #    read: every tree node (row i predicts the token after node i), then the newest
        #    window level (its predictions become the next level).
        seq, positions, block, rows = step_inputs(tree, window, w, size, C, dev)
        mask_buf[:size, C:C + size] = block
        logits = model.step(seq, positions, slots[C:C + size], mask_buf[:size, :mask_width(model, C + size)], rows)
        mask_buf[:size, C:C + size] = False
        pred = logits[0].argmax(-1).tolist()  # the one host sync per greedy step
        new_level = pred[n:]

        # 4. Verify the guesses against the model's own choices (greedy: its argmax; sampling:
        #    a rejection test that keeps plain sampling's distribution).
        if sampling.greedy:
            path, bonus = verify_greedy(tree, pred)
        else:
            path, bonus = verify_sampled(tree, sampling.probs(logits[0, :n]), rng, gen)
        new_tokens = [tree.tokens[v] for v in path] + [bonus]

        # 5. Commit and roll back: `last` is already in slot C; the accepted guesses' K/V move
        #    from their slots (node i sits in slot C + i) to C+1... They can be kept as they
        #    are: same tokens, same positions, attending to exactly the committed context, so
        #    they are what a sequential run would have written. Nothing else survives: the rest
        #    of this step's slots lie past the committed length and are overwritten next step.
        model.commit([C] + [C + v for v in path])
        mask_buf[:, C:model.committed] = True  # the committed slots: context for every row from now on
        # The first rejected guess's rows predicted the tokens that follow what is committed
        # now, from a context that is wrong in one token; as in Jacobi decoding, they are a
        # guess for the next step, and often right (the pool is often empty for `last`).
        #     accepted   last  a0         rejected: a1 (the model said b)   commits a0, b
        #     rows       a1 -> p1, a2 -> p2            Jacobi guess next step: [p1, p2]
        end = path[-1] if path else 0
        rejected = next(iter(tree.children[end].values()), None)
        jacobi = [pred[v] for v in tree.first_chain(rejected)] if rejected and jacobi_guess else []
        acceptance.record(tree, path, w)

        if on_step:  # before the window moves on; `committed` is trimmed at a stop id (step 7)
            accepted = [tree.tokens[v] for v in path]
            winner = next((g for g, (c, *_) in enumerate(tree.chains) if list(c[:len(accepted)]) == accepted), 0)
            step = dict(step=steps, shape=shape, last=last, window=[level[:w] for level in window[:L]],
                        candidates=[list(c) for c, *_ in tree.chains], sources=[k for _, k, _ in tree.chains],
                        jacobi=bool(tree.chains) and tree.chains[-1][1] == "jacobi", winner=winner,
                        accepted=len(path))

        # 6. Jacobi update: the newest level's predictions become a new level; once the window
        #    is full, each column plus its prediction is an N-gram for the pool, and the
        #    oldest level drops out.
        if w:
            if len(window) == levels:
                for j in range(w):
                    # column j's trajectory continues level 0 after its column j-1 (or `last`)
                    pool.add([level[j] for level in window] + [new_level[j]], window[0][j - 1] if j else last,
                             from_window=True)
                window.pop(0)
            window.append(new_level)

        # 7. Stop exactly where greedy would: at a stop id, or at max_new_tokens.
        new_tokens = new_tokens[:max_new_tokens - len(tokens)]
        for i, t in enumerate(new_tokens):
            if t in stop:
                new_tokens = new_tokens[:i + 1]
                break
        tokens += new_tokens
        on_step and on_step({**step, "committed": new_tokens})
        if output_ngrams:
            pool_output(new_tokens)
        steps += 1
        accepted_lengths.append(len(new_tokens))
        shapes.append(shape)
        costs.record(size, time.perf_counter() - step_start)
        on_tokens and on_tokens(new_tokens)
    return Generation(tokens, steps, time.perf_counter() - start, accepted_lengths, shapes, prefill_seconds)


if __name__ == "__main__":  # the command line lives in cli.py; `python lookahead.py --prompt ...` runs it
    from cli import main
    sys.exit(main())

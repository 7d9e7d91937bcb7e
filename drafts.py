"""Draft sources: where a lookahead step's guesses come from, and what a new one implements.

The paper's source is the n-gram pool (lookahead.NGramPool, here as PoolSource); JacobiGuess is
this project's addition; suffix.py has the suffix source and recycling.py token recycling. Every
one of them keeps the contract of DraftSource below.
"""
from collections import OrderedDict
from dataclasses import dataclass

import torch

from decoding import prefill
from lookahead import NGramPool, Tree


@dataclass(slots=True)
class Candidate:
    """A chain of guesses continuing `last` (lookahead.py's candidate), with what the engine
    reads of it: `source`, the label of who proposed it; `from_window`, whether the lookahead
    window made it (the pool's); and the chances its source states, which only the dynamic
    shape (shape.DynamicShape) reads: `prior`, that its first guess is right before any was
    seen, and `prior_next`, that each later guess is once the one before it was right (None:
    `prior`)."""
    tokens: tuple
    source: str
    from_window: bool = False
    prior: float = 0.3
    prior_next: float | None = None


class CandidateTree(Tree):
    """lookahead.Tree built from Candidates, with what the engine reads of it: the candidates
    merged (empty ones left out), origin[node], the index of the first candidate through the
    node (node 0, `last`: None), and first_chain."""

    def __init__(self, last: int, candidates=()):
        self.tokens, self.parent, self.depth, self.children = [last], [-1], [0], [{}]  # lookahead.Tree's
        self.candidates: list[Candidate] = []
        self.origin: list[int | None] = [None]
        for candidate in candidates:
            self.add(candidate)

    def add(self, candidate: Candidate):
        """lookahead.Tree.add, each new node's origin noted as it is made (the engine's hot path:
        a step merges dozens of candidates)."""
        if not candidate.tokens:
            return
        v, tokens, children, origin = 0, self.tokens, self.children, len(self.candidates)
        for tok in candidate.tokens:
            child = children[v].get(tok)
            if child is None:
                child = len(tokens)
                children[v][tok] = child
                tokens.append(tok)
                self.parent.append(v)
                self.depth.append(self.depth[v] + 1)
                self.origin.append(origin)
                children.append({})
            v = child
        self.candidates.append(candidate)

    def first_chain(self, node) -> list[int]:
        """Node, its first child, that one's first child, ...: the best-ranked candidate's rest."""
        out = [node]
        while self.children[out[-1]]:
            out.append(next(iter(self.children[out[-1]].values())))
        return out


class DraftSource:
    """Where guesses come from: the contract every draft source keeps. Whatever a source proposes,
    the output stays exactly greedy's (or plain sampling's distribution): verification accepts
    only what the model itself says. A source is made per row (a prompt of the batch): by
    engine.generate(..., drafts=f), f(seq) -> the row's sources (default [seq.pool,
    SuffixSource(), JacobiGuess()]); from the command line, `--drafts
    pool,FILE.py:ClassName,jacobi` makes ClassName() per row, and `FILE.py:ClassName(depth=4,
    name="x")` passes it those keyword arguments (Python literals).

    When each hook runs, for a row whose state is `seq`:
      - observe_prefill(seq, rankings), once after the prompt's forward, only where `rankings` > 0
        and wants_prompt_rankings: the model's best tokens after every prompt token (it costs the
        LM head over the whole prompt, so it is its own choice, off by default);
      - before a step, propose(seq, k) -> candidate continuations of seq.tokens[-1] (`last`),
        best first, each a Candidate of at most k guesses (k: what is left before max_new_tokens;
        longer chains are cut). Any number, any length, empty or repeated: the trie merges shared
        prefixes. A tree of guesses goes as its leaf chains, the best-ranked first. The dynamic
        shape skips a source's propose on steps where it does not pay for its time (below);
      - after every step, observe(seq, step) with the row's RowStep record (engine.py), seq already holding
        what it committed (step.committed). The prefill's first token comes the same way, as a
        step with no guesses: every committed token reaches observe exactly once, proposed or not.

    Where a source learns: in observe, never in propose. The dynamic shape may skip a source's
    propose on any step, so a source that learned there would miss those steps' tokens; observe
    runs after every step, whether the source proposed or not (SuffixSource in suffix.py learns so).

    A source that learns from the model's output may keep it across requests: remember(memory)
    runs first where the caller passed a Memory (below), and the source then keeps what it
    learns in memory.table(self.name), a bounded dict of its own, shared only by the callers who
    pass the same Memory (no copy is made per request), instead of in its own attributes.

    What `seq` offers (read only): prompt and tokens (ids; tokens[-1] is `last`), max_new, N,
    pool (the row's NGramPool), and expected_guesses: the most guesses the policy expects the
    coming steps to hold, so that a source whose guesses cost it to make need not make more.

    How the shapes use proposals (the pool's come first, then the other sources' in their order):
    the fixed shape (the paper's W, N, G) runs the pool's first G candidates (the paper's) and every
    other source's first one, each cut or padded to N-1 guesses: no source is left out, and each
    costs N-1 tokens a step. The dynamic shape runs the guesses worth their cost: it learns each
    Candidate.source label's chance per depth and rank (among that label's guesses under the same
    parent), from the priors the candidates state (prior, prior_next), crediting every source that
    proposed an accepted guess, so the order of the sources changes nothing it learns (the Jacobi
    guess's bonus alone follows the first candidate, the pool's best where it has one). It also
    times each source's propose and observe (bench.py reports them) and stops asking a source whose
    seconds would buy more tokens as plain steps than the accepted guesses only it proposed
    (shape.SourceLedger, judged every 4 steps it runs; asked again after 8, 16, ... steps). A source
    under 2% of the steps' time is always asked.

    rankings: how many of the model's best next tokens the source reads after every position a
    step reads (RowStep.rankings, None unless some source of the row asks) while
    wants_rankings(seq.expected_guesses) says they are worth reading; 0: none (the default).
    Not to be confused with sampling's top_k: these are read, never sampled from."""

    rankings = 0
    wants_prompt_rankings = False

    @property
    def name(self) -> str:
        """How bench.py and Generation.source_seconds name it."""
        return type(self).__name__

    def propose(self, seq, k: int) -> list[Candidate]:
        return []

    def observe(self, seq, step):
        pass

    def wants_rankings(self, expected_guesses: int) -> bool:
        return True

    def observe_prefill(self, seq, rankings: list[list[int]]):
        """The model's `rankings` best tokens after every prompt token."""

    def remember(self, memory: "Memory"):
        """Where the request passed a Memory: keep what this source learns there (shared with
        the batch's other rows and later requests), once, before any other hook."""


class PoolSource(NGramPool, DraftSource):
    """The paper's n-gram pool as a draft source: the n-grams that start with `last`, those seen
    after the token before it first. Their labels tell the dynamic shape the two apart: "pool2"
    (two tokens of context matched: likelier), "pool1" (only `last`). Beside lookahead.NGramPool,
    each n-gram remembers whether the window made it (Candidate.from_window: the dynamic shape
    weighs the window by it), and a Memory's table may be shared (remember)."""

    def remember(self, memory):
        self.by_key = memory.ngrams  # shared: what other rows and requests pooled

    def add(self, ngram, before=None, from_window=False):
        if self.cap == 0:
            return
        key, rest = ngram[0], tuple(ngram[1:])
        entries = self.by_key.get(key)
        if entries is None:
            entries = {}
        self.by_key[key] = entries  # written again: a Memory's table keeps the recently written
        entry = entries.pop(rest, None)  # seen again: it moves to the end, the most recent
        if entry is None:
            entry = [(), from_window]
            if len(entries) >= self.cap:  # >=: a shared table may hold what a larger cap pooled
                del entries[next(iter(entries))]
        entries[rest] = entry
        if before is not None and before not in entry[0]:
            entry[0] += (before,)

    def ranked(self, key, before=None) -> list[tuple]:
        """lookahead.NGramPool.ranked's order, as (rest, seen after `before`?, from the window?)."""
        entries = [(rest, before in seen, win) for rest, (seen, win) in reversed(self.by_key.get(key, {}).items())]
        return [e for e in entries if e[1]] + [e for e in entries if not e[1]]

    def propose(self, seq, k):
        return [Candidate(rest[:k], "pool2", win, prior=0.5) if after else Candidate(rest[:k], "pool1", win, prior=0.3)
                for rest, after, win in self.ranked(seq.tokens[-1], token_back(seq, 2))]


class JacobiGuess(DraftSource):
    """This project's addition beside the paper's pooled n-grams: the model's own predictions
    left over from the step before. The tokens after the first rejected guess were predicted
    from a context wrong in one token: as in Jacobi decoding, a guess for the next step, and
    often right.

        accepted   last  a0         rejected: a1 (the model said b)   commits a0, b
        predicted  a1 -> p1, a2 -> p2            Jacobi guess next step: [p1, p2]
    """

    def __init__(self):
        self.guess = []

    def propose(self, seq, k):
        return [Candidate(tuple(self.guess[:k]), "jacobi")] if self.guess else []

    def observe(self, seq, step):
        tree = step.tree
        rejected = next(iter(tree.children[step.path[-1] if step.path else 0].values()), None)
        self.guess = [step.pred[v] for v in tree.first_chain(rejected)] if rejected else []


class Memory:
    """What draft sources learn from the model's own output, kept across the requests (and the
    rows of a batch) that pass the same Memory: the n-gram pool's n-grams and token recycling's
    rankings. Opt-in (engine.generate(..., memory=Memory())); without one, every row starts
    empty and forgets when it ends. Output is exactly greedy's either way: memory changes what is
    guessed, never what is accepted. What it does leak is timing: a request runs faster when text
    like it was decoded before with the same Memory, so callers who must not learn about each
    other's text must not share one.

    Bounded: at most `keys` first tokens (pool), `keys` contexts (recycling) and `keys` keys in
    each other source's table (table(name)), the least recently written dropped first; each
    key holds at most the pool's cap of n-grams (a source bounds what its own keys hold)."""

    def __init__(self, keys: int = 1 << 16):
        self.keys = keys
        self.ngrams = Recent(keys)  # the pool's: first token -> {rest: [tokens before it, from window?]}
        self.rankings = Recent(keys)  # recycling's: token, or (token, token after it) -> the model's best after it
        self.tables: dict[str, Recent] = {}  # any other source's, by its name (table)

    def table(self, name: str) -> "Recent":
        """The part of this memory that the source named `name` keeps (DraftSource.name): a dict
        of at most `keys` keys, the least recently written dropped first, made on first use and
        shared by every caller that passes this Memory. No copy is made: a request that writes it
        changes what the next one reads."""
        table = self.tables.get(name)
        if table is None:
            table = self.tables[name] = Recent(self.keys)
        return table


class Recent(OrderedDict):
    """A dict of at most `limit` keys that forgets the least recently written first."""

    def __init__(self, limit: int | None = None):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        if self.limit is not None and len(self) > self.limit:
            self.popitem(last=False)


def token_back(seq, n: int) -> int:
    """The n-th token from the end of prompt + tokens (n >= 1), without joining the two."""
    return seq.tokens[-n] if n <= len(seq.tokens) else seq.prompt[len(seq.tokens) - n]


# The model's rankings, for the sources that read them: in the step's one host sync, and once
# over the prompt (the LM head over every prompt token: docs/PERFORMANCE.md says what it costs).

def readers(row) -> list[DraftSource]:
    """The row's sources that read the model's rankings now (of those asked to propose)."""
    return [s for s in row.proposers if s.rankings and s.wants_rankings(row.expected_guesses)]


def rankings_wanted(rows) -> int:
    """How many of the model's best tokens the rows' draft sources read now (0: none)."""
    return max((s.rankings for row in rows for s in readers(row)), default=0)


def predictions(logits, rows):
    """Each row's argmax after every position read, and (where a source reads them) the model's
    best tokens there: (pred, rankings), host lists, in one host sync."""
    k = rankings_wanted(rows)
    if not k:
        return logits.argmax(-1).tolist(), [None] * len(rows)
    best = torch.cat((logits.argmax(-1, keepdim=True), logits.topk(k, dim=-1).indices), dim=-1).tolist()
    return [[r[0] for r in rs] for rs in best], [[r[1:] for r in rs] for rs in best]


def prefill_with_rankings(model, rows) -> torch.Tensor:
    """decoding.prefill of every row's prompt -> the logits (B, V) of each first new token; the
    sources that ask for the prompt's rankings (wants_prompt_rankings, and reading them now) see
    the model's best after every prompt token."""
    wanting = [[s for s in readers(row) if s.wants_prompt_rankings] for row in rows]
    k = max((s.rankings for sources in wanting for s in sources), default=0)
    if not k:
        return prefill(model, [row.prompt for row in rows])
    logits, tops = prefill(model, [row.prompt for row in rows], k)
    for row, sources, top in zip(rows, wanting, tops):
        for source in sources:
            source.observe_prefill(row, top)
    return logits

"""Draft sources: where a lookahead step's guesses come from, and what a new one implements.

The paper's source is the n-gram pool (lookahead.NGramPool, here as PoolSource); JacobiGuess is
this project's addition; suffix.py has the suffix source and recycling.py token recycling. Every
one of them keeps the contract of DraftSource below.
"""
import gzip
import inspect
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from decoding import prefill
from lookahead import NGramPool, Tree
from sampling import argmax


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
    node (node 0, `last`: None), and first_chain. A trie cut from a larger one (shape.keep)
    also keeps, in `ranks`, the rank each (node, label) had there."""

    def __init__(self, last: int, candidates=()):
        self.tokens, self.parent, self.depth, self.children = [last], [-1], [0], [{}]  # lookahead.Tree's
        self.candidates: list[Candidate] = []
        self.origin: list[int | None] = [None]
        self.ranks: dict | None = None  # (node, label) -> rank in the trie this was cut from
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

    A source that learns from the model's output may keep it across requests (and, saved to a
    file, across runs: Memory.save): remember(memory) runs first where the caller passed a
    Memory (below), and the source then keeps what it learns in memory.table(self), a bounded
    dict of its own, shared only by the callers who pass the same Memory (no copy is made per
    request), instead of in its own attributes. Three rules keep that table sound:
      - its name is the source's memory_name: its module, class and arguments (defaults filled
        in), so Src(order=2) and Src(order=3), or two classes of one name in two files, never
        share a table; override memory_name where other arguments should share one;
      - the table forgets the least recently used key first, where reading a key (get, [])
        uses it: a value changed in place after a read stays fresh, and nothing needs writing
        again (Recent);
      - what it holds can be saved: ints, floats, strings, bools, None, and lists, tuples and
        dicts of them (Memory.save names the first value that is not).

    Labels: each Candidate.source label is one source's (several labels a source is fine, e.g.
    suffix1 ... suffix6): the dynamic shape learns each label's chances and credits a source by
    its labels, so a label two sources use is an error (a ValueError naming both). Priors: the
    dynamic shape starts each (label, depth, rank) from the prior the candidate states
    (Candidate.prior for its first guess, prior_next for the later ones), worth two guesses
    tested, halved for each elder sibling of the same label, and moves it by what it sees
    (shape.Acceptance.p): after ten tested guesses the prior weighs a sixth. Set a prior to how
    often such a guess was right where you measured it (bench.py's per-source table).

    Arguments: a source checks its own in __init__ and raises ValueError there; `--drafts` makes
    one of each source before the model loads, so a bad value ends with one line at once.

    What `seq` offers (read only): prompt and tokens (ids; tokens[-1] is `last`), max_new, N,
    pool (the row's NGramPool), and expected_guesses: the most guesses the policy expects the
    coming steps to hold, so that a source whose guesses cost it to make need not make more.
    The text so far is seq.prompt + seq.tokens; token_back(seq, n) reads its n-th token from
    the end across that boundary without joining the two lists (a copy of the whole text a
    step is what a hot source must not make).

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

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self.made_with = args, kwargs  # what memory_name names its table by
        return self

    @property
    def name(self) -> str:
        """How bench.py and Generation.source_seconds name it."""
        return type(self).__name__

    @property
    def memory_name(self) -> str:
        """The name of its table in a Memory: 'module.Class(arg=value, ...)', every argument
        __init__ takes (its defaults filled in; a value other than a literal by its type)."""
        cls, (args, kwargs) = type(self), getattr(self, "made_with", ((), {}))
        try:
            bound = inspect.signature(cls).bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments.items()
        except (TypeError, ValueError):
            arguments = [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
        literal = (int, float, str, bool, type(None), tuple)
        shown = ", ".join(f"{k}={v!r}" if isinstance(v, literal) else f"{k}={type(v).__name__}" for k, v in arguments)
        return f"{cls.__module__}.{cls.__qualname__}({shown})"

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
        entries = self.by_key.get(key)  # read: a Memory's table keeps it (Recent)
        if entries is None:
            entries = self.by_key[key] = {}
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
    rows of a batch) that pass the same Memory: the n-gram pool's n-grams, token recycling's
    rankings and every other source's table (table). Opt-in (engine.generate(..., memory=
    Memory())); without one, every row starts empty and forgets when it ends. save and load
    keep it across runs (the CLI's and bench's --memory FILE). Output is exactly greedy's either
    way: memory changes what is guessed, never what is accepted. It does change how long a
    request takes (text like one decoded before with the same Memory is guessed better), so
    callers who must not learn anything about each other's text from their latency must not
    share one.

    Bounded: at most `keys` first tokens (pool), `keys` contexts (recycling) and `keys` keys in
    each other source's table, the least recently used dropped first (Recent); each key holds
    at most the pool's cap of n-grams (a source bounds what its own keys hold: the suffix
    source's one key, its automaton, at most `keys` states)."""

    FORMAT, VERSION = "lookahead-memory", 2

    def __init__(self, keys: int = 1 << 16):
        self.keys = keys
        self.ngrams = Recent(keys)  # the pool's: first token -> {rest: [tokens before it, from window?]}
        self.rankings = Recent(keys)  # recycling's: token, or (token, token after it) -> the model's best after it
        self.tables: dict[str, Recent] = {}  # any other source's, by its memory_name (table)

    def table(self, source: "DraftSource") -> "Recent":
        """The part of this memory that `source` keeps (by its memory_name): a dict of at most
        `keys` keys, the least recently used dropped first, made on first use and shared by
        every source of that name that is passed this Memory. No copy is made: a request that
        writes it changes what the next one reads."""
        table = self.tables.get(source.memory_name)
        if table is None:
            table = self.tables[source.memory_name] = Recent(self.keys)
        return table

    def save(self, path, tokenizer: str):
        """Write it to `path` for the tokenizer named `tokenizer` (Tokenizer.identity): gzipped
        JSON with its format, version and tokenizer (never pickle: a memory file may come from
        someone else, and loading one must not run code). Written to a file beside it and then
        renamed over it, so a crash or Ctrl-C leaves the old file or the new one, never part."""
        data = dict(format=self.FORMAT, version=self.VERSION, tokenizer=tokenizer, keys=self.keys,
                    ngrams=encode(self.ngrams), rankings=encode(self.rankings),
                    tables={name: encode(table) for name, table in self.tables.items()})
        path = Path(path)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            with open(partial, "wb") as raw:
                with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
                    f.write(json.dumps(data, separators=(",", ":")).encode())
                raw.flush()
                os.fsync(raw.fileno())
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)

    @classmethod
    def load(cls, path, tokenizer: str) -> "Memory":
        """The Memory saved in `path`; a ValueError in one line where the file is not one
        (damaged, truncated, another format or version) or was saved for another tokenizer (its
        token ids would mean other text). The file is only read."""
        try:
            with gzip.open(path, "rb") as f:
                data = json.loads(f.read())
            if not isinstance(data, dict) or data.get("format") != cls.FORMAT:
                raise ValueError("no lookahead memory in it")
            if data.get("version") != cls.VERSION:
                raise ValueError(f"version {data.get('version')}, this code reads {cls.VERSION}")
            memory = cls(int(data["keys"]))
            for table, saved in [(memory.ngrams, data["ngrams"]), (memory.rankings, data["rankings"])] + [
                    (memory.tables.setdefault(name, Recent(memory.keys)), t) for name, t in data["tables"].items()]:
                table.update(decode(saved))
        except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError, gzip.BadGzipFile) as e:
            raise ValueError(f"--memory {path}: not a readable lookahead memory ({type(e).__name__}: "
                             f"{str(e)[:120]}); the file was left as it is") from None
        if data["tokenizer"] != tokenizer:
            raise ValueError(f"--memory {path}: saved for another tokenizer ({data['tokenizer']}, this model's is "
                             f"{tokenizer}), whose token ids mean other text; the file was left as it is")
        return memory


class Recent(OrderedDict):
    """A dict of at most `limit` keys that forgets the least recently used first: reading a key
    (get, []) or writing it moves it to the end, so a value changed in place after it was read
    counts as used."""

    def __init__(self, limit: int | None = None):
        super().__init__()
        self.limit = limit

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.move_to_end(key)
        return value

    def get(self, key, default=None):
        return self[key] if key in self else default

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        if self.limit is not None and len(self) > self.limit:
            self.popitem(last=False)


# A memory file's JSON: dicts as [key, value] pairs (their keys are ints and tuples, and their
# order is their recency), tuples tagged apart from lists.

def encode(x):
    if isinstance(x, dict):
        return {"d": [[encode(k), encode(v)] for k, v in x.items()]}
    if isinstance(x, tuple):
        return {"t": [encode(v) for v in x]}
    if isinstance(x, list):
        return [encode(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"a memory table holds a {type(x).__name__} ({x!r:.60}); a saved memory keeps ints, floats, "
                    "strings, bools, None, and lists, tuples and dicts of them (drafts.DraftSource)")


def decode(x):
    if isinstance(x, list):
        return [decode(v) for v in x]
    if isinstance(x, dict):
        (tag, items), = x.items()
        if tag == "t":
            return tuple(decode(v) for v in items)
        if tag == "d":
            return {decode(k): decode(v) for k, v in items}
        raise ValueError(f"unknown tag {tag!r}")
    return x


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
        return argmax(logits).tolist(), [None] * len(rows)
    best = torch.cat((argmax(logits, keepdim=True), logits.topk(k, dim=-1).indices), dim=-1).tolist()
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

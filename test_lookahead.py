"""lookahead.py: exactly greedy (Hypothesis, float64), the mask, the pool, the rollback, the
real checkpoint against transformers' greedy output, and clear errors."""
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import assert_matches_reference, random_model
from lookahead import NGramPool, greedy_decode, lookahead_decode, main, step_layout


def test_lookahead_equals_greedy():
    """For random tiny models, prompts and (W, N, G): the same tokens as greedy decoding.

    Equality alone would pass a verifier that never accepts, so the run must also show
    multi-token steps (tiny vocabularies and repetitive prompts make n-grams recur)."""
    seen = Counter()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**16), vocab=st.integers(8, 32), W=st.integers(1, 8), N=st.integers(2, 6),
           G=st.integers(0, 8), max_new=st.integers(1, 60), context=st.sampled_from([40, 64, 256]),
           data=st.data())
    def prop(seed, vocab, W, N, G, max_new, context, data):
        model = random_model(seed, vocab_size=vocab, n_layers=1 + seed % 2, max_seq_len=context)
        motif = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
        prompt = (motif * 20)[:data.draw(st.integers(1, 30))]
        stop = data.draw(st.sampled_from([(), (0,), (vocab - 1, 3)]))
        expected = greedy_decode(model, prompt, max_new, stop).tokens
        got = lookahead_decode(model, prompt, max_new, W, N, G, stop, seed=seed)
        assert got.tokens == expected
        assert sum(got.accepted) + 1 == len(got.tokens)
        assert max(got.accepted, default=1) <= N
        seen["runs"] += 1
        seen["multi"] += max(got.accepted, default=1) > 1
        seen["full"] += max(got.accepted, default=1) == N
        seen["near_context"] += len(prompt) + max_new + (W + G) * (N - 1) > context

    prop()
    assert seen["multi"] > seen["runs"] // 4, seen
    assert seen["full"] > 0 and seen["near_context"] > 0, seen


def trajectory_mask(W, L, G, K):
    """Brute force from the definition: the step's tokens form a tree rooted at `last`; each
    token's context is its chain of ancestors, and its position is its depth."""
    parent = {0: None}
    index = {}
    for level in range(L):
        for j in range(W):
            index[("w", level, j)] = 1 + level * W + j
    for g in range(G):
        for t in range(K):
            index[("c", g, t)] = 1 + W * L + g * K + t
    for (kind, a, b), i in index.items():
        if kind == "w":  # level 0 continues its left neighbour; level l continues its own column
            parent[i] = (index[("w", 0, b - 1)] if b else 0) if a == 0 else index[("w", a - 1, b)]
        else:
            parent[i] = index[("c", a, b - 1)] if b else 0
    T = 1 + W * L + G * K
    mask = torch.zeros(T, T, dtype=torch.bool)
    depth = torch.zeros(T, dtype=torch.long)
    for i in range(T):
        j = i
        while j is not None:
            mask[i, j] = True
            depth[i] += j != i
            j = parent[j]
    return mask, depth


@pytest.mark.parametrize("W,L,G,K", [(3, 2, 2, 2), (1, 1, 0, 1), (7, 4, 7, 4), (5, 3, 1, 2), (0, 0, 3, 4), (4, 1, 3, 1)])
def test_step_layout_is_the_trajectory_tree(W, L, G, K):
    mask, offsets, rows = step_layout(W, L, G, K)
    want_mask, want_depth = trajectory_mask(W, L, G, K)
    assert torch.equal(mask, want_mask)
    assert torch.equal(offsets, want_depth)
    newest = list(range(1 + (L - 1) * W, 1 + L * W)) if L else []
    assert rows.tolist() == [0] + newest + list(range(1 + W * L, 1 + W * L + G * K))


def test_pool_cap_lru_and_refresh():
    pool = NGramPool(cap=2)
    pool.add([1, 2, 3])
    pool.add([1, 4, 5])
    pool.add([9, 9, 9])
    assert pool.get(1) == [(4, 5), (2, 3)]  # most recent first
    pool.add([1, 2, 3])  # refreshed, not duplicated
    assert pool.get(1) == [(2, 3), (4, 5)]
    pool.add([1, 6, 7])  # over the cap: the least recently seen, (4, 5), goes
    assert pool.get(1) == [(6, 7), (2, 3)]
    assert pool.get(9) == [(9, 9)] and pool.get(5) == []
    empty = NGramPool(cap=0)
    empty.add([1, 2])
    assert empty.get(1) == []


def test_rollback_leaves_the_cache_of_a_greedy_run():
    model = random_model(seed=7, vocab_size=8)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    got = lookahead_decode(model, prompt, 40, window=4, ngram=4, guesses=4)
    assert max(got.accepted) > 1  # the rollback kept candidate K/V, not only window-free steps
    committed = model.committed
    assert committed == len(prompt) + len(got.tokens) - 1
    ours = [(l.self_attn.cache.k[:, :, :committed].clone(), l.self_attn.cache.v[:, :, :committed].clone())
            for l in model.layers]
    assert greedy_decode(model, prompt, 40).tokens == got.tokens
    assert model.committed == committed
    for (k, v), layer in zip(ours, model.layers):
        torch.testing.assert_close(k, layer.self_attn.cache.k[:, :, :committed], rtol=0, atol=1e-12)
        torch.testing.assert_close(v, layer.self_attn.cache.v[:, :, :committed], rtol=0, atol=1e-12)


def test_stop_inside_an_accepted_ngram():
    # Find a step that accepts several tokens, and make one in its middle (not seen before) the
    # stop id: generation must end right there, as greedy's does.
    for seed in range(20):
        model = random_model(seed=seed, vocab_size=16, n_layers=1)
        prompt = [1, 2, 3, 4] + greedy_decode(model, [1, 2, 3, 4], 20).tokens
        free = lookahead_decode(model, prompt, 30, window=3, ngram=5, guesses=3)
        end = 1
        for n in free.accepted:
            inside = [i for i in range(end, end + n - 1) if free.tokens[i] not in free.tokens[:i]]
            if n >= 3 and inside:
                stop = free.tokens[inside[0]]
                got = lookahead_decode(model, prompt, 30, window=3, ngram=5, guesses=3, stop_ids=(stop,))
                assert got.tokens == greedy_decode(model, prompt, 30, stop_ids=(stop,)).tokens
                assert got.tokens == free.tokens[:inside[0] + 1]
                assert got.accepted[-1] < n  # the accepted n-gram was cut at the stop
                return
            end += n
    pytest.fail("no multi-token step found to place a stop id in")


def test_reproducible_with_a_seed():
    model = random_model(seed=3, vocab_size=12)
    a = lookahead_decode(model, [1, 2, 3, 4], 30, seed=5)
    b = lookahead_decode(model, [1, 2, 3, 4], 30, seed=5)
    assert a.tokens == b.tokens and a.accepted == b.accepted


@pytest.mark.parametrize("kwargs,message", [
    (dict(window=0), "window"), (dict(ngram=1), "ngram"), (dict(guesses=-1), "guesses"),
    (dict(prompt=[]), "empty"), (dict(prompt=[1] * 256), "context"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(prompt=[99]), "prompt ids"),
])
def test_bad_requests(kwargs, message):
    model = random_model()
    args = dict(prompt=[1, 2], max_new_tokens=5, window=3, ngram=3, guesses=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        lookahead_decode(model, args.pop("prompt"), args.pop("max_new_tokens"), **args)


def test_generation_stops_at_the_context():
    model = random_model(max_seq_len=40)
    prompt = list(range(30))
    assert len(greedy_decode(model, prompt, 100).tokens) == 10
    assert lookahead_decode(model, prompt, 100).tokens == greedy_decode(model, prompt, 100).tokens


@pytest.mark.parametrize("W,N,G", [(7, 5, 7), (15, 5, 15)])
def test_smollm2_lookahead_matches_transformers(smollm2, reference, W, N, G):
    for case in reference:
        gen = lookahead_decode(smollm2, case["prompt_ids"], len(case["greedy_ids"]), W, N, G, stop_ids=(2,))
        assert_matches_reference(gen.tokens, case)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1

"""lookahead.py: exactly greedy (Hypothesis, float64), the mask, the pool, the rollback, the
real checkpoint against transformers' greedy output, and clear errors."""
import json
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import assert_matches_reference, random_model, write_tokenizer
from model import Transformer
from tokenizer import Tokenizer
from lookahead import NGramPool, Sampling, greedy_decode, lookahead_decode, main, sample_decode, step_layout


def test_lookahead_equals_greedy():
    """For random tiny models, prompts and (W, N, G): the same tokens as greedy decoding.

    Equality alone would pass a verifier that never accepts, so the run must also show
    multi-token steps (tiny vocabularies and repetitive prompts make n-grams recur), and accepted
    Jacobi guesses."""
    seen = Counter()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**16), vocab=st.integers(8, 32), W=st.integers(0, 8), N=st.integers(2, 6),
           G=st.integers(0, 8), max_new=st.integers(1, 60), context=st.sampled_from([40, 64, 256]),
           jacobi_guess=st.booleans(), data=st.data())
    def prop(seed, vocab, W, N, G, max_new, context, jacobi_guess, data):
        model = random_model(seed, vocab_size=vocab, n_layers=1 + seed % 2, max_seq_len=context)
        motif = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
        prompt = (motif * 20)[:data.draw(st.integers(1, 30))]
        stop = data.draw(st.sampled_from([(), (0,), (vocab - 1, 3)]))
        expected = greedy_decode(model, prompt, max_new, stop).tokens
        steps = []
        got = lookahead_decode(model, prompt, max_new, W, N, G, stop, seed=seed, jacobi_guess=jacobi_guess,
                               on_step=steps.append)
        assert got.tokens == expected
        assert sum(got.accepted) + 1 == len(got.tokens)
        assert max(got.accepted, default=1) <= N
        seen["runs"] += 1
        seen["multi"] += max(got.accepted, default=1) > 1
        seen["full"] += max(got.accepted, default=1) == N
        seen["near_context"] += len(prompt) + max_new + (W + G) * (N - 1) > context
        jacobi_wins = [s for s in steps if s["jacobi"] and s["winner"] == len(s["candidates"]) - 1 and s["accepted"]]
        assert jacobi_guess or not any(s["jacobi"] for s in steps)
        seen["jacobi_accepted"] += bool(jacobi_wins)

    prop()
    assert seen["multi"] > seen["runs"] // 4, seen
    assert seen["full"] > 0 and seen["near_context"] > 0 and seen["jacobi_accepted"] > 0, seen


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


def test_pool_ranks_ngrams_seen_after_the_same_token_first():
    pool = NGramPool(cap=4)
    pool.add([1, 2, 3], before=7)
    pool.add([1, 4, 5], before=8)
    pool.add([1, 6, 7])  # before unknown (a window column 0, the prompt's start)
    assert pool.get(1) == [(6, 7), (4, 5), (2, 3)]  # no context: most recent first
    assert pool.get(1, before=7) == [(2, 3), (6, 7), (4, 5)]
    assert pool.get(1, before=8) == [(4, 5), (6, 7), (2, 3)]
    pool.add([1, 2, 3], before=8)  # seen after 8 as well now, and most recent
    assert pool.get(1, before=8) == [(2, 3), (4, 5), (6, 7)]
    assert pool.get(1, before=7) == [(2, 3), (6, 7), (4, 5)]


def test_the_one_guess_is_the_ngram_seen_after_the_same_token():
    # Only prompt n-grams in the pool (N-1 steps pass before the window adds any; output n-grams off):
    # each step must verify the latest prompt n-gram that starts with `last` and follows the
    # token that precedes `last` now, else the latest one that starts with `last`.
    model = random_model(seed=11, vocab_size=8)
    N, picked_by_context = 6, 0
    for seed in range(4):
        prompt = [int(t) for t in torch.randint(0, 8, (40,), generator=torch.Generator().manual_seed(seed))]
        steps = []
        got = lookahead_decode(model, prompt, N, window=1, ngram=N, guesses=1, output_ngrams=False,
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
            assert s["candidates"] == ([ranked[0][:K]] if ranked and K else []), s
            picked_by_context += bool(ranked) and ranked[0] != by_recency[0]
            at += len(s["committed"])
    assert picked_by_context  # the context changed the pick somewhere, so this tested it


def test_rollback_leaves_the_cache_of_a_greedy_run():
    model = random_model(seed=7, vocab_size=8)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    got = lookahead_decode(model, prompt, 40, window=4, ngram=4, guesses=4)
    assert max(got.accepted) > 1  # the rollback kept candidate K/V, not only window-free steps
    committed = model.committed
    assert committed == len(prompt) + len(got.tokens) - 1
    ours = model.kv_cache[..., :committed, :].clone()  # every layer's K and V
    assert greedy_decode(model, prompt, 40).tokens == got.tokens
    assert model.committed == committed
    torch.testing.assert_close(ours, model.kv_cache[..., :committed, :], rtol=0, atol=1e-12)


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
    (dict(window=-1), "window"), (dict(ngram=1), "ngram"), (dict(guesses=-1), "guesses"),
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
    # No window, one candidate: a step verifies a pooled n-gram when the text so far has one
    # that starts with `last`, else the last step's leftover predictions, which are recomputed
    # here with plain forwards: those after the winner's first rejected guess.
    model = random_model(seed=5, vocab_size=32)  # 32 tokens: the pool is often empty for `last`
    N, max_new = 4, 40
    jacobi_steps = jacobi_accepted = 0
    for seed in range(6):
        prompt = [int(t) for t in torch.randint(0, 32, (12,), generator=torch.Generator().manual_seed(seed))]
        steps = []
        got = lookahead_decode(model, prompt, max_new, window=0, ngram=N, guesses=1, on_step=steps.append)
        assert got.tokens == greedy_decode(model, prompt, max_new).tokens
        text, at, leftover = prompt + got.tokens, len(prompt), []  # text[at] is the step's `last`
        for s in steps:
            pooled = any(text[i] == text[at] for i in range(at + 2 - N))  # an n-gram ends by `last`
            K = min(N - 1, max_new - (at - len(prompt) + 1) - 1)
            assert s["jacobi"] == (not pooled and bool(leftover) and K > 0), s
            if s["jacobi"]:
                assert s["candidates"] == [(leftover + leftover[-1:] * K)[:K]]
                jacobi_steps += 1
                jacobi_accepted += s["accepted"] > 0
            leftover = []
            if s["candidates"]:
                cand, n = list(s["candidates"][s["winner"]]), s["accepted"]
                preds = model(torch.tensor([text[:at + 1] + cand]))[0].argmax(-1).tolist()
                leftover = preds[at + 1 + n:]  # the predictions after cand[n], cand[n+1], ...
            at += len(s["committed"])
    assert jacobi_steps > 10 and jacobi_accepted > 0, (jacobi_steps, jacobi_accepted)


def sampling_case():
    model = random_model(seed=11, vocab_size=8, n_layers=1)
    prompt = [1, 2] + greedy_decode(model, [1, 2], 12).tokens  # repetitive: the pool holds good drafts
    return model, prompt, Sampling(temperature=0.8, top_p=0.95)


def draw(model, prompt, sampling, cfg, n):
    samples, steps, multi = [], 0, 0
    for seed in range(n):
        gen = lookahead_decode(model, prompt, 4, *cfg, seed=seed, temperature=sampling.temperature,
                               top_p=sampling.top_p)
        samples.append(tuple(gen.tokens))
        multi += max(gen.accepted, default=1) > 1
    return samples, multi


@pytest.mark.parametrize("cfg", [(3, 3, 3), (1, 5, 8), (4, 2, 2)])
def test_lookahead_sampling_keeps_the_distribution(cfg):
    model, prompt, sampling = sampling_case()
    dist = exact_joint(model, prompt, 4, sampling)
    samples, multi = draw(model, prompt, sampling, cfg, 1500)
    assert 0.1 * len(samples) < multi < 0.9 * len(samples)  # drafts often right and often wrong
    stat, critical = chi_square_excess(samples, dist)
    assert stat < critical, (stat, critical)


def test_a_biased_verifier_fails_the_distribution_test(monkeypatch):
    import lookahead

    def accept_first_draft(candidates, K, logits, sampling, rng, gen):
        if not candidates:
            return 0, 0, [torch.multinomial(sampling.probs(logits[0]), 1, generator=gen).item()]
        return 0, 1, [candidates[0][0], torch.multinomial(sampling.probs(logits[1]), 1, generator=gen).item()]

    monkeypatch.setattr(lookahead, "verify_sampled", accept_first_draft)
    model, prompt, sampling = sampling_case()
    samples, _ = draw(model, prompt, sampling, (3, 3, 3), 1500)
    stat, critical = chi_square_excess(samples, exact_joint(model, prompt, 4, sampling))
    assert stat > 3 * critical, (stat, critical)


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
    assert lookahead_decode(model, prompt, 30, W, N, G, seed=seed, **options).tokens == expected
    assert sample_decode(model, prompt, 30, seed=seed, **options).tokens == expected


def test_sampling_is_reproducible_with_a_seed():
    model, prompt, sampling = sampling_case()
    a = lookahead_decode(model, prompt, 20, seed=3, temperature=1.0)
    b = lookahead_decode(model, prompt, 20, seed=3, temperature=1.0)
    assert a.tokens == b.tokens
    assert sample_decode(model, prompt, 20, seed=3).tokens == sample_decode(model, prompt, 20, seed=3).tokens


@pytest.mark.parametrize("options,message", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
])
def test_bad_sampling_options(options, message):
    model = random_model()
    with pytest.raises(ValueError, match=message):
        lookahead_decode(model, [1, 2], 5, **options)
    with pytest.raises(ValueError, match=message):
        sample_decode(model, [1, 2], 5, **{"temperature": 1.0, **options})


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
        assert lookahead_decode(model, prompt, 40, 3, 3, 3, tok.stop_ids).tokens == expected


# --- the command line -------------------------------------------------------------------------

def run_cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_generates_and_compares(tiny_checkpoint, capsys):
    code, out, err = run_cli(capsys, "--model", str(tiny_checkpoint), "--prompt", "w7 w8 w9 w7 w8",
                             "--max-new-tokens", "20", "--compare")
    assert code == 0, err
    assert "identical to greedy: yes" in err and "speed-up" in err
    assert out.strip()


def test_cli_show_is_plain_off_a_terminal_and_trace_shows_the_step(tiny_checkpoint, capsys):
    code, out, err = run_cli(capsys, "--model", str(tiny_checkpoint), "--prompt", "w7 w8 w9 w7 w8",
                             "--max-new-tokens", "20", "--show", "--trace", "2", "--window", "2", "--ngram", "3")
    assert code == 0, err
    assert "\033[" not in out  # stdout is not a terminal here
    assert "-- step 1" in err and "-- step 2" in err and "-- step 3" not in err
    assert "window level 0" in err and "committed" in err
    # The CPU default has no window; after a step with a candidate, its leftover is the Jacobi guess.
    code, out, err = run_cli(capsys, "--model", str(tiny_checkpoint), "--prompt", "w20 w21 w20 w21",
                             "--max-new-tokens", "20", "--trace", "20", "--device", "cpu")
    assert code == 0, err
    assert "window level" not in err and "jacobi guess:" in err


def test_cli_sampling(tiny_checkpoint, capsys):
    code, out, err = run_cli(capsys, "--model", str(tiny_checkpoint), "--prompt", "w7 w8", "--max-new-tokens", "10",
                             "--temperature", "0.8", "--top-p", "0.9", "--seed", "1", "--compare")
    assert code == 0, err
    assert "sampled" in err


@pytest.mark.parametrize("case", [
    "missing_folder", "no_config", "no_weights", "model_type", "pickle_only", "empty_prompt", "long_prompt",
    "window", "ngram", "guesses", "max_new_tokens", "cuda", "dtype", "prompt_file", "top_p", "no_template",
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
    elif case == "model_type":
        cfg = json.loads((tiny_checkpoint / "config.json").read_text())
        (tiny_checkpoint / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    elif case == "pickle_only":
        (tiny_checkpoint / "model.safetensors").rename(tiny_checkpoint / "pytorch_model.bin")
    elif case == "empty_prompt":
        argv[3] = "   "
    elif case == "long_prompt":
        argv[3] = "w7 " * 80
    elif case in ("window", "ngram", "guesses", "max_new_tokens"):
        argv += [f"--{case.replace('_', '-')}", "-1"]
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
    elif case == "no_template":
        (tiny_checkpoint / "tokenizer_config.json").write_text("{}")
        argv += ["--chat"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_cli_ctrl_c_stops_cleanly(tiny_checkpoint, capsys, monkeypatch):
    import lookahead

    def interrupted(model, prompt_ids, max_new_tokens, *args, on_tokens=None, **kwargs):
        on_tokens([7, 8])
        raise KeyboardInterrupt

    monkeypatch.setattr(lookahead, "lookahead_decode", interrupted)
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


def test_bench_measures_and_checks_identity(tiny_checkpoint, tmp_path, capsys):
    import bench
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w7 w8 w9 w7 w8", "chat": false}\n\n{"prompt": "w9 w9", "chat": true}\n')
    out = tmp_path / "bench.json"
    code = bench.main(["--model", str(tiny_checkpoint), "--prompts", str(prompts), "--configs", "3,3,3", "1,4,1",
                       "--max-new-tokens", "12", "--repeats", "2", "--json", str(out)])
    table = capsys.readouterr().out
    assert code == 0, table
    result = json.loads(out.read_text())
    assert [row["config"] for row in result["rows"]] == ["greedy", "3,3,3", "1,4,1"]
    greedy, *lookahead = result["rows"]
    assert all(row["identical"] and row["tokens"] == greedy["tokens"] for row in lookahead)
    assert greedy["steps"] == greedy["tokens"] - 2 and greedy["step_cost"] == pytest.approx(1.0)
    for row in lookahead:  # speed-up = (greedy steps / steps) / step cost, by definition
        assert row["speedup"] == pytest.approx(greedy["steps"] / row["steps"] / row["step_cost"])
    assert "threads, torch" in table and "same as greedy" in table and table.count("yes") == 3


def test_bench_reports_a_wrong_decoder(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    import bench

    def off_by_one(*args, **kwargs):  # a "lookahead" whose last token differs from greedy's
        gen = lookahead_decode(*args, **kwargs)
        gen.tokens[-1] += 1
        return gen

    monkeypatch.setattr(bench, "lookahead_decode", off_by_one)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w7 w8 w9", "chat": false}\n')
    code = bench.main(["--model", str(tiny_checkpoint), "--prompts", str(prompts), "--configs", "2,3,2",
                       "--max-new-tokens", "6", "--repeats", "1"])
    assert code == 1
    assert capsys.readouterr().out.rstrip().endswith("NO")

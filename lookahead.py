"""Lookahead decoding (Fu, Bailis, Stoica, Zhang, ICML 2024, arXiv 2402.02057), exactly greedy.

Greedy decoding is the fixed point of y_i = argmax p(. | prompt, y_<i) for all future i at
once. Jacobi iteration guesses many future tokens and refines them in parallel; each guess
drags an n-gram behind it. Lookahead decoding keeps a 2-D window of those guesses, collects
the n-grams they trace into a pool, and in the SAME forward pass verifies the pooled n-grams
that start with the last token. Whatever verification accepts is exactly what greedy decoding
would have produced, so the output is unchanged; a step just commits up to N tokens.

Read it top to bottom: Generation; greedy_decode and sample_decode (the baselines); NGramPool;
step_layout (the attention mask); verify_greedy and verify_sampled; lookahead_decode (window,
pool, one forward, verify, commit/rollback, the Jacobi guess); the command line.
"""
import argparse
import os
import random
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from model import Transformer


@dataclass
class Generation:
    tokens: list[int]  # the new ids; a stop id, when generated, is the last one
    steps: int  # forward passes after the prefill
    seconds: float  # wall time, prefill included
    accepted: list[int] = field(default_factory=list)  # tokens committed by each step

    @property
    def tokens_per_step(self) -> float:
        """The compression ratio: 1.0 for greedy, up to N for lookahead."""
        return sum(self.accepted) / self.steps if self.steps else 1.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else 0.0

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


def prefill(model: Transformer, prompt_ids) -> torch.Tensor:
    """Run the prompt through the model, filling cache slots [0, P); return the logits (1, 1, V)
    that predict the first new token."""
    P = len(prompt_ids)
    idx = torch.arange(P, device=model.device)
    causal = torch.ones(P, P, dtype=torch.bool, device=model.device).tril()
    logits = model(torch.tensor([prompt_ids], device=model.device), idx, idx, causal, rows=[P - 1])
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
    mask = torch.ones(1, model.cache_len, dtype=torch.bool, device=model.device)

    next_token = pick(prefill(model, prompt_ids)[:, -1])  # (1, 1): stays on the device as the next input
    tokens = [next_token.item()]
    on_tokens and on_tokens(tokens[-1:])
    steps = 0
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        C = model.committed  # the last token sits at position and slot C
        logits = model(next_token, slots[C:C + 1], slots[C:C + 1], mask[:, :C + 1])
        next_token = pick(logits[:, -1])
        model.committed = C + 1
        tokens.append(next_token.item())  # the one host sync per step
        steps += 1
        on_tokens and on_tokens(tokens[-1:])
    return Generation(tokens, steps, time.perf_counter() - start, [1] * steps)


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
    Each n-gram also remembers the tokens seen right before it, to rank it (see get)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.by_key: dict[int, OrderedDict] = {}  # first token -> {rest of the n-gram: tokens before it}

    def add(self, ngram, before=None):
        if self.cap == 0:
            return
        entries = self.by_key.setdefault(ngram[0], OrderedDict())
        rest = tuple(ngram[1:])
        if rest in entries:
            entries.move_to_end(rest)
        else:
            entries[rest] = set()
            if len(entries) > self.cap:
                entries.popitem(last=False)
        if before is not None:
            entries[rest].add(before)

    def get(self, key, before=None) -> list[tuple]:
        """The continuations of `key` (the n-grams without their first token): first those seen
        after `before`, the token before `key` now, then the rest; most recent first in each.
        Two tokens of context pick better than one when there are more n-grams than guesses to
        verify (measured: the summary prompt commits 3.2 tokens per step at 1,4,1 instead of 2.1)."""
        entries = list(reversed(self.by_key.get(key, {}).items()))
        return ([rest for rest, seen in entries if before in seen]
                + [rest for rest, seen in entries if before not in seen])


# The pool keeps at least this many n-grams per key even when fewer are verified per step, so
# that a small G (the CPU default verifies one) picks from several.
POOL_MIN_PER_KEY = 8


@lru_cache(maxsize=None)
def step_layout(W: int, L: int, G: int, K: int):
    """Token layout of one lookahead step and its attention mask, built once per shape.

    The step runs T = 1 + W*L + G*K tokens: the last committed token, a window of L levels of
    W guesses, and G candidate n-grams of K guessed tokens each. Every token sees the whole
    committed cache (not drawn) and, inside the step, exactly the tokens of its own trajectory.
    W=3, L=2 (N=3), G=2, K=2; 'x' = may attend, rows attend to columns:

                      last  level 0   level 1   cand 0  cand 1     position
                       .   a0 a1 a2  b0 b1 b2   c0 c1   d0 d1      (C + ...)
        last       .   x                                              0
        level 0    a0  x   x                                          1
                   a1  x   x  x                                       2
                   a2  x   x  x  x                                    3
        level 1    b0  x   x         x                                2
                   b1  x   x  x         x                             3
                   b2  x   x  x  x         x                          4
        cand 0     c0  x                        x                     1
                   c1  x                        x  x                  2
        cand 1     d0  x                                x             1
                   d1  x                                x  x          2

    Level 0 is a guessed continuation of `last` (a causal run). The token in level l, column
    j was predicted from level l-1, column j one step ago, so its trajectory is level 0 up to
    column j, then its own column up to level l; it stands at position C + 1 + j + l. Each
    candidate is a guessed continuation of `last` on its own. The branches never see each
    other, so one forward computes them as if each ran alone.

    Returns (mask (T, T) bool, position offsets (T,), rows): rows are the tokens whose logits
    are read: `last`, the newest level (its predictions form the next level) and the
    candidates. With candidates last, fewer than G candidates use the leading sub-block.
    """
    T = 1 + W * L + G * K
    mask = torch.zeros(T, T, dtype=torch.bool)
    offsets = torch.zeros(T, dtype=torch.long)
    mask[:, 0] = True
    for level in range(L):
        for j in range(W):
            r = 1 + level * W + j
            mask[r, 1:2 + j] = True  # level 0, columns 0..j
            for up in range(1, level + 1):
                mask[r, 1 + up * W + j] = True  # own column, levels 1..level
            offsets[r] = 1 + j + level
    for g in range(G):
        first = 1 + W * L + g * K
        for t in range(K):
            mask[first + t, first:first + t + 1] = True
            offsets[first + t] = 1 + t
    newest = range(1 + (L - 1) * W, 1 + L * W) if L else range(0)
    rows = torch.tensor([0, *newest, *range(1 + W * L, T)])
    return mask, offsets, rows


def verify_greedy(candidates, K, next_token, cand_pred):
    """Greedy verification -> (winning candidate, guesses accepted, tokens to commit).

    The model's own token for guess t of candidate g is next_token for t = 0, else its
    prediction after guess t-1 (cand_pred[g*K + t-1]). Accept the longest prefix of guesses
    that match, plus the model's token after it: a bonus the forward already computed."""
    best, best_len = 0, 0
    for g, cand in enumerate(candidates):
        n = 0
        while n < K and cand[n] == (next_token if n == 0 else cand_pred[g * K + n - 1]):
            n += 1
        if n > best_len:
            best, best_len = g, n
    if not best_len:
        return 0, 0, [next_token]
    return best, best_len, list(candidates[best][:best_len]) + [cand_pred[best * K + best_len - 1]]


def verify_sampled(candidates, K, logits, sampling, rng, gen):
    """Lossless verification under sampling -> (winning candidate, guesses accepted, tokens).

    Speculative sampling with one-hot drafts, position by position. With p the model's
    distribution at the current position, try the distinct guesses d1, d2, ... there in turn:
    accept d_i with probability p(d_i) / (1 - p(d1) - ... - p(d_i-1)), i.e. p renormalised
    after zeroing the rejected ones. Token d_i then comes out with probability
        (1 - S_i) * p(d_i) / (1 - S_i) = p(d_i),   S_i = p(d1) + ... + p(d_i-1)
    (the product of the rejection probabilities before it telescopes to 1 - S_i), and when all
    are rejected the residual is sampled, so every token x comes out with probability p(x).
    After an acceptance only the candidates that agree continue, with the model's
    distribution given that prefix; every committed token is distributed as plain sampling.
    logits: (1 + len(candidates)*K, V): the row after `last`, then each guess's row."""
    probs = sampling.probs(logits)

    def row(g, t):  # the row holding the distribution for position t along candidate g
        return 0 if t == 0 else 1 + g * K + t - 1

    n = len(candidates)
    if n:  # p[g][t][h] = probability, in candidate g's distribution at t, of candidate h's guess
        cand = torch.tensor(candidates, device=probs.device)  # (n, K)
        rows = torch.tensor([[row(g, t) for t in range(K)] for g in range(n)], device=probs.device)
        p = probs[rows[:, :, None], cand.T[None, :, :]].tolist()  # (n, K, n)
    alive, t = list(range(n)), 0
    while t < K and alive:
        g = alive[0]
        rejected, mass, accepted = [], 0.0, None
        for tok in dict.fromkeys(candidates[h][t] for h in alive):
            h = next(h for h in alive if candidates[h][t] == tok)
            if rng.random() * max(1.0 - mass, 1e-12) < p[g][t][h]:
                accepted = tok
                break
            rejected.append(tok)
            mass += p[g][t][h]
        if accepted is None:  # all rejected: sample the residual and stop here
            residual = probs[row(g, t)].clone()
            residual[rejected] = 0
            if residual.sum() <= 0:  # only rounding can leave nothing: fall back to p itself
                residual = probs[row(g, t)]
            return g, t, list(candidates[g][:t]) + [torch.multinomial(residual, 1, generator=gen).item()]
        alive = [h for h in alive if candidates[h][t] == accepted]
        t += 1
    # Every guess accepted (or none to try): the next token comes from the distribution after them.
    g = alive[0] if alive else 0
    accepted = list(candidates[g][:t]) if candidates else []
    return g, t, accepted + [torch.multinomial(probs[row(g, t)], 1, generator=gen).item()]


@torch.inference_mode()
def lookahead_decode(model, prompt_ids, max_new_tokens, window=7, ngram=5, guesses=7, stop_ids=(),
                     seed=0, prompt_ngrams=True, output_ngrams=True, jacobi_guess=True, on_tokens=None,
                     temperature=0.0, top_k=0, top_p=1.0, on_step=None) -> Generation:
    """Several tokens per forward: W window columns, n-grams of length N, at most G
    candidates verified per step. Greedy by default, and then the tokens equal greedy_decode's;
    with temperature/top_k/top_p the tokens are distributed exactly as sample_decode's.

    prompt_ngrams / output_ngrams: also pool the n-grams of the prompt / of the text committed
    so far (text that repeats itself or copies the prompt is then accepted whole).
    jacobi_guess: when the pool has fewer than G candidates, also verify the model's own
    predictions left over from the step before (step 4 below). window=0 runs no window at all:
    the pool and that guess are then the only sources of candidates (the CPU default).
    on_tokens(new ids) is called as tokens are committed; on_step(dict) after each step with
    what it did (window, candidates, whether the last one is the Jacobi guess, winner,
    accepted), for tracing."""
    W, N, G = window, ngram, guesses
    sampling = Sampling(temperature, top_k, top_p)
    if W < 0 or N < 2 or G < 0:
        raise ValueError(f"need window >= 0, ngram >= 2, guesses >= 0 (got {W}, {N}, {G})")
    start = time.perf_counter()
    max_new_tokens = check_request(model, prompt_ids, max_new_tokens)
    levels = N - 1  # a full window has N-1 levels; with the new prediction they make N-grams
    step_max = 1 + W * levels + G * levels
    ensure_cache(model, min(model.args.max_seq_len, len(prompt_ids) + max_new_tokens - 1 + step_max))
    dev, stop = model.device, set(stop_ids)
    slots = torch.arange(model.cache_len, device=dev)
    # The step's mask is [committed cache: all True | step block]; one buffer serves every step.
    mask_buf = torch.ones(step_max, model.cache_len, dtype=torch.bool, device=dev)
    layouts = {}  # (W, L, K) -> step_layout on the device

    # Window: level 0 starts as random prompt tokens (any guess converges; these are cheap and
    # seeded, so runs repeat). It grows a level per step until it has N-1; verification does not
    # wait for it, since the pool already holds the prompt's n-grams.
    rng = random.Random(seed)
    window = [[rng.choice(prompt_ids) for _ in range(W)]] if W else []
    # Pool: seeded with the prompt's own n-grams, which pays off whenever the answer copies
    # (step 6 below adds the n-grams of the committed text as it grows).
    pool = NGramPool(max(G, POOL_MIN_PER_KEY) if G else 0)
    if prompt_ngrams:
        for i in range(len(prompt_ids) - N + 1):
            pool.add(prompt_ids[i:i + N], prompt_ids[i - 1] if i else None)

    gen = torch.Generator(dev).manual_seed(seed)  # sampling's draws, seeded like the window
    tokens = [sampling.pick(prefill(model, prompt_ids)[0], gen).item()]
    on_tokens and on_tokens(tokens[-1:])
    context = list(prompt_ids)  # and the committed tokens, for output_ngrams

    def pool_output(new_tokens):  # pool the n-grams that end in the new tokens
        context.extend(new_tokens)
        for end in range(max(N, len(context) - len(new_tokens) + 1), len(context) + 1):
            pool.add(context[end - N:end], context[end - N - 1] if end > N else None)

    if output_ngrams:
        pool_output(tokens)
    steps, accepted_lengths = 0, []
    jacobi = []  # the model's predictions left over from the last step (step 4)
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        C, last = model.committed, tokens[-1]  # `last` sits at position and slot C
        # 1. Shape the step. Candidates: pooled n-grams that start with `last`, those seen after
        #    the same token as now first; in a slot they leave free, the Jacobi guess (step 4).
        #    They need not guess past max_new_tokens; near the end of the cache the window sits
        #    out and candidates shrink to what still fits.
        budget = model.cache_len - C
        K = min(levels, max_new_tokens - len(tokens) - 1)
        before = tokens[-2] if len(tokens) > 1 else prompt_ids[-1]  # the token before `last`
        candidates = pool.get(last, before)[:G] if K > 0 else []
        pooled = len(candidates)
        if jacobi and pooled < G and K > 0:
            # Padded to K guesses with its last token: a guess only costs a slot, never exactness.
            candidates.append(jacobi + jacobi[-1:] * (K - len(jacobi)))
        L, w = len(window), W
        if 1 + W * L + len(candidates) * K > budget:
            L = w = 0
            K = min(K, budget - 1)
            candidates = candidates[:(budget - 1) // K] if K > 0 else []
        candidates = [c[:K] for c in candidates]
        key = (w, L, K)
        if key not in layouts:
            layouts[key] = [t.to(dev) for t in step_layout(w, L, G, K)]
        static, offsets, rows = layouts[key]
        T = 1 + w * L + len(candidates) * K

        # 2. One forward over [last] + window + candidates, under the combined mask.
        seq = [last] + [t for level in window[:L] for t in level] + [t for c in candidates for t in c]
        mask_buf[:T, C:C + T] = static[:T, :T]
        logits = model(torch.tensor([seq], device=dev), C + offsets[:T], slots[C:C + T],
                       mask_buf[:T, :C + T], rows=rows[:1 + w + len(candidates) * K])
        mask_buf[:T, C:C + T] = True  # restore: these slots are committed context next step
        pred = logits[0].argmax(-1).tolist()  # the one host sync per greedy step
        next_token, new_level, cand_pred = pred[0], pred[1:1 + w], pred[1 + w:]

        # 3. Verify the candidates against the model's own choices (greedy: its argmax; sampling:
        #    a rejection test that keeps plain sampling's distribution).
        if sampling.greedy:
            best, n_accepted, new_tokens = verify_greedy(candidates, K, next_token, cand_pred)
        else:
            cand_rows = [0] + list(range(1 + w, 1 + w + len(candidates) * K))
            best, n_accepted, new_tokens = verify_sampled(candidates, K, logits[0, cand_rows], sampling, rng, gen)

        # 4. Commit and roll back: `last` is already in slot C; the accepted guesses' K/V move
        #    from the candidate's slots to C+1... Nothing else survives: the rest of this step's
        #    slots lie past the committed length and are overwritten next step.
        first_cand_slot = C + 1 + w * L + best * K
        model.commit([C] + list(range(first_cand_slot, first_cand_slot + n_accepted)))
        # The winner's rows after its first rejected guess predicted the tokens that follow what
        # is committed now, from a context that is wrong in one token; as in Jacobi decoding,
        # they are a guess for the next step, and often right (the pool is often empty for
        # `last`; on the bench prompts at 0,4,1 this guess cuts the steps by a tenth).
        #     winner     c0   c1   c2        accepted: c0 (= next_token), then bonus p1
        #     predicts   p1   p2   p3        jacobi guess for the next step: [p2, p3]
        jacobi = cand_pred[best * K + n_accepted:(best + 1) * K] if candidates and jacobi_guess else []

        if on_step:
            on_step(dict(step=steps, last=last, window=[list(l) for l in window[:L]], candidates=candidates,
                         jacobi=len(candidates) > pooled, winner=best, accepted=n_accepted, committed=new_tokens))

        # 5. Jacobi update: the newest level's predictions become a new level; once the window
        #    is full, each column plus its prediction is an N-gram for the pool, and the
        #    oldest level drops out.
        if w:
            if len(window) == levels:
                for j in range(W):
                    # column j's trajectory continues level 0 after its column j-1
                    pool.add([level[j] for level in window] + [new_level[j]], window[0][j - 1] if j else None)
                window.pop(0)
            window.append(new_level)

        # 6. Stop exactly where greedy would: at a stop id, or at max_new_tokens.
        new_tokens = new_tokens[:max_new_tokens - len(tokens)]
        for i, t in enumerate(new_tokens):
            if t in stop:
                new_tokens = new_tokens[:i + 1]
                break
        tokens += new_tokens
        if output_ngrams:
            pool_output(new_tokens)
        steps += 1
        accepted_lengths.append(len(new_tokens))
        on_tokens and on_tokens(new_tokens)
    return Generation(tokens, steps, time.perf_counter() - start, accepted_lengths)


# ---------------------------------------------------------------------------------------------
# Command line

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# --show: a colour per number of tokens a step committed (1 = plain).
COLOURS = {2: "36", 3: "32", 4: "33", 5: "35"}


def default_config(device) -> tuple[int, int, int]:
    """(W, N, G) by device type, chosen with bench.py (README, Performance).

    A CPU step costs about one token's forward only up to 4 tokens, so the CPU gets the last
    token and one candidate of three guesses: a pooled 4-gram, else the Jacobi guess; a window
    does not fit in that budget. A GPU step costs about the same for hundreds of tokens, so it
    gets a wide window and many candidates."""
    return (15, 5, 15) if torch.device(device).type == "cuda" else (0, 4, 1)


def default_dtype(device):
    """float32 on the CPU: without native bf16 matrix units, bf16 products of more than a
    few tokens cost more than float32 ones there. On a GPU, the checkpoint's own dtype."""
    return torch.float32 if torch.device(device).type == "cpu" else None


def resolve_model(name: str) -> str:
    """A local folder, or a Hugging Face Hub repo id looked up in (then fetched into) the local
    Hugging Face cache."""
    from pathlib import Path
    if Path(name).exists() or name.count("/") != 1 or name.startswith((".", "/", "~")):
        return name  # a folder; Transformer.from_pretrained says what is wrong with it
    from huggingface_hub import snapshot_download
    files = ["*.json", "*.safetensors", "*.jinja"]
    try:
        return snapshot_download(name, allow_patterns=files, local_files_only=True)
    except Exception:
        pass
    try:
        return snapshot_download(name, allow_patterns=files)
    except Exception as e:
        raise ValueError(f"model {name!r} is neither a folder nor in the Hugging Face cache, and could not be "
                         f"downloaded ({type(e).__name__}); fetch it with `hf download {name}` where there is "
                         f"network, or pass a checkpoint folder") from None


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line, not a usage dump
        self.exit(2, f"error: {message} (see --help)\n")


def parse_args(argv):
    ap = ArgumentParser(description="Lookahead decoding: greedy (or sampled) output, fewer forward passes.")
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"checkpoint folder or Hub repo id (default {DEFAULT_MODEL})")
    ap.add_argument("--prompt", help="the prompt text")
    ap.add_argument("--prompt-file", help="read the prompt from this file")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--window", type=int, default=None, help="W: columns of the lookahead window (0: none)")
    ap.add_argument("--ngram", type=int, default=None, help="N: n-gram length (window levels + 1)")
    ap.add_argument("--guesses", type=int, default=None, help="G: candidates verified per step")
    ap.add_argument("--greedy", action="store_true", help="plain one-token-per-step decoding instead")
    ap.add_argument("--compare", action="store_true", help="run both, check they agree, compare speed")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", action="store_true", help="colour tokens by how many their step committed")
    ap.add_argument("--trace", type=int, nargs="?", const=3, default=0, metavar="STEPS",
                    help="print what the first STEPS steps did (default 3)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--dtype", default=None, help=f"{', '.join(DTYPES)} (default: float32 on CPU, else the checkpoint's)")
    args = ap.parse_args(argv)

    if (args.prompt is None) == (args.prompt_file is None):
        ap.error("give one of --prompt or --prompt-file")
    if args.device not in (None, "cpu", "cuda") and not args.device.startswith("cuda:"):
        ap.error(f"unknown device {args.device!r} (cpu or cuda)")
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda, but PyTorch sees no CUDA GPU here")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.dtype is not None and args.dtype not in DTYPES:
        ap.error(f"unknown dtype {args.dtype!r} (one of {', '.join(DTYPES)})")
    if args.dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        ap.error("this GPU does not support bfloat16; use --dtype float16")
    W, N, G = default_config(device)
    or_default = lambda given, default: default if given is None else given  # noqa: E731
    args.window, args.ngram, args.guesses = or_default(args.window, W), or_default(args.ngram, N), or_default(args.guesses, G)
    for name, value, least in (("window", args.window, 0), ("ngram", args.ngram, 2), ("guesses", args.guesses, 0),
                               ("max-new-tokens", args.max_new_tokens, 1)):
        if value < least:
            ap.error(f"--{name} must be at least {least}, got {value}")
    try:
        args.sampling = Sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        ap.error(str(e))
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                args.prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            ap.error(f"cannot read the prompt file {args.prompt_file}: {getattr(e, 'strerror', None) or e}")
    if not args.prompt.strip():
        ap.error("the prompt is empty")
    args.device = device
    return args


def main(argv=None):
    args = parse_args(argv)
    from tokenizer import TextStream, Tokenizer
    colour = args.show and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    try:
        path = resolve_model(args.model)
        model = Transformer.from_pretrained(path, args.device, DTYPES.get(args.dtype) or default_dtype(args.device))
        tokenizer = Tokenizer.from_pretrained(path)
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        prompt_ids = tokenizer.encode(text)
        stop_ids = tokenizer.stop_ids or model.args.eos_ids
        sampling = args.sampling

        def piece(ids):  # a token as the trace shows it
            return repr(tokenizer.decode(list(ids) if isinstance(ids, (list, tuple)) else [ids]))

        def trace(step):
            if step["step"] >= args.trace:
                return
            out = [f"\n-- step {step['step'] + 1}: last token {piece(step['last'])}"]
            for i, level in enumerate(step["window"]):
                out.append(f"   window level {i}: " + " ".join(piece(t) for t in level))
            for g, cand in enumerate(step["candidates"]):
                mark = f"<- {step['accepted']} accepted" if g == step["winner"] and step["accepted"] else ""
                source = "jacobi guess" if step["jacobi"] and g == len(step["candidates"]) - 1 else f"candidate {g}"
                out.append(f"   {source}: " + " ".join(piece(t) for t in cand) + f"  {mark}")
            if not step["candidates"]:
                out.append("   no candidates start with the last token")
            out.append(f"   committed {len(step['committed'])}: {piece(step['committed'])}")
            print("\n".join(out), file=sys.stderr, flush=True)

        def run(greedy: bool, stream: bool) -> Generation:
            out = TextStream(tokenizer)
            stop = set(stop_ids)

            def on_tokens(ids):
                text = out.push([t for t in ids if t not in stop])  # the stop token ends, it is not text
                if colour and len(ids) > 1 and text:
                    text = f"\033[{COLOURS[min(len(ids), 5)]}m{text}\033[0m"
                print(text, end="", flush=True)

            name = "greedy" if greedy else f"lookahead W={args.window} N={args.ngram} G={args.guesses}"
            if not sampling.greedy:
                name += f", temperature {sampling.temperature} top-k {sampling.top_k} top-p {sampling.top_p}"
            try:
                if greedy and sampling.greedy:
                    gen = greedy_decode(model, prompt_ids, args.max_new_tokens, stop_ids, on_tokens if stream else None)
                elif greedy:
                    gen = sample_decode(model, prompt_ids, args.max_new_tokens, sampling.temperature, sampling.top_k,
                                        sampling.top_p, args.seed, stop_ids, on_tokens if stream else None)
                else:
                    gen = lookahead_decode(model, prompt_ids, args.max_new_tokens, args.window, args.ngram,
                                           args.guesses, stop_ids, seed=args.seed, on_tokens=on_tokens if stream else None,
                                           temperature=sampling.temperature, top_k=sampling.top_k,
                                           top_p=sampling.top_p, on_step=trace if args.trace else None)
            finally:
                if stream:
                    print(out.flush(), flush=True)
            hist = " ".join(f"{n}:{c}" for n, c in gen.histogram.items())
            print(f"[{name}] {len(gen.tokens)} tokens, {gen.steps} steps, {gen.tokens_per_step:.2f} tokens/step "
                  f"(steps by tokens committed {hist or '-'}), {gen.tokens_per_second:.1f} tokens/s",
                  file=sys.stderr)
            return gen

        if colour and not args.greedy:
            print("legend: plain = 1 token/step, " + ", ".join(f"\033[{c}m{n}{'+' if n == 5 else ''} tokens\033[0m"
                                                               for n, c in COLOURS.items()), file=sys.stderr)
        if not args.compare:
            run(args.greedy, stream=True)
            return 0
        base = run(True, stream=False)
        ours = run(False, stream=True)
        same = base.tokens == ours.tokens
        verdict = f"identical to greedy: {'yes' if same else 'NO'}" if sampling.greedy else "sampled: tokens may differ"
        print(f"{verdict}; speed-up {base.seconds / ours.seconds:.2f}x; "
              f"compression {ours.tokens_per_step:.2f} tokens/step", file=sys.stderr)
        return 0 if same or not sampling.greedy else 1
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

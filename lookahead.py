"""Lookahead decoding (Fu, Bailis, Stoica, Zhang, ICML 2024, arXiv 2402.02057), exactly greedy.

Greedy decoding is the fixed point of y_i = argmax p(. | prompt, y_<i) for all future i at
once. Jacobi iteration guesses many future tokens and refines them in parallel; each guess
drags an n-gram behind it. Lookahead decoding keeps a 2-D window of those guesses, collects
the n-grams they trace into a pool, and in the SAME forward pass verifies the pooled n-grams
that start with the last token. Whatever verification accepts is exactly what greedy decoding
would have produced, so the output is unchanged; a step just commits up to N tokens.

Read it top to bottom: Generation, greedy_decode (the baseline), NGramPool, step_layout (the
attention mask), lookahead_decode (window, pool, one forward, verify, commit), the CLI.
"""
import argparse
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


def prefill(model: Transformer, prompt_ids) -> int:
    """Run the prompt through the model, filling cache slots [0, P); return the first new token."""
    P = len(prompt_ids)
    idx = torch.arange(P, device=model.device)
    causal = torch.ones(P, P, dtype=torch.bool, device=model.device).tril()
    logits = model(torch.tensor([prompt_ids], device=model.device), idx, idx, causal, rows=[P - 1])
    model.committed = P
    return logits[0, -1].argmax().item()


@torch.inference_mode()
def greedy_decode(model, prompt_ids, max_new_tokens, stop_ids=(), on_tokens=None) -> Generation:
    """The baseline: one token per forward. Lookahead must reproduce it token for token."""
    start = time.perf_counter()
    max_new_tokens = check_request(model, prompt_ids, max_new_tokens)
    ensure_cache(model, len(prompt_ids) + max_new_tokens - 1)
    stop = set(stop_ids)
    slots = torch.arange(model.cache_len, device=model.device)
    mask = torch.ones(1, model.cache_len, dtype=torch.bool, device=model.device)

    tokens = [prefill(model, prompt_ids)]
    on_tokens and on_tokens(tokens[-1:])
    next_token = torch.tensor([tokens], device=model.device)  # (1, 1)
    steps = 0
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        C = model.committed  # the last token sits at position and slot C
        logits = model(next_token, slots[C:C + 1], slots[C:C + 1], mask[:, :C + 1])
        next_token = logits[:, -1].argmax(-1, keepdim=True)  # stays on the device as the next input
        model.committed = C + 1
        tokens.append(next_token.item())  # the one host sync per step
        steps += 1
        on_tokens and on_tokens(tokens[-1:])
    return Generation(tokens, steps, time.perf_counter() - start, [1] * steps)


class NGramPool:
    """n-grams seen so far, keyed by their first token, at most `cap` per key, least recently
    seen evicted first. A repeated n-gram moves to the most recent end instead of duplicating."""

    def __init__(self, cap: int):
        self.cap = cap
        self.by_key: dict[int, OrderedDict] = {}

    def add(self, ngram):
        if self.cap == 0:
            return
        entries = self.by_key.setdefault(ngram[0], OrderedDict())
        rest = tuple(ngram[1:])
        if rest in entries:
            entries.move_to_end(rest)
        else:
            entries[rest] = None
            if len(entries) > self.cap:
                entries.popitem(last=False)

    def get(self, key) -> list[tuple]:
        """The continuations (the n-grams without their first token), most recent first."""
        return list(reversed(self.by_key.get(key, ())))


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


@torch.inference_mode()
def lookahead_decode(model, prompt_ids, max_new_tokens, window=7, ngram=5, guesses=7, stop_ids=(),
                     seed=0, seed_pool=True, on_tokens=None) -> Generation:
    """Greedy decoding, several tokens per forward: W window columns, n-grams of length N,
    at most G candidates verified per step. The tokens equal greedy_decode's."""
    W, N, G = window, ngram, guesses
    if W < 1 or N < 2 or G < 0:
        raise ValueError(f"need window >= 1, ngram >= 2, guesses >= 0 (got {W}, {N}, {G})")
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
    # seeded, so runs repeat). It grows a level per step until it has N-1.
    rng = random.Random(seed)
    window = [[rng.choice(prompt_ids) for _ in range(W)]]
    # Pool: seeded with the prompt's own n-grams, which pays off whenever the answer copies.
    pool = NGramPool(G)
    if seed_pool:
        for i in range(len(prompt_ids) - N + 1):
            pool.add(prompt_ids[i:i + N])

    tokens = [prefill(model, prompt_ids)]
    on_tokens and on_tokens(tokens[-1:])
    steps, accepted_lengths = 0, []
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        C, last = model.committed, tokens[-1]  # `last` sits at position and slot C
        # 1. Shape the step. Candidates need not guess past max_new_tokens; near the end of
        #    the cache the window sits out and candidates shrink to what still fits.
        budget = model.cache_len - C
        K = min(levels, max_new_tokens - len(tokens) - 1)
        candidates = pool.get(last)[:G] if K > 0 else []
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
        pred = logits[0].argmax(-1).tolist()  # the one host sync per step
        next_token, new_level, cand_pred = pred[0], pred[1:1 + w], pred[1 + w:]

        # 3. Verify: the model's own next token along candidate g is next_token for its first
        #    guess, then its prediction after guess t for guess t+1. Accept the longest prefix
        #    of guesses that match, plus the model's token after it (a bonus the model computed).
        best, best_len = 0, 0
        for g, cand in enumerate(candidates):
            n = 0
            while n < K and cand[n] == (next_token if n == 0 else cand_pred[g * K + n - 1]):
                n += 1
            if n > best_len:
                best, best_len = g, n
        if best_len:
            bonus = cand_pred[best * K + best_len - 1]
            new_tokens = list(candidates[best][:best_len]) + [bonus]
        else:
            new_tokens = [next_token]

        # 4. Commit and roll back: `last` is already in slot C; the accepted guesses' K/V move
        #    from the candidate's slots to C+1... Nothing else survives: the rest of this step's
        #    slots lie past the committed length and are overwritten next step.
        first_cand_slot = C + 1 + w * L + best * K
        model.commit([C] + list(range(first_cand_slot, first_cand_slot + best_len)))

        # 5. Jacobi update: the newest level's predictions become a new level; once the window
        #    is full, each column plus its prediction is an N-gram for the pool, and the
        #    oldest level drops out.
        if w:
            if len(window) == levels:
                for j in range(W):
                    pool.add([level[j] for level in window] + [new_level[j]])
                window.pop(0)
            window.append(new_level)

        # Stop exactly where greedy would: at a stop id, or at max_new_tokens.
        new_tokens = new_tokens[:max_new_tokens - len(tokens)]
        for i, t in enumerate(new_tokens):
            if t in stop:
                new_tokens = new_tokens[:i + 1]
                break
        tokens += new_tokens
        steps += 1
        accepted_lengths.append(len(new_tokens))
        on_tokens and on_tokens(new_tokens)
    return Generation(tokens, steps, time.perf_counter() - start, accepted_lengths)


# ---------------------------------------------------------------------------------------------
# Command line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def main(argv=None):
    ap = argparse.ArgumentParser(description="Lookahead decoding: greedy output, fewer forward passes.")
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint folder (config.json, *.safetensors)")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--window", type=int, default=7, help="W: columns of the lookahead window")
    ap.add_argument("--ngram", type=int, default=5, help="N: n-gram length (window levels + 1)")
    ap.add_argument("--guesses", type=int, default=7, help="G: candidates verified per step")
    ap.add_argument("--greedy", action="store_true", help="run plain greedy decoding instead")
    ap.add_argument("--compare", action="store_true", help="run both, check they agree, compare speed")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--dtype", choices=DTYPES, default=None, help="default: the checkpoint's")
    args = ap.parse_args(argv)

    from tokenizer import TextStream, Tokenizer
    try:
        model = Transformer.from_pretrained(args.model, args.device, DTYPES.get(args.dtype))
        tokenizer = Tokenizer.from_pretrained(args.model)
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        prompt_ids = tokenizer.encode(text)
        stop_ids = tokenizer.stop_ids or model.args.eos_ids

        def run(greedy: bool, stream: bool) -> Generation:
            out = TextStream(tokenizer)
            on_tokens = (lambda ids: print(out.push(ids), end="", flush=True)) if stream else None
            if greedy:
                gen = greedy_decode(model, prompt_ids, args.max_new_tokens, stop_ids, on_tokens)
            else:
                gen = lookahead_decode(model, prompt_ids, args.max_new_tokens, args.window, args.ngram,
                                       args.guesses, stop_ids, on_tokens=on_tokens)
            if stream:
                print(out.flush(), flush=True)
            name = "greedy" if greedy else f"lookahead W={args.window} N={args.ngram} G={args.guesses}"
            print(f"[{name}] {len(gen.tokens)} tokens, {gen.steps} steps, {gen.tokens_per_step:.2f} tokens/step, "
                  f"{gen.tokens_per_second:.1f} tokens/s", file=sys.stderr)
            return gen

        if not args.compare:
            run(args.greedy, stream=True)
            return 0
        greedy = run(True, stream=False)
        lookahead = run(False, stream=True)
        same = greedy.tokens == lookahead.tokens
        print(f"identical to greedy: {'yes' if same else 'NO'}; speed-up {greedy.seconds / lookahead.seconds:.2f}x; "
              f"compression {lookahead.tokens_per_step:.2f} tokens/step", file=sys.stderr)
        return 0 if same else 1
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

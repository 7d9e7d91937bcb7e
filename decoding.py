"""What every decoder here shares, and the baselines lookahead decoding must reproduce.

A request is checked before any work (check_requests), the prompts are prefilled into their
rows of the KV cache (prefill), and a decoder returns a Generation per prompt. greedy_decode and
sample_decode run one token per forward, for one prompt or a batch (one_by_one): the output and
the distribution that lookahead.py must give, token for token.
"""
import gc
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from model import Transformer
from sampling import GREEDY, Sampling


@dataclass
class Generation:
    tokens: list[int]  # the new ids; a stop id, when generated, is the last one
    steps: int  # forward passes after the prefill
    seconds: float  # wall time, prefill included
    committed: list[int] = field(default_factory=list)  # tokens committed by each step
    shapes: list = field(default_factory=list)  # lookahead: each step's Shape
    prefill_seconds: float = 0.0  # of `seconds`: the prompt's forward and the first token
    host_seconds: float = 0.0  # lookahead: of the steps' time, all but the model's forward (host work)
    source_seconds: dict = field(default_factory=dict)  # lookahead: of it, each draft source's, by name
    # The dynamic shape: each draft source's guesses, by its name, then by label (Candidate.source):
    # [tested (their parent was accepted, so verification judged them), accepted, accepted that
    # no other label proposed].
    source_guesses: dict = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> float:
        """The compression ratio: 1.0 for greedy, at most N in the fixed shape (deeper chains: more)."""
        return sum(self.committed) / self.steps if self.steps else 1.0

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
        return dict(sorted(Counter(self.committed).items()))


def check_requests(model: Transformer, prompts, max_new_tokens: int) -> list[int]:
    """Validate a batch of requests before any work; return how many tokens each may generate
    (the context bounds it)."""
    context = model.args.max_seq_len
    if not prompts:
        raise ValueError("no prompts given")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    for i, prompt_ids in enumerate(prompts):
        which = f" (prompt {i + 1} of {len(prompts)})" if len(prompts) > 1 else ""
        if not prompt_ids:
            raise ValueError(f"the prompt is empty{which}")
        if min(prompt_ids) < 0 or max(prompt_ids) >= model.args.vocab_size:
            raise ValueError(f"prompt ids must lie in [0, {model.args.vocab_size}){which}")
        if len(prompt_ids) >= context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {context}{which}")
    if len(prompts) > 1 and model.compiled is not None:
        raise ValueError("a compiled model decodes one sequence at a time; load it without compile for a batch")
    need = max(len(p) for p in prompts) + max_new_tokens - 1
    if model.compiled is not None and need > model.cache.slots < context:
        raise ValueError(f"the request needs {need} cache slots and the compiled cache holds {model.cache.slots}; "
                         f"load with max_seq_len={min(need, context)} (--max-seq-len)")
    # The last generated token never needs a K/V slot, so m tokens need len(prompt) + m - 1.
    return [min(max_new_tokens, context - len(p)) for p in prompts]


def ensure_cache(model: Transformer, needed: int, rows: int):
    """Reuse the model's KV cache when it has the rows and is long enough; else allocate once,
    with headroom for longer requests. A compiled model keeps its cache (check_requests made sure
    the request fits; lookahead's steps near its end shrink to what is left)."""
    if model.compiled is not None:
        return
    if model.cache.slots < needed or model.cache.rows != rows:
        grown = 2 * model.cache.slots if model.cache.rows == rows else 0
        model.cache.setup(min(model.args.max_seq_len, max(needed, grown, 256)), rows)


PREFILL_CHUNK = 1024  # a prompt runs this many tokens a forward: its activations stay those of 1024 tokens


def run_prompt(model: Transformer, ids: list[int], row: int, head=True):
    """Run a sequence's tokens into slots [0, len(ids)) of cache row `row`, PREFILL_CHUNK at a
    time, each chunk causal over itself and the chunks before it (already in the cache), so a
    prompt's peak memory is bounded whatever its length:

        chunk 0: [ causal ]
        chunk 1: [ sees chunk 0 | causal ]
        chunk 2: [ sees chunks 0, 1     | causal ]

    Returns the final hidden states (len(ids), dim) when head=False, else the last token's
    logits (1, V)."""
    P, dev = len(ids), model.device
    tokens = torch.tensor([ids], device=dev)  # (1, P)
    hidden = []
    for a in range(0, P, PREFILL_CHUNK):
        end = min(a + PREFILL_CHUNK, P)
        last = torch.tensor([end - 1 - a], device=dev) if head and end == P else None  # the logits row
        out = model(tokens[:, a:end], torch.arange(a, end, device=dev), torch.full((1, 1), a, device=dev),
                    committed_range=(a, a), cache_row=row, prompt_end=P - 1, read=last, head=last is not None)
        if not head:
            hidden.append(out[0])
    return torch.cat(hidden) if not head else out[:, -1]


def prefill(model: Transformer, prompts, rankings: int = 0):
    """Run each prompt through the model, prompt b filling slots [0, P_b) of cache row b; return
    the logits (B, V) that predict each first new token. One prompt at a time, so that prompts
    of different lengths cost the sum of their lengths, not B times the longest.
    rankings: also return, per prompt, the model's `rankings` best tokens after each of its
    tokens (P_b, k) as lists, the logits read 256 positions at a time (for draft sources)."""
    logits, tops = [], []
    for b, prompt_ids in enumerate(prompts):
        if not rankings:
            logits.append(run_prompt(model, prompt_ids, b))
            continue
        hidden = run_prompt(model, prompt_ids, b, head=False)  # (P, dim)
        logits.append(model.lm_head(hidden[-1:]))
        tops.append(torch.cat([model.lm_head(hidden[i:i + 256]).topk(rankings).indices
                               for i in range(0, len(prompt_ids), 256)]).tolist())
    return (torch.cat(logits), tops) if rankings else torch.cat(logits)  # (B, V)


def rope_switch(model: Transformer) -> int | None:
    """Longrope's original context, where a sequence switches to the long factors (else None)."""
    s = model.args.rope_scaling
    return s["original_max_position_embeddings"] if s and s["rope_type"] == "longrope" else None


def switch_rope(model: Transformer, row: int, C: int, prompt: list[int], tokens: list[int]) -> bool:
    """Phi-3's longrope rotates a sequence longer than its original context with other factors,
    all of its tokens. transformers' greedy decoding drops its cache at the step where the
    sequence grows past that length and runs it whole; here the row's committed tokens and its
    `last` (prompt + tokens, C + 1 tokens; joined only then) are run again into their slots, so
    that every later step sees exactly those keys. Steps before that keep their positions before
    the switch (before_step)."""
    if C == rope_switch(model):
        run_prompt(model, prompt + tokens, row)
        return True
    return False


def before_step(model, policy, rows) -> int:
    """The most tokens this step may hold: the cache's free slots, the policy's largest size,
    and before a longrope switch (switch_rope) no position past it; each row's expected_guesses
    and the draft sources the policy asks (drafts.py). (One function, not one a part: after a
    CPU forward each function a step calls starts cold.)"""
    switch, slots, limit = rope_switch(model), model.cache.slots, policy.largest
    for row in rows:
        limit = min(limit, slots - row.C, switch - row.C if switch is not None and row.C < switch else slots)
    expected_guesses = min(limit, policy.expected_size(len(rows))) - 1  # all of a step but `last`
    for j, row in enumerate(rows):
        if row.C == switch and switch_rope(model, j, row.C, row.prompt, row.tokens):
            row.moves = []  # every committed slot written anew: nothing to roll back
        row.expected_guesses, row.proposers = expected_guesses, policy.proposers(row)
    return limit


def per_row(on_tokens):
    """A single sequence's on_tokens(ids) as a batch's on_tokens(row, ids)."""
    return on_tokens and (lambda _, ids: on_tokens(ids))


def drop_finished(model: Transformer, active: list[int], done, gens: list[Generation], used: int, start) -> list[int]:
    """The indices into `active` (the batch's rows, in the cache's row order) of the rows still
    decoding; the finished ones get their wall time and leave the cache (their committed slots
    are the first `used`), so that they cost nothing after."""
    keep = [j for j, b in enumerate(active) if not done(b)]
    for j in set(range(len(active))) - set(keep):
        gens[active[j]].seconds = time.perf_counter() - start
    if keep and len(keep) < len(active):
        model.cache.keep_rows(keep, used)
    return keep


@contextmanager
def no_cycle_collection():
    """Python's cyclic garbage collector off while a decoder runs, restored after: a decode
    makes no reference cycles (tested), so each collection would walk every object the process
    holds (the model, the pool, the sources' indexes) and find nothing, at about 15 us a step of
    host work on a CPU (docs/PERFORMANCE.md). Whatever the caller's callbacks leave in cycles
    is collected once it is back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@no_cycle_collection()
def one_by_one(model, prompts, max_new_tokens, stop_ids, on_tokens, sampling, seed=0) -> list[Generation]:
    """Prefill, then one token per forward for each row, reusing the cache. Row b's last token
    sits at slot and position C[b]; every step runs every unfinished row's last token."""
    start = time.perf_counter()
    limits = check_requests(model, prompts, max_new_tokens)
    ensure_cache(model, max(len(p) + m - 1 for p, m in zip(prompts, limits)), len(prompts))
    stop, dev = set(stop_ids), model.device
    gens = [torch.Generator(dev).manual_seed(seed + b) for b in range(len(prompts))]

    next_tokens = sampling.pick(prefill(model, prompts), gens)  # (B, 1): stays on the device as the input
    tokens = [[t] for t in next_tokens[:, 0].tolist()]
    out = [Generation(t, 0, 0.0, prefill_seconds=time.perf_counter() - start) for t in tokens]
    C = torch.tensor([[len(p)] for p in prompts], device=dev)  # (B, 1)
    lengths = [len(p) for p in prompts]  # C on the host: the committed_range of the cache read
    active = list(range(len(prompts)))  # the rows still decoding, in the cache's row order
    alone = torch.ones(len(prompts), 1, 1, dtype=torch.bool, device=dev)  # each token's mask: itself
    for b in active:
        on_tokens and on_tokens(b, tokens[b])
    while True:
        keep = drop_finished(model, active, lambda b: len(tokens[b]) >= limits[b] or tokens[b][-1] in stop, out,
                             max(lengths[b] for b in active), start)
        if not keep:
            return out
        if len(keep) < len(active):  # finished rows leave the batch (and the cache)
            active, C, next_tokens = [active[j] for j in keep], C[keep], next_tokens[keep]
        for j, b in enumerate(active):
            switch_rope(model, j, lengths[b], prompts[b], tokens[b])
        committed_range = min(lengths[b] for b in active), max(lengths[b] for b in active)
        logits = model.step(next_tokens, C, C, alone[:len(active)], committed_range)  # (B, 1, V): each sees its committed slots
        next_tokens = sampling.pick(logits[:, -1], [gens[b] for b in active])
        C = C + 1
        for b, t in zip(active, next_tokens[:, 0].tolist()):  # the one host sync per step
            tokens[b].append(t)
            lengths[b] += 1
            out[b].steps += 1
            out[b].committed.append(1)
            on_tokens and on_tokens(b, [t])


@torch.inference_mode()
def greedy_decode(model, prompt_ids, max_new_tokens, stop_ids=(), on_tokens=None) -> Generation:
    """The baseline: one token per forward. Lookahead must reproduce it token for token."""
    return one_by_one(model, [prompt_ids], max_new_tokens, stop_ids, per_row(on_tokens), GREEDY)[0]


@torch.inference_mode()
def greedy_decode_batch(model, prompts, max_new_tokens, stop_ids=(), on_tokens=None) -> list[Generation]:
    """greedy_decode for several prompts in one forward per step; on_tokens(row, new ids)."""
    return one_by_one(model, prompts, max_new_tokens, stop_ids, on_tokens, GREEDY)


@torch.inference_mode()
def sample_decode(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, seed=0,
                  stop_ids=(), on_tokens=None) -> Generation:
    """Plain sampling, one token per forward: the distribution lookahead sampling must keep."""
    sampling = Sampling(temperature, top_k, top_p)
    return one_by_one(model, [prompt_ids], max_new_tokens, stop_ids, per_row(on_tokens), sampling, seed)[0]

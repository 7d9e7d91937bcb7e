"""A draft model as a draft source: classic speculative decoding (Leviathan et al. 2023). A
smaller model with the same tokenizer guesses a chain greedily, one forward a token, from its
own KV cache; the big model verifies that chain beside the pool's n-grams and the Jacobi guess,
in its one forward a step. Only the public contract (drafts.py) and the model's forward are used:

    DRAFT_MODEL=path/to/small/checkpoint python lookahead.py \\
        --drafts pool,examples/draft_model.py:DraftModel,jacobi --prompt ...
"""
import os

import torch

from drafts import Candidate, DraftSource
from model import Transformer

LOADED = {}  # checkpoint folder -> its model, loaded once a process (every row shares it)


class DraftModel(DraftSource):
    """The draft model's greedy chain of up to `guesses` tokens (no more than the policy expects
    a step to hold). Each row keeps its own K/V of the text so far (prompt + committed): a step
    runs only what was committed since the last one, then one token a guess; the guesses' K/V,
    past the committed text, are overwritten by the next step's."""

    def __init__(self, model: Transformer | None = None, guesses: int = 8):
        if model is None:
            path = os.environ.get("DRAFT_MODEL")
            if not path:
                raise ValueError("DraftModel: set DRAFT_MODEL to the draft checkpoint's folder")
            if path not in LOADED:
                LOADED[path] = Transformer.from_pretrained(path)
            model = LOADED[path]
        self.model, self.guesses = model, guesses
        self.kv = None  # this row's (K, V) per layer, put in the model's layers while it runs
        self.fed = 0  # tokens of prompt + output whose K/V are in this row's cache

    def use_own_cache(self, slots: int):
        cache = self.model.cache
        if self.kv is None:  # allocated once a row, then swapped in: rows share the weights only
            cache.setup(min(slots, self.model.args.max_seq_len), rows=1)
            self.kv = [(a.k_cache, a.v_cache) for a in cache.attentions]
        for attention, (k, v) in zip(cache.attentions, self.kv):
            attention.k_cache, attention.v_cache = k, v

    def run(self, tokens: list[int], at: int) -> int:
        """Run tokens at positions (and slots) at, at+1, ... after the cache's first `at`; the
        draft's next token after the last of them."""
        dev = self.model.device
        logits = self.model(torch.tensor([tokens], device=dev), torch.arange(at, at + len(tokens), device=dev),
                            torch.tensor([[at]], device=dev), committed_range=(at, at), read=torch.tensor([len(tokens) - 1], device=dev))
        return int(logits[0, -1].argmax())

    def propose(self, seq, k):
        text = seq.prompt + seq.tokens
        n = min(k, self.guesses, max(seq.expected_guesses, 1), self.model.args.max_seq_len - len(text))
        if n < 1:
            return []
        self.use_own_cache(len(seq.prompt) + seq.max_new + self.guesses)
        chain = [self.run(text[self.fed:], self.fed)]  # what was committed since, `last` included
        self.fed = len(text)
        while len(chain) < n:
            chain.append(self.run(chain[-1:], len(text) + len(chain) - 1))
        return [Candidate(tuple(chain), "draft model")]

"""Sampling: the distribution plain sampling draws from, and lookahead's verification that keeps it.

Temperature, top-k and top-p shape the model's distribution (Sampling.probs); plain sampling
draws one token a forward from it (decoding.sample_decode); lookahead decoding verifies its
guesses with verify_sampled, which accepts each with exactly the probability that keeps that
distribution, token for token.
"""
from dataclasses import dataclass

import torch


def argmax(logits: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """logits.argmax(-1), read as torch.max's indices: the same index (the first of equal
    largest values, as both document), but torch's argmax kernel is the slower on a CPU, and a
    lookahead step reads the argmax after every position it reads (docs/PERFORMANCE.md)."""
    return logits.max(-1, keepdim=keepdim).indices


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

    def pick(self, logits: torch.Tensor, generators) -> torch.Tensor:
        """(B, V) logits -> (B, 1) tokens: the argmax when greedy, else a draw from probs with
        row b's own generator."""
        if self.greedy:
            return argmax(logits, keepdim=True)
        probs = self.probs(logits)
        return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])[:, None]


GREEDY = Sampling(temperature=0)


def verify_sampled(tree, probs, rng, gen) -> tuple[list[int], int]:
    """Lossless verification under sampling -> (accepted nodes, the next sampled token).

    Speculative sampling with one-hot drafts down the trie. With p the model's distribution after
    node v (probs[v], (len(tree), V)), try v's children d1, d2, ... in turn, accepting d_i with
    probability p(d_i) / (1 - S_i), S_i = p(d1) + ... + p(d_i-1): p renormalised without the
    rejected ones. The rejections before it leave probability 1 - S_i, so d_i comes out with
    probability p(d_i); if all are rejected the residual is sampled: every token x has p(x). An
    accepted child continues the walk with the model's distribution given that prefix."""
    p_own = [1.0]  # p_own[i]: probability of node i's token under its parent's distribution
    if len(tree) > 1:
        p_own += probs[tree.parent[1:], tree.tokens[1:]].tolist()  # one host sync for all guesses
    path, v = [], 0
    while tree.children[v]:
        mass, rejected, accepted = 0.0, [], None
        for tok, child in tree.children[v].items():
            if rng.random() * max(1.0 - mass, 1e-12) < p_own[child]:
                accepted = child
                break
            rejected.append(tok)
            mass += p_own[child]
        if accepted is None:  # all rejected: sample the residual and stop here
            residual = probs[v].clone()
            residual[rejected] = 0
            if residual.sum() <= 0:  # only rounding can leave nothing: fall back to p itself
                residual = probs[v]
            return path, torch.multinomial(residual, 1, generator=gen).item()
        path.append(accepted)
        v = accepted
    return path, torch.multinomial(probs[v], 1, generator=gen).item()

"""Token recycling (Luo et al., 2024, arXiv 2408.08696): a draft source built from what the model
already said. Every forward ranks the whole vocabulary after every token it verifies, and all
but the argmax is thrown away; this source keeps, for every token, the k tokens the model ranked
highest right after it the last time it saw it, accepted or not, and offers the tree they form
from the last token as candidates.

    next[a] = [b, c, ...]        the model's best tokens after `a`, best first
    next[b] = [d, e, ...]
    next[c] = [f, ...]

    last = a      template (ranks)     candidates            trie
                  (0, 0)               a b d                   a
                  (0, 1)               a b e                 /   \\
                  (1, 0)               a c f                b     c
                  ...                                      / \\     \\
                                                          d   e     f

The template is the same every step: the `nodes` most likely rank paths if a rank-r child is right
half as often as a rank-(r-1) one (a prior; the dynamic shape learns per depth and rank how often
these guesses are right, and keeps only those worth their cost). A token the model has not ranked
yet ends its path. The prefill fills the table first, from the model's ranking after every prompt
token (reading those logits costs the LM head over the prompt once).
"""
import heapq

from lookahead import Candidate, DraftSource


def rank_paths(nodes: int, k: int, depth: int) -> list[tuple]:
    """The `nodes` most likely rank paths of at most `depth` steps when a child of rank r is worth
    2^-(r+1): best first (a path before its extensions, a rank before the next)."""
    out, heap = [], [(-0.5, (0,))]
    while heap and len(out) < nodes:
        value, path = heapq.heappop(heap)
        out.append(path)
        if path[-1] + 1 < k:  # the next sibling
            heapq.heappush(heap, (value / 2, path[:-1] + (path[-1] + 1,)))
        if len(path) < depth:  # the first child
            heapq.heappush(heap, (value / 2, path + (0,)))
    return out


class TokenRecycling(DraftSource):
    """The model's recycled top-k predictions as candidates; see the module docstring."""

    def __init__(self, seq=None, k: int = 8, nodes: int = 64):
        self.top_k, self.nodes = k, nodes  # top_k: how many of the model's best tokens it reads
        self.next: dict[int, list[int]] = {}  # token -> the model's top_k after it, last time
        self.templates = {}  # depth -> its rank paths

    def propose(self, seq, k):
        paths = self.templates.setdefault(k, rank_paths(self.nodes, self.top_k, k))
        chains = {}  # rank path -> its tokens, or None where a token along it is unranked
        for path in paths:  # a path comes after its prefix
            parent = chains.get(path[:-1], ()) if len(path) > 1 else ()
            after = self.next.get(parent[-1] if parent else seq.tokens[-1], [])
            chains[path] = parent + (after[path[-1]],) if parent is not None and path[-1] < len(after) else None
        leaves = [p for p in paths if chains[p] and not chains.get(p + (0,))]  # the longest chains
        return [Candidate(chains[p], "recycling") for p in sorted(leaves)]  # rank 0 first below every node

    def observe_prefill(self, seq, top):
        for token, best in zip(seq.prompt, top):
            self.next[token] = best

    def observe(self, seq, step):
        for token, best in zip(step.tree.tokens, step.top):  # every verified row, rejected ones too
            self.next[token] = best

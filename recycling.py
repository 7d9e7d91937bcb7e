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

The template is the same every step: the 80-node tree the authors published (their repository's
tree template "2.2.2", k = 8, up to 6 deep), written below as rank paths, one line a depth. It is
wide near the root (all 8 ranks after `last`), deep along the best ranks. A step gets as much of
it as the policy expects the step to hold (seq.expected_guesses), best first: the paths that skip
the fewest ranks, shallower first (each node after its parent), so the greedy chain comes whole
before any runner-up; the dynamic shape learns per depth and rank how often these guesses are
right, and keeps only those worth their cost. A token the model has not ranked yet ends its path.

Two tokens of context pick better than one, as in the n-gram pool: the table also keeps the
ranking after every PAIR of tokens seen (next2[(z, a)], `a` right after `z`), and a node of the
tree reads the one after its parent and itself where that pair was seen, else the one after
itself alone.

The table is fed by every row a step reads: the trie's nodes, accepted or not, and, for tokens it
does not know yet, the window's newest level (a guessed context, so it never replaces a ranking
seen after a trie node); the prefill fills it first, from the model's ranking after every prompt
token (the LM head over the prompt, once).

It offers what fits at every size of step: a CPU's steps of a few guesses get the first few
paths, a GPU's wide ones the whole tree (docs/PERFORMANCE.md has the figures that chose each of
these).

Its table stays on the host, where the trie it feeds is built and verified: the rankings come
back in the step's one host sync with the argmax, and the template is walked by index (each
node's parent, rank and first child precomputed). A table on the device, each depth of the tree one
gather, would need a host sync of its own to bring the tree back, and on a CPU its gathers cost
more than the walk (docs/PERFORMANCE.md: 197 against 51 us a step for the 80 nodes).
"""
from drafts import Candidate, DraftSource, token_back

# Token Recycling's published 80-node template (Luo et al. 2024): each word a path of ranks from
# `last`, "01" = the best token's second best; a line a depth, a path after its prefix.
TEMPLATE = [tuple(int(r) for r in path) for path in """
    0 1 2 3 4 5 6 7
    00 01 02 03 04 05 06 07 10 11 12 13 20 21 22 30 31 40 50 60 70
    000 001 002 003 004 005 006 007 010 011 012 020 021 030 040 050 060 070 100 101 110 200 300 400 500
    0000 0001 0002 0003 0004 0010 0011 0020 0030 0040 0100 0200 1000 2000 3000
    00000 00001 00002 00010 00020 00100 01000 10000
    000000 000001 000100""".split()]


class TokenRecycling(DraftSource):
    """The model's recycled top-k predictions as candidates; see the module docstring."""

    wants_prompt_rankings = True  # its table starts from the prompt's

    def __init__(self, template=TEMPLATE):
        self.template = sorted(template, key=lambda path: (sum(path), len(path)))  # best first, each after its prefix
        # The template as indices (propose walks it every step): each node's parent (-1: `last`),
        # rank and first child (len: none), and the nodes in rank-path order.
        index = {path: i for i, path in enumerate(self.template)}
        self.parent = [index[path[:-1]] if len(path) > 1 else -1 for path in self.template]
        self.rank = [path[-1] for path in self.template]
        self.first_child = [index.get(path + (0,), len(index)) for path in self.template]
        self.in_path_order = sorted(range(len(index)), key=lambda i: self.template[i])
        self.rankings = 1 + max(max(path) for path in template)  # how many of the model's best it reads
        self.next: dict[int, list[int]] = {}  # token -> the model's best after it, last time
        self.next2: dict[tuple, list[int]] = {}  # (token, token after it) -> the same after the pair

    def remember(self, memory):
        self.next = self.next2 = memory.rankings  # one table, keyed by a token or a pair (drafts.Memory)

    def after(self, before, token) -> list[int]:
        """The model's last ranking after `token` (seen right after `before` if it can be had)."""
        ranked = self.next2.get((before, token))
        return self.next.get(token, []) if ranked is None else ranked

    def wants_rankings(self, expected_guesses):
        return expected_guesses > 0

    def propose(self, seq, k):
        n = min(seq.expected_guesses, len(self.template))  # the best n paths: what the step may hold
        context = (token_back(seq, 2), seq.tokens[-1])  # the pair ending in `last`
        chains = [None] * n  # each path's tokens; None where a token along it is unranked, or past k
        ranked_after = {}  # node -> the ranking after it (siblings share it)
        for i in range(n):  # a path comes after its parent
            p = self.parent[i]
            chain = () if p < 0 else chains[p]
            if chain is None or len(chain) == k:
                continue
            ranked = ranked_after.get(p)
            if ranked is None:
                ranked = ranked_after[p] = self.after(*(context + chain)[-2:])
            if self.rank[i] < len(ranked):
                chains[i] = chain + (ranked[self.rank[i]],)
        # The leaves (no child 0 among the chains: a child's elder siblings are in), rank 0 first
        # below every node.
        return [Candidate(chains[i], "recycling") for i in self.in_path_order
                if i < n and chains[i] and (self.first_child[i] >= n or chains[self.first_child[i]] is None)]

    def observe_prefill(self, seq, top):
        for i, (token, best) in enumerate(zip(seq.prompt, top)):
            self.next[token] = best
            if i:
                self.next2[seq.prompt[i - 1], token] = best

    def observe(self, seq, step):
        if step.rankings is None or not self.wants_rankings(seq.expected_guesses):
            return  # the prefill's first token (no rankings), or idle
        tree, n = step.tree, len(step.tree)
        before_last = token_back(seq, len(step.committed) + 2)  # `last` came before what the step committed
        for v, (token, best) in enumerate(zip(tree.tokens, step.rankings)):  # every guess, accepted or rejected
            self.next[token] = best
            self.next2[before_last if v == 0 else tree.tokens[tree.parent[v]], token] = best
        newest = step.window[-1] if step.window else []  # the rest of what the step read (the trie, then this)
        for token, best in zip(newest, step.rankings[n:]):  # the window's: where nothing else is known
            if token not in self.next:
                self.next[token] = best

"""A suffix source, after SuffixDecoding (Oliaro et al., 2024, arXiv 2411.04975): find the longest
suffix of the text that occurred before, and guess what followed it there.

    text so far   ... the hash table stores keys . A hash table maps | keys
    index         ("hash", "table") -> {"stores": 1, "maps": 1}, ("table",) -> {...}, ...
    last two      "hash table" occurred before: its continuations, ranked, are the guesses

Every context of 1 to `longest` tokens that ends before a token of the text maps to the tokens
seen right after it, each with its count and when it was last seen. A step's guesses: the
longest context ending in `last` that was seen before, then its `branches` best continuations
(by count, then recency), each extended by the same rule one token at a time (the longest
context ending in the chain so far), up to four times as deep as the match is long plus four,
at most `depth`: a long match is likelier to go on. Along the best chain each token's runner-up
is offered too, after the chains: the guesses form a tree. Their labels say the match length
(suffix1, suffix2, suffix3 for 3 to 5, suffix6 for 6 or more), so the dynamic shape learns each
one's chance apart, and each states its prior (MATCH_PRIORS).

The index holds the prompt and every committed token (observe: O(new tokens x longest) a step).
Contexts of up to 8 tokens (`longest`): on Spec-Bench (1 a category, 64 tokens) 8, 16 and 32
tested and accepted the very same guesses (4 and 6 accepted fewer), and 8 costs the host about
two thirds of 16's time (docs/PERFORMANCE.md).
With a Memory it lives in the memory's table for this source, so later requests find what
earlier ones said (SuffixDecoding's global tree); without, each row keeps its own.
"""
from drafts import Candidate, DraftSource

MOST_AFTER = 8  # continuations kept per context: the least counted goes first
# A chain's label and priors by the length of the match it starts from (at least 6, 3, 2, 1):
# the chance of its first guess, and (None: the same) of each later one once the one before it
# was right. The longer the match, the likelier its text goes on, and a chain from a long match
# that was right tends to stay right (docs/PERFORMANCE.md: the rates seen on Spec-Bench).
MATCH_PRIORS = ((6, "suffix6", 0.75, 0.95), (3, "suffix3", 0.5, None), (2, "suffix2", 0.3, None),
                (1, "suffix1", 0.2, None))


class SuffixSource(DraftSource):
    def __init__(self, longest: int = 8, branches: int = 3, depth: int = 32):
        if longest < 1 or branches < 1 or depth < 1:
            raise ValueError(f"SuffixSource needs longest, branches and depth >= 1 (got {longest}, {branches}, {depth})")
        self.longest, self.branches, self.depth = longest, branches, depth
        self.index: dict = {}  # context tuple -> {next token: [count, clock when last seen]}
        self.clock = 0  # tokens indexed so far (recency)
        self.indexed = None  # this row's tokens indexed so far (None: not even its prompt)

    def remember(self, memory):
        self.index = memory.table(self)  # shared with the requests that pass the same Memory

    def observe(self, seq, step):
        """Index what the step committed (the prompt too, the first time)."""
        if self.indexed is None:
            text, new = seq.prompt + seq.tokens, len(seq.prompt) + len(seq.tokens) - 1
        else:
            new = len(seq.tokens) - self.indexed
            k = new + self.longest
            text = seq.tokens[-k:] if len(seq.tokens) >= k else seq.prompt[len(seq.tokens) - k:] + seq.tokens
        self.indexed = len(seq.tokens)
        self.add(text, new)

    def add(self, text, new: int):
        """Index each of the last `new` tokens of `text` after every context ending before it."""
        index, longest = self.index, self.longest
        for i in range(len(text) - new, len(text)):
            token = text[i]
            self.clock += 1
            for d in range(1, min(longest, i) + 1):
                key = tuple(text[i - d:i])
                after = index.get(key)  # read: a Memory's table keeps it (drafts.Recent)
                if after is None:
                    after = index[key] = {}
                seen = after.get(token)
                if seen is None:
                    if len(after) >= MOST_AFTER:
                        del after[min(after, key=lambda t: after[t])]
                    after[token] = [1, self.clock]
                else:
                    seen[0] += 1
                    seen[1] = self.clock

    def match(self, context: list, most: int):
        """The longest suffix of `context` (at most `most` tokens) seen before: (its length, what
        followed it), or (0, None)."""
        for d in range(min(most, len(context)), 0, -1):
            after = self.index.get(tuple(context[-d:]))
            if after:
                return d, after
        return 0, None

    def propose(self, seq, k):
        context = seq.tokens[-self.longest:]
        if len(context) < self.longest:
            context = seq.prompt[len(context) - self.longest:] + context
        length, after = self.match(context, self.longest)
        if not length:
            return []
        depth = min(k, self.depth, 4 * length + 4)
        ranked = sorted(after, key=lambda t: after[t], reverse=True)[:self.branches]  # by count, then recency
        _, label, prior, prior_next = next(m for m in MATCH_PRIORS if length >= m[0])
        out, forks = [], []
        for rank, first in enumerate(ranked):
            chain, ctx, d = [first], context + [first], length
            while len(chain) < depth:
                d, next_after = self.match(ctx, min(self.longest, d + 1))
                if not d:
                    break
                best = sorted(next_after, key=lambda t: next_after[t], reverse=True)[:2]
                if rank == 0 and len(best) > 1:  # the best chain's runners-up: a tree, not one line
                    forks.append(tuple(chain) + (best[1],))
                chain.append(best[0])
                ctx.append(best[0])
            out.append(Candidate(tuple(chain), label, prior=prior, prior_next=prior_next))
        return out + [Candidate(fork, label, prior=prior, prior_next=prior_next) for fork in forks]

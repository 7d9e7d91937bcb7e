"""A suffix source, after SuffixDecoding (Oliaro et al., 2024, arXiv 2411.04975): find the longest
suffix of the text that occurred before, and guess what followed it there.

    text so far   ... the hash table stores keys . A hash table maps | keys
    contexts      "hash table" -> {"stores": 1, "maps": 1}, "table" -> {...}, ...
    last two      "hash table" occurred before: its continuations, ranked, are the guesses

Every context of 1 to `longest` tokens that ends before a token of the text counts the tokens
seen right after it, each with its count and when it was last seen. A step's guesses: the
longest context ending in `last` that was seen before, then its `branches` best continuations
(by count, then recency), each extended by the same rule one token at a time (the longest
context ending in the chain so far), up to four times as deep as the match is long plus four,
at most `depth`: a long match is likelier to go on. Along the best chain each token's runner-up
is offered too, after the chains: the guesses form a tree. Their labels say the match length
(suffix1, suffix2, suffix3 for 3 to 5, suffix6 for 6 or more), so the dynamic shape learns each
one's chance apart, and each states its prior (MATCH_PRIORS).

The contexts live in a suffix automaton (SuffixAutomaton): contexts that occurred at exactly the
same places share one state and so one table of what followed them, and a committed token
updates only the states its contexts fall in, a few where the text is new, whatever `longest`
is. Contexts of up to 8 tokens (`longest`): on Spec-Bench (1 a category, 64 tokens) 8, 16 and 32
tested and accepted the very same guesses (4 and 6 accepted fewer) (docs/PERFORMANCE.md).
With a Memory the automaton lives in the memory's table for this source, so later requests find
what earlier ones said (SuffixDecoding's global tree); without, each row keeps its own.
"""
from drafts import Candidate, DraftSource

MOST_AFTER = 8  # continuations kept per context: the least counted goes first
# A chain's label and priors by the length of the match it starts from (at least 6, 3, 2, 1):
# the chance of its first guess, and (None: the same) of each later one once the one before it
# was right. The longer the match, the likelier its text goes on, and a chain from a long match
# that was right tends to stay right (docs/PERFORMANCE.md: the rates seen on Spec-Bench).
MATCH_PRIORS = ((6, "suffix6", 0.75, 0.95), (3, "suffix3", 0.5, None), (2, "suffix2", 0.3, None),
                (1, "suffix1", 0.2, None))


class SuffixAutomaton:
    """Every text added, as a suffix automaton (Blumer et al., 1985): state v stands for the
    strings that end at exactly the same places of the texts, of lengths length[link[v]] + 1 to
    length[v]; link[v] is the state of the longest suffix that ends in more places, next[v] the
    states one token on. State 0 is the empty string.

        text "a b a b", longest 2     state  strings         link  after: {token: count}
                                        1    a                0    {b: 2}
                                        2    a b, b           0    {a: 1}
                                        3    a b a, b a       1    {b: 1}  (as "b a")
                                        4    a b a b, b a b   2    None: all past `longest`

    after[v] is what followed those strings, {token: [count, clock when last seen]}, at most
    MOST_AFTER; kept for the states with a string of at most `longest` tokens, one table for
    all of a state's strings, since they occurred in the same places. A token added costs
    amortised O(1) states made and one table updated per state its contexts fall in (a few
    where the text is new, at most `longest`). The texts of several rows and requests may grow
    in one automaton, each from its own state. At most `most_states` states (None: no bound):
    an addition that would pass it empties the automaton first (epoch + 1), and a text whose
    epoch is older starts again from its last `longest` tokens (SuffixSource.observe).

    Everything it holds is in `data`, a dict of ints and lists (a Memory's table can keep and
    save it)."""

    def __init__(self, longest: int, most_states: int | None = None, data: dict | None = None):
        self.longest, self.most_states = longest, most_states
        self.data = data if data else dict(epoch=0, clock=0, length=[0], link=[-1], next=[{}], after=[None])
        self.length, self.link, self.next, self.after = (self.data[k] for k in ("length", "link", "next", "after"))

    @property
    def epoch(self) -> int:
        return self.data["epoch"]

    def make_room(self, tokens: int) -> int:
        """Room for `tokens` more (2 states a token at most), emptied first where needed ->
        how many tokens one text may add now."""
        if self.most_states is None:
            return tokens
        if len(self.length) + 2 * tokens > self.most_states:
            self.data["epoch"] += 1
            self.length[:], self.link[:], self.next[:], self.after[:] = [0], [-1], [{}], [None]
        return min(tokens, (self.most_states - len(self.length)) // 2)

    def add(self, state: int, tokens) -> int:
        """Append `tokens` to the text whose state is `state` (0: a new text) -> its new state."""
        for token in tokens:
            self.data["clock"] += 1
            self.count(state, token)
            state = self.extend(state, token)
        return state

    def count(self, state: int, token: int):
        """`token` followed the text of `state`: every context of it (a suffix of at most
        `longest` tokens) counts it, one state at a time along the suffix links."""
        length, link, after, clock = self.length, self.link, self.after, self.data["clock"]
        while state > 0 and length[link[state]] >= self.longest:  # strings all longer than a context
            state = link[state]
        while state > 0:
            table = after[state]
            seen = table.get(token)
            if seen is None:
                if len(table) >= MOST_AFTER:
                    del table[min(table, key=lambda t: table[t])]
                table[token] = [1, clock]
            else:
                seen[0] += 1
                seen[1] = clock
            state = link[state]

    def extend(self, p: int, token: int) -> int:
        """The state of p's text + token (the online construction; where that text is already a
        state's longest string, another row's or request's, it is that state)."""
        length, link, next_ = self.length, self.link, self.next
        q = next_[p].get(token)
        if q is not None:  # seen from here before: that state, or its part this text ends in
            return q if length[q] == length[p] + 1 else self.split(p, q, token)
        new = len(length)
        length.append(length[p] + 1), link.append(0), next_.append({}), self.after.append(None)
        while p != -1 and token not in next_[p]:
            next_[p][token] = new
            p = link[p]
        if p != -1:
            q = next_[p][token]
            link[new] = q if length[p] + 1 == length[q] else self.split(p, q, token)
        if length[link[new]] < self.longest:
            self.after[new] = {}
        return new

    def split(self, p: int, q: int, token: int) -> int:
        """Part q: its strings of at most length[p] + 1 tokens now end in one more place, so they
        move to a new state (what followed them so far, copied) that q links to."""
        length, link, next_ = self.length, self.link, self.next
        part = len(length)
        after = self.after[q]
        length.append(length[p] + 1), link.append(link[q]), next_.append(dict(next_[q]))
        self.after.append(None if after is None else {t: seen[:] for t, seen in after.items()})
        while p != -1 and next_[p].get(token) == q:
            next_[p][token] = part
            p = link[p]
        link[q] = part
        return part

    def longest_seen(self, state: int, most: int) -> tuple[int, int]:
        """The longest suffix (at most `most` tokens) of the text of `state` that was seen
        followed by a token: (its length, its state), or (0, 0)."""
        length, link, after = self.length, self.link, self.after
        while state > 0:
            if length[link[state]] < most and after[state]:
                return min(length[state], most), state
            state = link[state]
        return 0, 0

    def step(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """The longest suffix, seen followed by a token, of the `matched` tokens at `state` plus
        `token`, at most one token longer and at most `longest`: (its length, its state), or (0, 0)."""
        length, link, next_ = self.length, self.link, self.next
        while token not in next_[state]:
            if state == 0:
                return 0, 0
            state = link[state]
            matched = length[state]
        return self.longest_seen(next_[state][token], min(matched + 1, self.longest))


class SuffixSource(DraftSource):
    def __init__(self, longest: int = 8, branches: int = 3, depth: int = 32):
        if longest < 1 or branches < 1 or depth < 1:
            raise ValueError(f"SuffixSource needs longest, branches and depth >= 1 (got {longest}, {branches}, {depth})")
        self.longest, self.branches, self.depth = longest, branches, depth
        self.automaton = SuffixAutomaton(longest)
        self.state, self.epoch = 0, None  # this row's text in the automaton (epoch None: not added yet)
        self.indexed = 0  # this row's tokens added so far

    def remember(self, memory):
        """Keep the automaton in the memory's table for this source (at most memory.keys states)."""
        table = memory.table(self)
        data = table.get("automaton")
        self.automaton = SuffixAutomaton(self.longest, max(memory.keys, 1), data)
        table["automaton"] = self.automaton.data

    def observe(self, seq, step):
        """Add what the step committed to the automaton (the prompt too, the first time)."""
        automaton, new = self.automaton, len(seq.tokens) - self.indexed
        if self.epoch is None:
            new += len(seq.prompt)
        room = automaton.make_room(new + self.longest)
        if self.epoch != automaton.epoch:  # the first time, or emptied since: a new text
            self.state, self.epoch = 0, automaton.epoch
            new = min(len(seq.prompt) + len(seq.tokens), new + self.longest, room)
        text = seq.tokens[-new:] if len(seq.tokens) >= new else seq.prompt[len(seq.tokens) - new:] + seq.tokens
        self.state = automaton.add(self.state, text)
        self.indexed = len(seq.tokens)

    def propose(self, seq, k):
        automaton = self.automaton
        if self.epoch != automaton.epoch:
            return []  # emptied since this row's last step: nothing of its text in it yet
        length, state = automaton.longest_seen(self.state, self.longest)
        if not length:
            return []
        depth, after = min(k, self.depth, 4 * length + 4), automaton.after
        ranked = sorted(after[state], key=after[state].get, reverse=True)[:self.branches]  # by count, then recency
        _, label, prior, prior_next = next(m for m in MATCH_PRIORS if length >= m[0])
        out, forks = [], []
        for rank, first in enumerate(ranked):
            chain, d, at = [first], length, state
            while len(chain) < depth:
                d, at = automaton.step(at, d, chain[-1])
                if not d:
                    break
                best = sorted(after[at], key=after[at].get, reverse=True)[:2]
                if rank == 0 and len(best) > 1:  # the best chain's runners-up: a tree, not one line
                    forks.append(tuple(chain) + (best[1],))
                chain.append(best[0])
            out.append(Candidate(tuple(chain), label, prior=prior, prior_next=prior_next))
        return out + [Candidate(fork, label, prior=prior, prior_next=prior_next) for fork in forks]

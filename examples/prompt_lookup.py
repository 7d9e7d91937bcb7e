"""Prompt lookup decoding (Saxena 2023; transformers' `prompt_lookup_num_tokens`) as a draft
source: where the last few tokens occurred before, in the prompt or in the output so far, guess
that what followed them then follows them now. Only the public contract (drafts.py) is used:

    python lookahead.py --drafts pool,examples/prompt_lookup.py:PromptLookup,jacobi --prompt ...
"""
from drafts import Candidate, DraftSource


class PromptLookup(DraftSource):
    """The continuation after the latest earlier occurrence of the last `max_ngram` tokens (else
    of fewer), at most `max_guesses` long. An index from every n-gram of the text (n <= max_ngram)
    to where it last ended keeps a lookup O(1); it follows the text as it grows."""

    def __init__(self, max_ngram: int = 3, max_guesses: int = 10):
        self.max_ngram, self.max_guesses = max_ngram, max_guesses
        self.indexed = 0  # positions of prompt + tokens indexed so far
        self.ends: dict[tuple, int] = {}  # n-gram -> the position right after its latest occurrence

    def propose(self, seq, k):
        text = seq.prompt + seq.tokens
        for end in range(self.indexed, len(text)):  # an occurrence that something follows
            for n in range(1, min(self.max_ngram, end) + 1):
                self.ends[tuple(text[end - n:end])] = end
        self.indexed = len(text)
        for n in range(min(self.max_ngram, len(text)), 0, -1):
            end = self.ends.get(tuple(text[-n:]))
            if end is not None:
                return [Candidate(tuple(text[end:end + min(k, self.max_guesses)]), f"lookup{n}")]
        return []

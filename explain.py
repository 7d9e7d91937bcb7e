"""--explain: what one lookahead step did, in the words of lookahead.py's glossary.

For a step's record (lookahead.StepRecord) it prints the window's levels (and the level the model predicted
now), the n-grams the window completed for the pool, the trie of candidates with each guess
marked accepted, rejected (and what the model said instead) or not reached, and what was
committed. The README's worked step is this printer's output on SmolLM2.
"""

MAX_NODES = 40  # a trie printed whole up to this many guesses (a dynamic step's can hold 128)


def explain_step(number: int, step, piece) -> str:
    """The text for step `number` (from 1) of one row; piece(token id) -> its text as shown."""
    tree, w = step.tree, step.columns
    show = lambda ids: " ".join(piece(t) for t in ids)
    lines = [f"step {number}: last token {piece(tree.tokens[0])}; one forward of {len(tree) + w * len(step.window)} "
             f"tokens: `last`, {plural(len(tree) - 1, 'guess')} in the trie, a window of {w} columns x "
             f"{plural(len(step.window), 'level')}"]
    if step.window:
        lines.append("  window: column j's level l+1 is what the model predicted a step ago after its level l")
        lines += [f"    level {level}: {show(tokens)}" for level, tokens in enumerate(step.window)]
        lines.append(f"    predicted now (the next level): {show(step.pred[len(tree):len(tree) + w])}")
        if step.pooled:
            lines.append("  pooled: the window is full, so each column plus its prediction is an n-gram:")
            lines += [f"    {show(ngram)}" for ngram in step.pooled]
        else:
            lines.append("  pooled: nothing yet (the window gains a level a step until it holds N-1)")
    lines.append(f"  trie: {plural(len(tree.candidates), 'candidate')} starting with {piece(tree.tokens[0])}, merged "
                 "(+ accepted, x rejected, . not reached)")
    lines += trie_lines(step, piece) or ["    (no candidates: the pool holds no n-gram that starts with `last`)"]
    accepted = [tree.tokens[v] for v in step.path]
    lines.append(f"  verified: {plural(len(accepted), 'guess')} accepted"
                 + (f" ({show(accepted)})" if accepted else "")
                 + f", then the model's own next token: committed {len(step.committed)}: {show(step.committed)}")
    return "\n".join(lines)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"


def trie_lines(step, piece) -> list[str]:
    """The trie depth first, a node a line: its token, the candidate's source at the top, and
    whether verification accepted it (the model predicted it after its parent)."""
    tree, on_path, lines = step.tree, set(step.path), []
    stack = list(reversed(tree.children[0].values()))
    while stack and len(lines) < MAX_NODES:
        v = stack.pop()
        parent = tree.parent[v]
        if v in on_path:
            mark = "+"
        elif parent == 0 or parent in on_path:  # tested: the model's prediction after the parent
            mark = f"x  the model said {piece(step.pred[parent])}"
        else:
            mark = "."
        candidate = tree.candidates[tree.origin[v]]
        source = f"  [{candidate.source}{', made by the window' if candidate.from_window else ''}]" if parent == 0 else ""
        lines.append(f"    {'  ' * tree.depth[v]}{piece(tree.tokens[v])} {mark}{source}")
        stack += reversed(tree.children[v].values())
    if len(tree) - 1 > len(lines):
        lines.append(f"    ... {len(tree) - 1 - len(lines)} more guesses")
    return lines

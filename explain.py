"""--explain: what one lookahead step did, in the words of lookahead.py's glossary.

For a step of the reference (lookahead.StepRecord) it prints the window's levels (and the level
the model predicted now), the n-grams the window completed for the pool, the trie of
candidates with each guess marked accepted, rejected (and what the model said instead) or not
reached, the step's positions and mask as lookahead.step_mask builds them, what was committed,
and the roll back: the cache moves (lookahead.rollback_moves) and C before and after. The
README's worked step is this printer's output on SmolLM2.

Which candidates the window made is the printer's own record (Explainer): the n-grams the
window completed in the steps before, each one printed where a candidate is one of them.
"""
from lookahead import rollback_moves, step_mask

MAX_NODES = 40  # a trie printed whole up to this many guesses
MAX_GRID = 40  # a mask printed as a grid up to this many tokens a side


class Explainer:
    """Explains a run's steps in order (explain_step), remembering the n-grams the window
    completed so far, to mark the candidates it made."""

    def __init__(self, piece):
        self.piece, self.number, self.window_made = piece, 0, set()

    def __call__(self, step) -> str:
        self.number += 1
        text = explain_step(self.number, step, self.piece, self.window_made)
        self.window_made.update(tuple(ngram) for ngram in step.pooled)
        return text


def explain_step(number: int, step, piece, window_made=frozenset()) -> str:
    """The text for step `number` (from 1) of one row; piece(token id) -> its text as shown;
    window_made: the n-grams the window completed before this step."""
    tree, levels = step.tree, step.window
    w = len(levels[0]) if levels else 0
    show = lambda ids: " ".join(piece(t) for t in ids)
    lines = [f"step {number}: last token {piece(tree.tokens[0])}; one forward of {len(tree) + w * len(levels)} "
             f"tokens: `last`, {plural(len(tree) - 1, 'guess')} in the trie, a window of {w} columns x "
             f"{plural(len(levels), 'level')}"]
    if levels:
        lines.append("  window: column j's level l+1 is what the model predicted a step ago after its level l")
        lines += [f"    level {level}: {show(tokens)}" for level, tokens in enumerate(levels)]
        lines.append(f"    predicted now (the next level): {show(step.pred[len(tree):len(tree) + w])}")
        if step.pooled:
            lines.append("  pooled: the window is full, so each column plus its prediction is an n-gram:")
            lines += [f"    {show(ngram)}" for ngram in step.pooled]
        else:
            lines.append("  pooled: nothing yet (the window gains a level a step until it holds N-1)")
    candidates = sum(not children for children in tree.children[1:])  # a candidate ends in a leaf
    lines.append(f"  trie: {plural(candidates, 'candidate')} starting with {piece(tree.tokens[0])}, merged "
                 "(+ accepted, x rejected, . not reached)")
    lines += trie_lines(step, piece, window_made) or [
        "    (no candidates: the pool holds no n-gram that starts with `last`)"]
    lines += mask_lines(step, piece)
    accepted = [tree.tokens[v] for v in step.path]
    lines.append(f"  verified: {plural(len(accepted), 'guess')} accepted"
                 + (f" ({show(accepted)})" if accepted else "")
                 + f", then the model's own next token: committed {len(step.committed)}: {show(step.committed)}")
    lines += rollback_lines(step)
    return "\n".join(lines)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"


def trie_lines(step, piece, window_made) -> list[str]:
    """The trie depth first, a node a line: its token, and whether verification accepted it
    (the model predicted it after its parent); a leaf whose chain is the rest of an n-gram the
    window completed is marked so."""
    tree, on_path, lines = step.tree, set(step.path), []
    chain = lambda v: (tree.tokens[v],) if v == 0 else chain(tree.parent[v]) + (tree.tokens[v],)
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
        made = "  [the window's n-gram]" if not tree.children[v] and chain(v) in window_made else ""
        lines.append(f"    {'  ' * tree.depth[v]}{piece(tree.tokens[v])} {mark}{made}")
        stack += reversed(tree.children[v].values())
    if len(tree) - 1 > len(lines):
        lines.append(f"    ... {len(tree) - 1 - len(lines)} more guesses")
    return lines


def mask_lines(step, piece) -> list[str]:
    """The step's tokens as they ran: each one's name, token and position (C + its offset), and
    its row of lookahead.step_mask, x where it may attend (every token also sees the C
    committed slots): the trie's guesses are named by node (g1, g2, ...), the window's tokens
    by level and column (a0, a1, ... for level 0, b0, ... for level 1)."""
    tree, levels = step.tree, step.window
    W, L, n = (len(levels[0]) if levels else 0), len(levels), len(step.tree)
    mask, offsets = step_mask(tree, W, L)
    T = n + W * L
    names = ["last"] + [f"g{v}" for v in range(1, n)] + [f"{chr(97 + l)}{j}" for l in range(L) for j in range(W)]
    tokens = tree.tokens + [t for level in levels for t in level]
    lines = [f"  inputs: {T} tokens at positions C + offset, C = {step.C} (`last`'s slot and position)"]
    if T > MAX_GRID:
        return lines + [f"    (a mask of {T} x {T}: printed up to {MAX_GRID} tokens a side)"]
    width = max(len(piece(t)) for t in tokens)
    lines.append("  mask: row q may attend to column k where x; columns in the rows' order"
                 + (", | between the trie and the window" if W else ""))
    for q in range(T):
        cells = "".join(("x" if mask[q, k] else ".") + (" |" if k == n - 1 and W else "") for k in range(T))
        lines.append(f"    {names[q]:>4} {piece(tokens[q]):<{width}}  C+{offsets[q]:<2} {cells}")
    return lines


def rollback_lines(step) -> list[str]:
    """What the roll back keeps: the accepted guesses' K/V moved next to `last`'s
    (lookahead.rollback_moves), C before and after."""
    C, path = step.C, step.path
    moves = rollback_moves(C, path)
    kept = ", ".join(f"g{v} in slot {C + v}" for v in path) or "none"
    moved = ", ".join(f"{a} -> {b}" for a, b in moves) or "none: the accepted ones are in place already"
    return [f"  roll back: the step wrote K/V in slots {C}..{C + len(step.tree) + sum(map(len, step.window)) - 1};"
            f" kept: `last` in {C}, {kept}; moved: {moved}; C {C} -> {C + 1 + len(path)}"]

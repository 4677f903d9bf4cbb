"""A depth-bounded suffix trie with frequency counts, in pure Python, for suffix decoding.

Every substring of length <= max_depth of the indexed token sequences is a path from the
root; a node's `count` is how many times its path occurs, `cont` how many of those
occurrences have a next token (the sum of its children's counts), so `child.count / cont` is
the empirical probability of that continuation.

Memory: a plain trie would hold max_depth nodes per token. Here a path that occurs once is
one *compressed* node (`pos >= 0`): it stands for its whole single-occurrence tail, read from
the sequence it came from (`seq[pos + 1:]`, up to max_depth). A second occurrence splits it
one level at a time, so the trie holds about one branching node per token, and appending a
token to a sequence costs one step per active suffix (at most max_depth - 1), most of them
no-ops inside their own compressed tail.

Cursors: each indexed sequence keeps, per suffix start s that is still shorter than
max_depth, the node its path reached (`(node, s)`). A cursor may point at a compressed
node that was split since; `_resolve` walks it down to its exact depth by reading the
sequence, which is what keeps appends O(max_depth) without suffix links.
"""

from __future__ import annotations

from collections.abc import Sequence


class Node:
    """A trie node (see the module docstring); `tok` is the token on the edge into it."""

    __slots__ = ("count", "cont", "depth", "tok", "children", "best", "seq", "pos")

    def __init__(self, depth: int, tok: int, seq: list[int] | None = None, pos: int = -1) -> None:
        self.count = 1 if seq is not None else 0
        self.cont = 0
        self.depth = depth
        self.tok = tok
        self.children: dict[int, Node] | None = None if seq is not None else {}
        self.best: Node | None = None  # the child with the highest count (None: recompute)
        self.seq = seq  # compressed nodes: the sequence holding their tail
        self.pos = pos  # compressed nodes: index of their own token in seq; -1 otherwise


Cursor = tuple[Node, int]  # (node reached, suffix start in the sequence)


class SuffixTrie:
    """One trie: per-request (its prompt and output) or global (recent outputs)."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = Node(0, -1)

    # ---- indexing ---------------------------------------------------------------------

    def append(self, active: list[Cursor], seq: list[int], p: int) -> list[Cursor]:
        """seq[p] was just appended to seq: every active suffix grows by it and a new suffix
        starts at p. Returns the cursors still shorter than max_depth (oldest first)."""
        t, top = seq[p], self.max_depth
        out: list[Cursor] = []
        for node, s in (*active, (self.root, p)):
            depth = p - s
            node = self._resolve(node, s, depth, seq)
            if node.pos < 0:  # exactly at depth: step into the child for t
                children = node.children
                child = children.get(t)
                node.cont += 1
                if child is None:
                    child = children[t] = Node(depth + 1, t, seq, p)
                else:
                    if child.pos >= 0:
                        self._split(child)
                    child.count += 1
                best = node.best
                if best is None or child.count >= best.count:
                    node.best = child  # ties go to the most recent
                node = child
            # else: inside its own compressed tail, which now reaches seq[p] by itself
            if depth + 1 < top:
                out.append((node, s))
        return out

    def _resolve(self, node: Node, s: int, depth: int, seq: Sequence[int]) -> Node:
        """The node of seq[s:s+depth], or the compressed node whose tail holds it."""
        while node.pos < 0 and node.depth < depth:
            node = node.children[seq[s + node.depth]]
        return node

    def _split(self, node: Node) -> None:
        """Turns a compressed node into a branching one with its tail's first step as a child."""
        seq, q = node.seq, node.pos
        node.children = {}
        node.cont = 0
        node.best = None
        if node.depth < self.max_depth and q + 1 < len(seq):
            child = Node(node.depth + 1, seq[q + 1], seq, q + 1)
            node.children[child.tok] = child
            node.cont = 1
            node.best = child
        node.seq, node.pos = None, -1

    def insert(self, seq: list[int]) -> None:
        """Indexes a whole sequence (a global-corpus document); seq must not change after."""
        active: list[Cursor] = []
        for p in range(len(seq)):
            active = self.append(active, seq, p)

    def remove(self, seq: list[int]) -> None:
        """Un-indexes a sequence `insert` indexed: every count it added is taken back and
        nodes left with no occurrence are dropped (with them every node that read seq)."""
        root, top = self.root, self.max_depth
        for s in range(len(seq)):
            parent = root
            for i in range(s, min(len(seq), s + top)):
                child = parent.children[seq[i]]
                parent.cont -= 1
                child.count -= 1
                if parent.best is child:
                    parent.best = None
                if child.count == 0:
                    del parent.children[seq[i]]
                    break
                parent = child

    # ---- reading ----------------------------------------------------------------------

    def walk(self, seq: Sequence[int], start: int, end: int) -> tuple[Node, int] | None:
        """Where seq[start:end] ends in the trie: (node, tail tokens consumed past it, > 0
        only inside a compressed node), or None when it does not occur."""
        node, i = self.root, start
        while i < end:
            if node.pos >= 0:
                n, q = end - i, node.pos + 1
                tail = node.seq
                if node.depth + n > self.max_depth or tail[q : q + n] != list(seq[i:end]):
                    return None
                return node, n
            node = node.children.get(seq[i])
            if node is None:
                return None
            i += 1
        return node, 0

    def draft(self, node: Node, extra: int, limit: int, min_prob: float) -> tuple[list[int], float, list[int] | None]:
        """The most frequent continuation from a position, up to `limit` tokens, stopping
        where the path's probability (product of child.count / cont) falls below min_prob.
        Returns the tokens, their score (the sum of each token's path probability) and the
        sequence whose single-occurrence tail it read (None if it read none)."""
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit:
            if node.pos >= 0:  # one occurrence: its tail, probability unchanged
                seq, start = node.seq, node.pos + 1 + extra
                n = min(limit - len(out), self.max_depth - node.depth - extra, len(seq) - start)
                if n > 0:
                    out.extend(seq[start : start + n])
                    score += n * prob
                    return out, score, seq
                break
            if node.cont <= 0:
                break
            best = node.best
            if best is None:
                best = node.best = max(node.children.values(), key=_count)
            prob *= best.count / node.cont
            if prob < min_prob:
                break
            out.append(best.tok)
            score += prob
            node, extra = best, 0
        return out, score, None

    def resolve_cursor(self, active: list[Cursor], i: int, seq: Sequence[int], length: int) -> Node:
        """The node of active[i]'s whole suffix (seq[s:length]), stored back resolved."""
        node, s = active[i]
        node = self._resolve(node, s, length - s, seq)
        active[i] = (node, s)
        return node


def _count(node: Node) -> int:
    return node.count

"""A depth-bounded suffix trie with frequency counts, in pure Python, for suffix decoding.

Every substring of length <= max_depth of the indexed token sequences is a path from the
root; a node's `count` is how many times its path occurs, `cont` how many of those
occurrences have a next token (the sum of its children's counts), so `count[child] / cont`
is the empirical probability of that continuation.

Memory: a plain trie would hold max_depth nodes per token. Here a path that occurs once is
one *compressed* node (`pos >= 0`): it stands for its whole single-occurrence tail, read from
the sequence it came from (`src[node][pos + 1:]`, up to max_depth). A second occurrence
splits it one level at a time, so the trie holds about two nodes per token of text, and
appending a token costs one step per active suffix (at most max_depth - 1), most of them
no-ops inside their own compressed tail.

Nodes are integer ids into parallel lists, children are int -> int dicts: no per-node Python
object, so a trie of a 16K-token prompt is a few lists the garbage collector does not have
to walk node by node (with one object per node, CPython's collector doubled the indexing time).

Cursors: each indexed sequence keeps, per suffix start s that is still shorter than
max_depth, the node its path reached (a list, oldest start first). A cursor may point at a
compressed node that was split since; `_resolve` walks it down to its exact depth by reading
the sequence, which is what keeps appends O(max_depth) without suffix links.
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT = 0


class SuffixTrie:
    """One trie: per-request (its prompt and output) or global (recent outputs)."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.count = [0]
        self.cont = [0]
        self.depth = [0]
        self.tok = [-1]  # the token on the edge into the node
        self.kids: list[dict[int, int] | None] = [{}]  # None for compressed nodes
        self.best = [-1]  # the child with the highest count (-1: recompute)
        self.src: list[list[int] | None] = [None]  # compressed nodes: the sequence of their tail
        self.pos = [-1]  # compressed nodes: index of their own token in src; -1 otherwise
        self._free: list[int] = []

    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self._free)

    def _new(self, depth: int, tok: int, seq: list[int], pos: int) -> int:
        """A compressed node: one occurrence, its token at seq[pos]."""
        if self._free:
            i = self._free.pop()
            self.count[i], self.cont[i], self.depth[i], self.tok[i] = 1, 0, depth, tok
            self.kids[i], self.best[i], self.src[i], self.pos[i] = None, -1, seq, pos
            return i
        self.count.append(1)
        self.cont.append(0)
        self.depth.append(depth)
        self.tok.append(tok)
        self.kids.append(None)
        self.best.append(-1)
        self.src.append(seq)
        self.pos.append(pos)
        return len(self.count) - 1

    # ---- indexing ---------------------------------------------------------------------

    def append(self, active: list[int], seq: list[int], p: int) -> None:
        """seq[p] was just appended to seq: every active suffix grows by it and a new suffix
        starts at p. `active[i]` is the cursor of the suffix starting at p - len(active) + i
        (oldest first, updated in place); at most max_depth - 1 stay active."""
        t = seq[p]
        pos, depth, kids, count, cont, best = self.pos, self.depth, self.kids, self.count, self.cont, self.best
        active.append(ROOT)  # the suffix starting at p, empty so far
        base = p - len(active) + 1
        for i, node in enumerate(active):
            if pos[node] >= 0:
                continue  # inside its own compressed tail, which now reaches seq[p] by itself
            d = p - base - i
            if depth[node] < d:
                node = self._resolve(node, base + i, d, seq)
                if pos[node] >= 0:
                    active[i] = node
                    continue
            children = kids[node]  # exactly at depth d: step into the child for t
            child = children.get(t)
            cont[node] += 1
            if child is None:
                child = children[t] = self._new(depth[node] + 1, t, seq, p)
            else:
                if pos[child] >= 0:
                    self._split(child)
                count[child] += 1
            b = best[node]
            if b < 0 or count[child] >= count[b]:
                best[node] = child  # ties go to the most recent
            active[i] = child
        if len(active) >= self.max_depth:
            del active[0]  # its path reached max_depth

    def _resolve(self, node: int, s: int, d: int, seq: Sequence[int]) -> int:
        """The node of seq[s:s+d], or the compressed node whose tail holds it."""
        pos, depth, kids = self.pos, self.depth, self.kids
        while pos[node] < 0 and depth[node] < d:
            node = kids[node][seq[s + depth[node]]]
        return node

    def _split(self, node: int) -> None:
        """Turns a compressed node into a branching one with its tail's first step as a child."""
        seq, q = self.src[node], self.pos[node]
        children: dict[int, int] = {}
        self.kids[node], self.cont[node], self.best[node] = children, 0, -1
        if self.depth[node] < self.max_depth and q + 1 < len(seq):
            child = children[seq[q + 1]] = self._new(self.depth[node] + 1, seq[q + 1], seq, q + 1)
            self.cont[node], self.best[node] = 1, child
        self.src[node], self.pos[node] = None, -1

    def insert(self, seq: list[int]) -> None:
        """Indexes a whole sequence (a global-corpus document); seq must not change after."""
        active: list[int] = []
        for p in range(len(seq)):
            self.append(active, seq, p)

    def remove(self, seq: list[int]) -> None:
        """Un-indexes a sequence `insert` indexed: every count it added is taken back and
        nodes left with no occurrence are freed (with them every node that read seq)."""
        kids, count, cont, best, top = self.kids, self.count, self.cont, self.best, self.max_depth
        for s in range(len(seq)):
            parent = ROOT
            for i in range(s, min(len(seq), s + top)):
                child = kids[parent][seq[i]]
                cont[parent] -= 1
                count[child] -= 1
                if best[parent] == child:
                    best[parent] = -1
                if count[child] == 0:
                    del kids[parent][seq[i]]
                    self._free_subtree(child)
                    break
                parent = child

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            if self.kids[n]:
                stack.extend(self.kids[n].values())
            self.kids[n], self.src[n] = None, None
            self._free.append(n)

    # ---- reading ----------------------------------------------------------------------

    def walk(self, seq: Sequence[int], start: int, end: int) -> tuple[int, int] | None:
        """Where seq[start:end] ends in the trie: (node, tail tokens consumed past it, > 0
        only inside a compressed node), or None when it does not occur."""
        node, i = ROOT, start
        pos, kids = self.pos, self.kids
        while i < end:
            if pos[node] >= 0:
                n, q = end - i, pos[node] + 1
                if self.depth[node] + n > self.max_depth or self.src[node][q : q + n] != list(seq[i:end]):
                    return None
                return node, n
            node = kids[node].get(seq[i])
            if node is None:
                return None
            i += 1
        return node, 0

    def draft(self, node: int, extra: int, limit: int, min_prob: float) -> tuple[list[int], float, list[int] | None]:
        """The most frequent continuation from a position, up to `limit` tokens, stopping
        where the path's probability (product of count[child] / cont) falls below min_prob.
        Returns the tokens, their score (the sum of each token's path probability) and the
        sequence whose single-occurrence tail it read (None if it read none)."""
        out: list[int] = []
        prob, score = 1.0, 0.0
        count, cont, best = self.count, self.cont, self.best
        while len(out) < limit:
            if self.pos[node] >= 0:  # one occurrence: its tail, probability unchanged
                seq, start = self.src[node], self.pos[node] + 1 + extra
                n = min(limit - len(out), self.max_depth - self.depth[node] - extra, len(seq) - start)
                if n > 0:
                    out.extend(seq[start : start + n])
                    return out, score + n * prob, seq
                break
            if cont[node] <= 0:
                break
            b = best[node]
            if b < 0:
                b = best[node] = max(self.kids[node].values(), key=count.__getitem__)
            prob *= count[b] / cont[node]
            if prob < min_prob:
                break
            out.append(self.tok[b])
            score += prob
            node, extra = b, 0
        return out, score, None

    def resolve_cursor(self, active: list[int], i: int, seq: Sequence[int]) -> int:
        """The node of active[i]'s whole suffix (the last len(active) - i tokens of seq), or
        the compressed node whose tail holds it; stored back resolved."""
        n = len(seq)
        s = n - len(active) + i
        node = active[i] = self._resolve(active[i], s, n - s, seq)
        return node

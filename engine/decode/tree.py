"""Sparse candidate trees for Medusa: tree choices -> buffers built once, plus the paper's
greedy tree construction from calibrated head accuracies (Medusa §2.3.3).

A tree is given by its *choices*: one tuple of ranks per node, read from the root down.
(0,) is head 1's top-1 token under the pending token, (0, 1) is head 2's top-2 token under
that, and so on. Node 0 is the root (the pending token, chosen by the model itself), so a
node at depth d takes its token from head d. Everything that does not depend on the token
values (children lists, depths, ancestor mask, which head/rank fills each node) is computed
here once per tree; a decode step only gathers the heads' top-k ids into the node slots.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.errors import QuickdraftError

Choice = tuple[int, ...]


@dataclass(frozen=True)
class TreeBuffers:
    """Static structure of one candidate tree (n nodes, node 0 = root)."""

    choices: tuple[Choice, ...]  # per node its rank path from the root; node 0 = ()
    children: list[list[int]]  # children[i]: node i's children, best rank first
    depths: list[int]  # depth below the root = position offset of the node
    parents: list[int]  # parent node index; -1 for the root
    mask: (
        torch.Tensor | None
    )  # (n, n) bool, node i attends to node j (ancestors + self); None = chain
    node_heads: torch.Tensor  # (n - 1,) long: head (0-based) that fills node i + 1
    node_ranks: torch.Tensor  # (n - 1,) long: rank in that head's top-k
    top_k: int  # top-k the heads must return (largest rank + 1)
    depth: int  # deepest level = heads the tree reads

    @property
    def size(self) -> int:
        return len(self.choices)


def build_tree(choices: Sequence[Sequence[int]], num_heads: int) -> TreeBuffers:
    """Buffers for the tree whose non-root nodes are `choices` (the root is implied).

    Nodes are ordered by depth, then by rank path, so parents precede children and each
    node's children come best rank first (the order the acceptance rules try them in).
    Raises QuickdraftError on a choice whose parent is missing or that is deeper than the
    heads can fill.
    """
    nodes = sorted(
        {tuple(int(r) for r in c) for c in choices if len(c) > 0}, key=lambda c: (len(c), c)
    )
    for c in nodes:
        if min(c) < 0:
            raise QuickdraftError(f"tree choice {list(c)} has a negative rank")
        if len(c) > num_heads:
            raise QuickdraftError(f"tree choice {list(c)} is deeper than the {num_heads} heads")
        if len(c) > 1 and c[:-1] not in nodes:
            raise QuickdraftError(f"tree choice {list(c)} has no parent {list(c[:-1])} in the tree")
    all_choices: tuple[Choice, ...] = ((), *nodes)
    index = {c: i for i, c in enumerate(all_choices)}
    parents = [-1] + [index[c[:-1]] for c in nodes]
    shape = shape_of(parents)
    is_chain = all(len(kids) <= 1 for kids in shape.children)
    return TreeBuffers(
        choices=all_choices,
        children=shape.children,
        depths=shape.depths,
        parents=parents,
        mask=None if is_chain else shape.mask,
        node_heads=torch.tensor([len(c) - 1 for c in nodes], dtype=torch.long),
        node_ranks=torch.tensor([c[-1] for c in nodes], dtype=torch.long),
        top_k=max((c[-1] for c in nodes), default=0) + 1,
        depth=max((len(c) for c in nodes), default=0),
    )


def marginal_accuracies(topk_acc: Sequence[Sequence[float]]) -> list[list[float]]:
    """Per-head top-i accuracies (cumulative, i = 1..R) -> the accuracy of rank i alone.

    The paper's a_k^(i) = top-i accuracy minus top-(i-1) accuracy.
    """
    out = []
    for row in topk_acc:
        prev, marg = 0.0, []
        for acc in row:
            marg.append(max(0.0, float(acc) - prev))
            prev = max(prev, float(acc))
        out.append(marg)
    return out


def greedy_tree(marginal: Sequence[Sequence[float]], budget: int) -> list[Choice]:
    """The paper's sparse tree: add, `budget` times, the node with the highest estimated
    probability of being accepted, i.e. the product of its path's marginal accuracies
    (heads assumed independent). marginal[k][i]: rank i of head k + 1 alone is correct.

    Returns the chosen node choices (root excluded), best first.
    """
    num_heads = len(marginal)
    # Max-heap of (-probability, choice); a popped node offers its children as candidates.
    frontier = (
        [(-float(marginal[0][r]), (r,)) for r in range(len(marginal[0]))] if num_heads else []
    )
    heapq.heapify(frontier)
    chosen: list[Choice] = []
    while frontier and len(chosen) < budget:
        neg_p, choice = heapq.heappop(frontier)
        chosen.append(choice)
        depth = len(choice)
        if depth < num_heads:
            for r, acc in enumerate(marginal[depth]):
                heapq.heappush(frontier, (neg_p * float(acc), (*choice, r)))
    return chosen


def expected_tokens(choices: Sequence[Sequence[int]], marginal: Sequence[Sequence[float]]) -> float:
    """Expected tokens per step under the independence assumption: the model's own token
    plus, for every node, the probability that its whole path is correct."""
    total = 1.0
    for c in choices:
        p = 1.0
        for depth, rank in enumerate(c):
            row = marginal[depth] if depth < len(marginal) else []
            p *= float(row[rank]) if rank < len(row) else 0.0
        total += p
    return total


@dataclass(frozen=True)
class TreeShape:
    """Structure of a draft tree whose node tokens are filled per step."""

    children: list[list[int]]
    depths: list[int]
    mask: torch.Tensor  # (n, n) bool: node i attends to node j


def join_trees(a_tokens: Sequence[int], a_children: Sequence[Sequence[int]],
               b_tokens: Sequence[int], b_children: Sequence[Sequence[int]],
               ) -> tuple[list[int], list[int], list[int]]:
    """Tree b grafted onto tree a (both rooted at the same token) as a trie: a node of b
    whose parent's image already has a child with its token is that child, every other
    one a new node after a's. a's nodes and order are kept, so its first children are
    still tried first. Returns (tokens, parents, where): the joined tree (parents[0] = -1)
    and, per node of b, its node in the joined tree."""
    tokens = list(a_tokens)
    parents = [-1] * len(tokens)
    kids: list[dict[int, int]] = [{} for _ in tokens]  # node -> {token: child}
    for node, children in enumerate(a_children):
        for child in children:
            parents[child] = node
            kids[node].setdefault(tokens[child], child)
    where = [0] * len(b_tokens)
    todo = [0]  # b's nodes, breadth first: appended nodes keep b's order within a depth
    for node in todo:
        for child in b_children[node]:
            into, token = where[node], int(b_tokens[child])
            if token not in kids[into]:
                kids[into][token] = len(tokens)
                tokens.append(token)
                parents.append(into)
                kids.append({})
            where[child] = kids[into][token]
            todo.append(child)
    return tokens, parents, where


def shape_of(parents: Sequence[int]) -> TreeShape:
    """Children, depths and ancestor mask of the tree given by its parents (parents before
    children, node 0 the root)."""
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    depths = [0] * n
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[0, 0] = True
    for i in range(1, n):
        children[parents[i]].append(i)
        depths[i] = depths[parents[i]] + 1
        mask[i] = mask[parents[i]]
        mask[i, i] = True
    return TreeShape(children, depths, mask)

"""Pure acceptance rules: given draft candidates and the target model's distributions,
decide which drafted tokens are kept and which token the target adds.

Candidates form a tree (a chain is a tree whose nodes have one child each). Node 0 is the
root: the last token already chosen, whose target distribution predicts the first draft
token. `children[i]` lists node i's children in the drafter's order of preference, and
`tokens[i]` is node i's token. `target` rows are per node: row i is the target model's
distribution (or logits) for the token that follows node i.

Each rule returns (path, next_token): the accepted draft nodes from the root downwards
(root excluded) and the token the target model contributes after the last accepted node.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling import sample_from, uniform


def accept_greedy(
    children: Sequence[Sequence[int]], tokens: Sequence[int], target_argmax: Sequence[int]
) -> tuple[list[int], int]:
    """Follow the children whose token equals the target's argmax; exactly vanilla greedy.

    Where siblings carry the same token (a hybrid tree: the heads' branch and a lookup chain
    both guessing it), the deepest accepted path wins: both are the target's own choice.
    """
    ok = [False] * len(tokens)
    for node, kids in enumerate(children):
        for child in kids:
            ok[child] = tokens[child] == target_argmax[node]
    path = _deepest_path(children, ok, 0)
    return path, int(target_argmax[path[-1] if path else 0])


def _deepest_path(children: Sequence[Sequence[int]], ok: Sequence[bool], node: int) -> list[int]:
    """The longest path below `node` through nodes whose ok flag is set (the first in draft
    order among equally long ones)."""
    best: list[int] = []
    for child in children[node]:
        if ok[child]:
            below = [child, *_deepest_path(children, ok, child)]
            if len(below) > len(best):
                best = below
    return best


def accept_pointmass(
    children: Sequence[Sequence[int]],
    tokens: Sequence[int],
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Lossless sampling for deterministic candidates (e.g. Medusa's top-k tree).

    Each child is a point-mass proposal: accept child x with probability p(x); on rejection
    remove x from p and renormalise, then try the next child; if every child is rejected,
    sample from what is left. The accepted token is distributed exactly as p.
    target_probs: (n_nodes, V) float probabilities.
    """
    path: list[int] = []
    node = 0
    while True:
        p = target_probs[node].clone()
        chosen = None
        for child in children[node]:
            mass = float(p.sum())
            if mass <= 0:
                break
            x = tokens[child]
            px = float(p[x]) / mass
            if uniform(generator) < px:
                chosen = child
                break
            p[x] = 0.0
        if chosen is None:
            if float(p.sum()) <= 0:  # every token with mass was proposed and rejected
                p = target_probs[node]
            return path, sample_from(p / p.sum(), generator)
        path.append(chosen)
        node = chosen


def accept_speculative_chain(
    tokens: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Standard speculative sampling on a chain drafted from distributions q.

    tokens: [root, d1, ..., dn]; draft_probs: (n, V), row j is the q that d_{j+1} was
    sampled from; target_probs: (n + 1, V). Accept d with probability min(1, p(d) / q(d)),
    else resample from norm(max(0, p - q)); if all are accepted, sample the bonus from p_n.
    """
    n = len(tokens) - 1
    path: list[int] = []
    for j in range(n):
        d = tokens[j + 1]
        p, q = target_probs[j], draft_probs[j]
        ratio = float(p[d]) / max(float(q[d]), 1e-20)
        if uniform(generator) < min(1.0, ratio):
            path.append(j + 1)
            continue
        residual = (p - q).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: p itself is the residual
            residual = p
        return path, sample_from(residual / residual.sum(), generator)
    return path, sample_from(target_probs[n], generator)


def accept_typical(
    children: Sequence[Sequence[int]],
    tokens: Sequence[int],
    target_probs: torch.Tensor,
    eps: float,
    delta: float,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Medusa's typical acceptance (faster, not lossless): a child x of node i is
    acceptable when p_i(x) > min(eps, delta * exp(-H(p_i))), and the longest path of
    acceptable nodes is kept (Medusa §2.3.1); the token after it is sampled from p.
    target_probs: (n_nodes, V) float probabilities.
    """
    p = target_probs
    entropy = -(p * torch.log(p.clamp_min(1e-20))).sum(-1)  # (n,)
    threshold = torch.clamp(delta * torch.exp(-entropy), max=eps)  # (n,)
    ok = [False] * len(tokens)
    for node, kids in enumerate(children):
        if kids:
            probs = p[node, list(tokens[c] for c in kids)]
            for child, good in zip(kids, (probs > threshold[node]).tolist(), strict=True):
                ok[child] = good
    path = _deepest_path(children, ok, 0)
    return path, sample_from(p[path[-1] if path else 0], generator)

"""Pure acceptance rules: given draft candidates and the target model's distributions,
decide which drafted tokens are kept and which token the target adds.

Candidates form a tree (a chain is a tree whose nodes have one child each). Node 0 is the
root: the last token already chosen, whose target distribution predicts the first draft
token. `children[i]` lists node i's children in the drafter's order of preference, and
`tokens[i]` is node i's token. `target` rows are per node: row i is the target model's
distribution (or logits) for the token that follows node i.

Each rule returns (path, next_token): the accepted draft nodes from the root downwards
(root excluded) and the token the target model contributes after the last accepted node.

On a GPU the lossless sampling rules decide on the device and read the outcome once a
step: every read waits for the queued kernels, so a rule that read each candidate's
numbers in turn would stall the device several times a step (IN_TURN).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import SamplingParams
from engine.decode.sampling import draw, logits_to_probs, sample_from, uniform
from engine.devices import staged

# Devices where the rules try candidates in turn, reading the device after each trial: a
# CPU's reads cost nothing, and trying in turn stops at the first refusal (measured on a
# 2-core AMD EPYC at 49k tokens: 0.12-0.16 ms a step against 0.25-0.42 ms drawing every
# trial at once). Elsewhere a read waits for every queued kernel, so all trials are drawn
# at once on the device and the outcome is read once.
IN_TURN = ("cpu",)
# What every rule returns: the accepted nodes (the path), then the token the model adds.
Accepted = tuple[list[int], int]


class RowProbs:
    """The probabilities of (n, V) logits under a reply's settings, made row by row as a
    rule reads them: trying candidates in turn reads only the rows of the nodes it reaches,
    so a step whose first draft is refused shapes one row, not n (temperature, top-p and
    softmax over 49k tokens cost a CPU 0.3-0.5 ms a row)."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams):
        self.logits, self.params = logits, params
        self.device = logits.device
        self.made: dict[int, torch.Tensor] = {}  # row -> its (V,) probabilities

    def __getitem__(self, row: int) -> torch.Tensor:
        if row not in self.made:
            self.made[row] = logits_to_probs(self.logits[row], self.params)
        return self.made[row]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | RowProbs:
    """What the lossless rules read for (n, V) float32 logits: made row by row where they
    try candidates in turn (IN_TURN), all at once elsewhere."""
    if logits.device.type in IN_TURN:
        return RowProbs(logits, params)
    return logits_to_probs(logits, params)


def accept_greedy(
    children: Sequence[Sequence[int]], tokens: Sequence[int], target_argmax: Sequence[int]
) -> Accepted:
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
    target_probs: torch.Tensor | RowProbs,
    generator: torch.Generator | None,
    at_once: bool | None = None,
) -> Accepted:
    """Lossless sampling for deterministic candidates (e.g. Medusa's top-k tree).

    Each child is a point-mass proposal: accept child x with probability p(x); on rejection
    remove x from p and renormalise, then try the next child; if every child is rejected,
    sample from what is left. The accepted token is distributed exactly as p.
    target_probs: (n_nodes, V) float probabilities (RowProbs: in turn only). `at_once`:
    see IN_TURN.
    """
    if _at_once(target_probs, at_once):
        return _pointmass_at_once(children, tokens, target_probs, generator)
    return _pointmass_in_turn(children, tokens, target_probs, generator)


def accept_speculative_chain(
    tokens: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor | RowProbs,
    generator: torch.Generator | None,
    at_once: bool | None = None,
) -> Accepted:
    """Standard speculative sampling on a chain drafted from distributions q.

    tokens: [root, d1, ..., dn]; draft_probs: (n, V), row j is the q that d_{j+1} was
    sampled from; target_probs: (n + 1, V). Accept d with probability min(1, p(d) / q(d)),
    else resample from norm(max(0, p - q)); if all are accepted, sample the bonus from p_n.
    `at_once`: see IN_TURN.
    """
    if _at_once(target_probs, at_once):
        return _chain_at_once(tokens, draft_probs, target_probs, generator)
    return _chain_in_turn(tokens, draft_probs, target_probs, generator)


def _at_once(probs: torch.Tensor, at_once: bool | None) -> bool:
    """Whether a rule decides with all its trials at once (None: by the device, IN_TURN)."""
    return probs.device.type not in IN_TURN if at_once is None else at_once


def _pointmass_in_turn(children: Sequence[Sequence[int]], tokens: Sequence[int],
                       target_probs: torch.Tensor, generator: torch.Generator | None) -> Accepted:
    """accept_pointmass one child at a time, reading each trial's numbers."""
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


def _chain_in_turn(tokens: Sequence[int], draft_probs: torch.Tensor,
                   target_probs: torch.Tensor, generator: torch.Generator | None) -> Accepted:
    """accept_speculative_chain one draft at a time, reading each trial's numbers."""
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


@dataclass(frozen=True)
class _Links:
    """A draft tree's parent -> child links in the order the rules try them (each parent's
    children together, best first), on the device in one copy. E links, n nodes."""

    parent: torch.Tensor  # (E,) long: the link's parent node
    child: torch.Tensor  # (E,) long: the link's child node
    token: torch.Tensor  # (E,) long: the child's token
    first: torch.Tensor  # (E,) long: the first link of the same parent
    fresh: torch.Tensor  # (E,) bool: the token is not an earlier sibling's
    up: torch.Tensor  # (n,) long: each node's parent (the root its own)
    depths: torch.Tensor  # (n,) long: each node's depth below the root
    depth: list[int]  # the same on the host
    rounds: int  # pointer doublings that reach the root from the deepest node

    @classmethod
    def of(cls, children: Sequence[Sequence[int]], tokens: Sequence[int],
           device: torch.device) -> _Links:
        parent, child, token, first, fresh = [], [], [], [], []
        up, depth = [0] * len(tokens), [0] * len(tokens)
        stack = [0]
        while stack:  # from the root down: depths need no node order
            node = stack.pop()
            kids = children[node]
            start, seen = len(parent), set()
            for kid in kids:
                tok = tokens[kid]
                fresh.append(tok not in seen)
                seen.add(tok)
                token.append(tok)
                up[kid], depth[kid] = node, depth[node] + 1
            parent += [node] * len(kids)
            first += [start] * len(kids)
            child += kids
            stack += kids
        # one host-to-device copy for the whole tree
        flat = staged([*up, *depth, *parent, *child, *token, *first, *fresh], device)
        n, e = len(tokens), len(parent)
        parent, child, token, first, fresh = flat[2 * n:].view(5, e)
        return cls(parent, child, token, first, fresh.bool(), flat[:n], flat[n:2 * n], depth,
                   max(depth).bit_length())


def _before_in_group(values: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """(E,) per link, the sum of `values` over the earlier links of the same parent."""
    before = values.cumsum(0) - values  # over every earlier link
    return before - before[first]


def _on_path(taken: torch.Tensor, links: _Links) -> torch.Tensor:
    """(n,) bool: the nodes reached from the root through taken links. A node is on the
    path when no link above it was refused: refusals are summed up the tree by pointer
    doubling (each round adds the sums of the next 2^k ancestors), log2(depth) rounds."""
    refused = torch.zeros(len(links.depth), dtype=torch.long, device=taken.device)
    refused = refused.index_put((links.child,), (~taken).long())  # the root's stays 0
    up = links.up
    for _ in range(links.rounds):
        refused = refused + refused[up]
        up = up[up]
    return refused == 0


def _row(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Row `index` (a 0-d device tensor) of `rows`, read on the device: indexing with a
    0-d tensor can turn it into a Python int first, a read of the device."""
    return rows.index_select(0, index.view(1))[0]


def _pointmass_at_once(children: Sequence[Sequence[int]], tokens: Sequence[int],
                       target_probs: torch.Tensor, generator: torch.Generator | None) -> Accepted:
    """accept_pointmass with every child's trial drawn at once, on the device: child x,
    tried after the siblings before it were refused, is accepted with p(x) / (what those
    siblings left of p); a node's first accepted child is the one taken. Same
    distribution as trying them in turn; one read of the device."""
    p, device = target_probs, target_probs.device
    links = _Links.of(children, tokens, device)
    mass = p[links.parent, links.token] * links.fresh  # a repeated token has none left
    left = p.sum(-1)[links.parent] - _before_in_group(mass, links.first)
    trial = torch.rand(mass.shape, generator=generator, device=device)
    hit = (left > 0) & (trial * left < mass)
    taken = hit & (_before_in_group(hit.long(), links.first) == 0)
    on = _on_path(taken, links)
    last = (links.depths * on).argmax()  # the path's end: on-path nodes form one chain
    row = _row(p, last)
    # Its children were all tried and refused: sample from what they left of its row.
    refused = torch.where(links.parent == last, 0.0, row[links.token])
    rest = row.scatter_reduce(0, links.token, refused, "amin")
    token = draw(rest, generator)  # past the vocabulary where nothing is left
    read = torch.cat([on.long(), token]).tolist()  # the step's one read of the device
    path = sorted((i for i in range(1, len(tokens)) if read[i]), key=links.depth.__getitem__)
    if read[-1] == row.shape[-1]:  # every token with mass was refused (rows cut to top-k)
        return path, sample_from(row, generator)
    return path, read[-1]


def _chain_at_once(tokens: Sequence[int], draft_probs: torch.Tensor,
                   target_probs: torch.Tensor, generator: torch.Generator | None) -> Accepted:
    """accept_speculative_chain with every draft's trial drawn at once, on the device;
    the first refusal ends the chain. One read of the device."""
    n, device = len(tokens) - 1, target_probs.device
    drafted = staged(list(tokens[1:]), device)
    rows = torch.arange(n, device=device)
    ratio = target_probs[rows, drafted] / draft_probs[rows, drafted].clamp_min(1e-20)
    trial = torch.rand((n,), generator=generator, device=device)
    refused = trial >= ratio.clamp(max=1.0)
    cut = torch.where(refused.any(), refused.long().argmax(), n)  # the first refusal
    p = _row(target_probs, cut)
    q = _row(draft_probs, cut.clamp(max=n - 1)) * (cut < n)  # past the chain: the bonus, from p
    residual = (p - q).clamp_min(0)
    residual = torch.where(residual.sum() > 0, residual, p)  # p == q up to rounding
    token = draw(residual, generator)
    kept, nxt = torch.cat([cut.view(1), token]).tolist()  # the step's one read
    return list(range(1, kept + 1)), nxt


def accept_typical(
    children: Sequence[Sequence[int]],
    tokens: Sequence[int],
    target_probs: torch.Tensor,
    eps: float,
    delta: float,
    generator: torch.Generator | None,
) -> Accepted:
    """Medusa's typical acceptance (faster, not lossless): a child x of node i is
    acceptable when p_i(x) > min(eps, delta * exp(-H(p_i))), and the longest path of
    acceptable nodes is kept (Medusa §2.3.1); the token after it is sampled from p.
    target_probs: (n_nodes, V) float probabilities.
    """
    p = target_probs
    links = _Links.of(children, tokens, p.device)
    entropy = -(p * torch.log(p.clamp_min(1e-20))).sum(-1)  # (n,)
    threshold = torch.clamp(delta * torch.exp(-entropy), max=eps)  # (n,)
    good = p[links.parent, links.token] > threshold[links.parent]
    ok = torch.zeros(len(tokens), dtype=torch.bool, device=p.device)
    ok = ok.index_put((links.child,), good).tolist()
    path = _deepest_path(children, ok, 0)
    return path, sample_from(p[path[-1] if path else 0], generator)

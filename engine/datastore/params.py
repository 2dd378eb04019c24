"""How much a datastore keeps and how its continuation trees grow."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DatastoreParams:
    """How much is kept and how the continuation tree is grown."""

    max_tokens: int = 1_000_000  # the cap: oldest documents out beyond it (~16 MB in memory)
    recent_cap: int = 65_536  # the small tier's size before it is folded into main
    max_match: int = 16  # longest suffix of the context that is matched
    min_match: int = 2  # shortest match still worth a draft
    max_nodes: int = 16  # most drafted tokens per step
    nodes_per_match: float = 2.0  # node budget per matched token (longer match, bigger tree)
    min_prob: float = 0.15  # a node is drafted only if its path's estimated probability is
    # at least this (count / parent count, multiplied down the path)
    min_count: int = 1  # a continuation seen fewer times is not drafted
    # Pseudo-occurrences added to every count when estimating how many drafted tokens the
    # model will keep (what deciding whether a tree pays needs): a continuation seen once
    # is no certainty. On held-out prompts the plain count ratios predicted 5.3x the store
    # tokens the model kept, with 2 pseudo-occurrences 1.7x (int4, 28 prompts).
    smoothing: float = 2.0

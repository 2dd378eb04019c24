"""Tree buffers and the greedy sparse-tree construction, on hand-made inputs."""

from __future__ import annotations

import random

import pytest
import torch

from engine.decode.tree import build_tree, expected_tokens, greedy_tree, marginal_accuracies
from engine.errors import QuickdraftError

# root -> a (0,), b (1,);  a -> c (0,0), d (0,1);  b -> e (1,0)
CHOICES = [(1, 0), (0,), (0, 1), (1,), (0, 0)]


def test_nodes_are_ordered_by_depth_then_rank():
    t = build_tree(CHOICES, num_heads=4)
    assert t.choices == ((), (0,), (1,), (0, 0), (0, 1), (1, 0))
    assert t.parents == [-1, 0, 0, 1, 1, 2]
    assert t.children == [[1, 2], [3, 4], [5], [], [], []]
    assert t.depths == [0, 1, 1, 2, 2, 2]  # position offsets below the pending token
    assert t.size == 6 and t.depth == 2 and t.top_k == 2


def test_node_slots_say_which_head_and_rank_fill_each_node():
    t = build_tree(CHOICES, num_heads=4)
    assert t.node_heads.tolist() == [0, 0, 1, 1, 1]
    assert t.node_ranks.tolist() == [0, 1, 0, 1, 0]
    top = torch.tensor([[10, 11], [20, 21], [30, 31], [40, 41]])  # (K, top_k) head guesses
    assert top[t.node_heads, t.node_ranks].tolist() == [10, 11, 20, 21, 20]


def test_mask_lets_each_node_see_exactly_its_ancestors():
    t = build_tree(CHOICES, num_heads=4)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(t.mask, expected)


def test_a_chain_needs_no_mask():
    t = build_tree([(0,), (0, 0), (0, 0, 0)], num_heads=4)  # a top-1 chain of 3 drafts
    assert t.mask is None
    assert t.children == [[1], [2], [3], []]
    assert t.depths == [0, 1, 2, 3]


def test_empty_tree_is_just_the_root():
    t = build_tree([], num_heads=4)
    assert t.size == 1 and t.children == [[]] and t.node_heads.numel() == 0


@pytest.mark.parametrize(
    "bad, words",
    [
        ([(0, 0)], "no parent"),
        ([(0,), (0, 0), (0, 0, 0)], "deeper"),
        ([(-1,)], "negative"),
    ],
)
def test_malformed_choices_are_refused(bad, words):
    with pytest.raises(QuickdraftError, match=words):
        build_tree(bad, num_heads=2)


def test_marginal_accuracies_are_differences_of_top_i():
    assert marginal_accuracies([[0.4, 0.55, 0.55]])[0] == pytest.approx([0.4, 0.15, 0.0])


def test_greedy_tree_adds_the_most_probable_path_first():
    marginal = [[0.6, 0.2], [0.5, 0.1]]
    # (0,) 0.6 > (0,0) 0.3 > (1,) 0.2 > (1,0) 0.1 > (0,1) 0.06
    assert greedy_tree(marginal, 3) == [(0,), (0, 0), (1,)]
    assert greedy_tree(marginal, 4) == [(0,), (0, 0), (1,), (1, 0)]
    assert expected_tokens(greedy_tree(marginal, 3), marginal) == pytest.approx(1 + 0.6 + 0.3 + 0.2)


def test_greedy_trees_are_always_buildable():
    rng = random.Random(0)
    for _ in range(20):
        marginal = [[rng.random() / (r + 1) for r in range(5)] for _ in range(4)]
        choices = greedy_tree(marginal, rng.randint(1, 40))
        t = build_tree(choices, num_heads=4)  # raises if a parent were missing
        assert t.size == len(choices) + 1

"""Index arithmetic between the walk and SGLang's KV / recurrent-state bookkeeping."""

import torch

from sglang_ddtree.indexing import (
    accepted_kv_locs,
    flat_accept_index,
    gather_accepted_rows,
    kv_free_locs_mask,
    kv_keep_mask,
    map_chain_steps_to_slots,
    recurrent_state_step,
)

# two requests, D = 5: request 0 accepted root->2->4, request 1 accepted nothing
SLOTS = torch.tensor([[0, 2, 4, -1], [0, -1, -1, -1]])
LEN = torch.tensor([2, 0])
D = 5


def test_flat_accept_index():
    assert flat_accept_index(SLOTS, LEN, D).tolist() == [[0, 2, 4, -1], [5, -1, -1, -1]]


def test_kv_keep_and_free():
    keep = kv_keep_mask(SLOTS, LEN, D)
    assert keep.tolist() == [[True, False, True, False, True], [True, False, False, False, False]]
    free = kv_free_locs_mask(SLOTS, LEN, D)
    assert free.tolist() == (~keep).reshape(-1).tolist()
    loc = torch.arange(100, 110)
    assert accepted_kv_locs(loc, SLOTS, LEN).tolist() == [[100, 102, 104, -1], [105, -1, -1, -1]]
    # kept + freed partition what the verify wrote
    kept = set(loc[keep.reshape(-1)].tolist())
    assert kept.isdisjoint(set(loc[free].tolist())) and len(kept) + int(free.sum()) == 10


def test_recurrent_state_step_is_deepest_accepted_slot():
    assert recurrent_state_step(SLOTS, LEN).tolist() == [4, 0]
    # the chain formula (commit_len - 1 == accept_length) would pick slot 2 for request 0: wrong node
    assert (LEN).tolist() != recurrent_state_step(SLOTS, LEN).tolist()


def test_chain_steps_to_slots():
    steps = torch.tensor([1, 0])
    assert map_chain_steps_to_slots(steps, SLOTS, LEN).tolist() == [2, 0]
    assert map_chain_steps_to_slots(torch.tensor([-1, 1]), SLOTS, LEN).tolist() == [-1, -1]
    assert map_chain_steps_to_slots(torch.tensor([2, 0]), SLOTS, LEN).tolist() == [4, 0]


def test_gather_accepted_rows():
    hidden = torch.arange(10, dtype=torch.float32).view(10, 1).expand(10, 3)
    vals, valid = gather_accepted_rows(hidden, SLOTS, LEN)
    assert valid.tolist() == [[True, True, True, False], [True, False, False, False]]
    assert vals[0, :3, 0].tolist() == [0.0, 2.0, 4.0]
    assert vals[1, 0, 0].item() == 5.0

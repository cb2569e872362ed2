"""The release-independent parts of the DDTree workers (sglang_ddtree.adapters.worker_common)."""
import types

import pytest
import torch

from sglang_ddtree.adapters import worker_common as wc
from sglang_ddtree.step import commit_from_accept


def test_drafter_block_takes_the_first_width_given_and_checks_the_reservation():
    assert wc.drafter_block(16, None, 8, 16) == 8
    assert wc.drafter_block(16, 32, 8) == 32
    with pytest.raises(ValueError, match=r"must be in \[2, 2\*D = 8\]"):
        wc.drafter_block(4, 16)
    with pytest.raises(ValueError, match="needs the drafter's block width"):
        wc.drafter_block(16, None, None)


def test_draft_candidates_equal_full_vocab_top_k():
    g = torch.Generator().manual_seed(0)
    head = types.SimpleNamespace(weight=torch.randn(50, 8, generator=g))
    hs = torch.randn(7, 8, generator=g)
    lp, ids = wc.draft_candidates(hs, head, k=5, vocab_size=50, tp_group=None, chunk=3)
    full = torch.log_softmax((hs @ head.weight.T).double(), -1)
    want = torch.sort(full, dim=-1, descending=True, stable=True)
    assert torch.equal(ids, want.indices[:, :5])
    assert torch.allclose(lp, want.values[:, :5], atol=1e-5)
    # vocab rows past the model's vocab (padding) are never candidates
    lp2, ids2 = wc.draft_candidates(hs, head, k=5, vocab_size=20, tp_group=None)
    assert int(ids2.max()) < 20


def test_commit_window_puts_the_accepted_path_first():
    # one request, prefix 3, D = 4: window slots [10, 11, 12, 13]; accepted path: root (slot 0) -> slot 2
    predict = torch.zeros(4, dtype=torch.int32)
    predict[0], predict[2] = 7, 9
    accept_index = torch.tensor([[0, 2, -1]], dtype=torch.int32)
    c = commit_from_accept(predicts=predict, accept_index=accept_index, accept_token_num=torch.tensor([1]),
                           d=4, prefix=torch.tensor([3]), window_locs=torch.tensor([[10, 11, 12, 13]]),
                           draft_window_ids=torch.tensor([[10, 11, 12, 13]]), out_width=4)
    r2t = torch.arange(20, dtype=torch.int32).reshape(1, 20)
    wc.commit_window(r2t, torch.tensor([0]), torch.tensor([3]), c)
    assert r2t[0, :3].tolist() == [0, 1, 2]
    assert r2t[0, 3:5].tolist() == [10, 12]              # root's slot, then the accepted node's
    assert sorted(r2t[0, 3:7].tolist()) == [10, 11, 12, 13]  # nothing lost: the rest stay reserved
    assert r2t[0, 7:].tolist() == list(range(7, 20))

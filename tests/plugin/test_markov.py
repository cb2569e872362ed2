"""The synthetic language (sglang_ddtree_tools.markov): seeded tables, set probabilities, greedy, and the estimator."""

import math

import pytest

torch = pytest.importorskip("torch")

from sglang_ddtree_tools import markov  # noqa: E402
from sglang_ddtree.tree import build_tree_reference  # noqa: E402


def test_same_seed_same_language_other_seed_another():
    a, b, c = markov.make_source(3, vocab=512), markov.make_source(3, vocab=512), markov.make_source(4, vocab=512)
    for name in ("cls", "cand", "tail"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.cand, c.cand)
    xa, ra = a.sample(64, 40, torch.Generator().manual_seed(9))
    xb, rb = b.sample(64, 40, torch.Generator().manual_seed(9))
    assert torch.equal(xa, xb) and torch.equal(ra, rb)
    xc, _ = a.sample(64, 40, torch.Generator().manual_seed(10))
    assert not torch.equal(xa, xc)


def test_text_never_holds_reserved_or_mask_ids_and_candidates_are_the_next_family():
    s = markov.make_source(0, vocab=256)
    x, r = s.sample(256, 64, torch.Generator().manual_seed(1))
    k = s.components
    assert r.shape == (256, k) and torch.equal(x[:, :k], markov.MARKER_BASE + 3 * torch.arange(k) + r)  # markers
    assert int(x[:, k:].min()) >= markov.FIRST_TEXT_TOKEN and int(x.max()) < s.text_tokens.stop <= s.mask_token_id
    text = torch.tensor(list(s.text_tokens))
    fam = s.family(s.cand[text])
    assert bool((fam == fam[:, :1]).all())  # the three candidates are one family ...
    assert sorted(((s.cand[text] - markov.FIRST_TEXT_TOKEN) % 3)[0].tolist()) == [0, 1, 2]  # ... all its members
    assert sorted(fam[:, 0].unique().tolist()) == list(range(s.num_families))  # the family path is a permutation
    for f in range(s.num_families):  # cls is a permutation within each family
        assert sorted(s.cls[markov.FIRST_TEXT_TOKEN + 3 * f + torch.arange(3)].tolist()) == [0, 1, 2]


@pytest.mark.parametrize("noise", [0.0, 0.25, 1.0])
def test_greedy_map_is_a_bijection_so_orbits_do_not_merge(noise):
    s = markov.make_source(3, vocab=512, member_noise=noise)
    text = torch.tensor(list(s.text_tokens))
    n = text.numel()
    inv = torch.empty(s.num_families, dtype=torch.int64)  # the family before each one on the path
    inv[s.family(s.cand[text, 0])] = s.family(text)
    for r in torch.randint(0, 3, (4, s.components), generator=torch.Generator().manual_seed(0)):
        # greedy state (c, b) = (cls of the token before last, last token) -> (cls[b], next token); on greedy text
        # the token before last is of family inv[family(b)], which names the component consulted
        c = torch.arange(3).repeat_interleave(n)
        b = text.repeat(3)
        rc = r[s.comp[markov.FIRST_TEXT_TOKEN + 3 * inv[s.family(b)]]]
        nxt = s.cand[b, :].gather(1, ((rc + c) % 3).unsqueeze(1)).squeeze(1)
        image = s.cls[b] * s.vocab + nxt
        assert image.unique().numel() == 3 * n
    # long orbits: the family path is one cycle, so no greedy state repeats within F steps
    s = markov.make_source(3, vocab=2048, member_noise=noise)
    x, reg = s.sample(16, 8, torch.Generator().manual_seed(0))
    cont = s.greedy_continuation(x, reg, s.num_families)
    fams = s.family(cont)
    assert all(len(set(row)) == s.num_families for row in fams.tolist())
    # and prompts do not share text: two greedy continuations are (almost) never in the same state
    pairs = set(zip(fams[0].tolist(), cont[0].tolist()))
    assert sum((f, t) in pairs for f, t in zip(fams[1:].flatten().tolist(), cont[1:].flatten().tolist())) < 0.5 * cont[1:].numel()


def test_empirical_frequencies_match_the_set_probabilities():
    s = markov.make_source(1, vocab=512, probs=(0.6, 0.25, 0.1))
    n = 200_000
    g = torch.Generator().manual_seed(5)
    a = torch.randint(markov.FIRST_TEXT_TOKEN, 511, (n,), generator=g)
    b = torch.randint(markov.FIRST_TEXT_TOKEN, 511, (n,), generator=g)
    r = torch.randint(0, 3, (n, s.components), generator=g)
    c = s.sample_next(a, b, r, g)
    slot = s.slot(a, r)
    for i, p in enumerate(s.probs):
        want = s.cand[b, :].gather(1, ((slot + i) % 3).unsqueeze(1)).squeeze(1)
        freq = float((c == want).float().mean())
        # a tail token equal to a candidate adds at most tail/n_tail to it
        assert abs(freq - p) < 0.006 + s.tail_prob / s.tail.shape[1], (i, freq, p)
    in_tail = (s.tail[b] == c.unsqueeze(1)).any(1)
    in_cand = (s.cand[b] == c.unsqueeze(1)).any(1)
    assert abs(float((in_tail & ~in_cand).float().mean()) - s.tail_prob) < 0.01
    # and the dense distribution agrees with sampling for one fixed context
    a1, b1, r1 = torch.tensor([77]), torch.tensor([100]), torch.tensor([[2, 0, 1, 1]])
    probs = s.next_probs(a1, b1, r1)[0]
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-9)
    draws = s.sample_next(a1.expand(50_000), b1.expand(50_000), r1.expand(50_000, -1), torch.Generator().manual_seed(2))
    emp = torch.bincount(draws, minlength=s.vocab).double() / draws.numel()
    assert float((emp - probs).abs().max()) < 0.01


def test_greedy_continuation_is_the_argmax_and_the_regime_is_recoverable():
    s = markov.make_source(2, vocab=512)
    x, r = s.sample(32, 48, torch.Generator().manual_seed(3))
    cont = s.greedy_continuation(x, r, 20)
    a, b = x[:, -2], x[:, -1]
    for t in range(20):
        assert torch.equal(cont[:, t], s.next_probs(a, b, r).argmax(1))
        a, b = b, cont[:, t]
    # the regime changes the greedy choice (it is what makes the target's greedy non-trivial)
    other = s.greedy_continuation(x, (r + 1) % 3, 20)
    assert torch.equal(s.family(other), s.family(cont))  # the family path ignores the regime ...
    assert bool((other[:, 0] != cont[:, 0]).all()) and float((other != cont).float().mean()) > 0.5  # ... members not
    # each step consults the component its token before last names: changing another one changes nothing there
    comp0 = s.comp[x[:, -2]]
    r2 = r.clone()
    r2[torch.arange(32), (comp0 + 1) % s.components] += 1
    r2 %= 3
    assert torch.equal(s.greedy_continuation(x, r2, 1), cont[:, :1])


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="vocab"):
        markov.make_source(0, vocab=16)
    with pytest.raises(ValueError, match="probs"):
        markov.make_source(0, probs=(0.3, 0.5, 0.1))
    with pytest.raises(ValueError, match="probs"):
        markov.make_source(0, probs=(0.6, 0.3, 0.2))
    with pytest.raises(ValueError, match="member_noise"):
        markov.make_source(0, member_noise=1.5)
    with pytest.raises(ValueError, match="components"):
        markov.make_source(0, components=10)


def test_expected_accept_by_hand():
    prof = [[0.6, 0.4], [0.6, 0.4]]
    e = markov.expected_accept(prof, budget=3)
    assert math.isclose(e["chain"], 1 + 0.6 + 0.36)
    # best-first: (0) .6, (1) .4, (0,0) .36 -> expected accepted nodes .6 + .4 + .36
    assert math.isclose(e["tree"], 1 + 0.6 + 0.4 + 0.36)
    # the truth never at rank 1: the tree's extra node is worth nothing
    e2 = markov.expected_accept(prof, budget=3, rank_probs=[[1.0, 0.0], [1.0, 0.0]])
    assert math.isclose(e2["chain"], 3.0) and math.isclose(e2["tree"], 3.0)
    assert math.isclose(markov.expected_accept(prof, budget=3, block=2)["chain"], 1.6)
    with pytest.raises(ValueError, match="sorted"):
        markov.expected_accept([[0.4, 0.6]], budget=2)
    with pytest.raises(ValueError, match="summing"):
        markov.expected_accept([[0.9, 0.4]], budget=2)


def test_expected_accept_matches_a_simulation_through_the_plugins_tree():
    """Monte Carlo: draw the truth's rank per depth, build the tree from the profile, walk it."""
    prof = torch.tensor([[0.8, 0.12, 0.05], [0.6, 0.25, 0.1], [0.5, 0.3, 0.15], [0.45, 0.3, 0.2]])
    rank_probs = torch.tensor([[0.85, 0.1, 0.04], [0.55, 0.3, 0.1], [0.5, 0.25, 0.15], [0.4, 0.3, 0.2]])
    budget = 7
    e = markov.expected_accept(prof, budget, rank_probs=rank_probs)
    tree = build_tree_reference(torch.log(prof), budget)
    nodes = {tuple(tree.ranks[s] for s in tree.path(slot)) for slot in range(1, tree.num_nodes + 1)}
    g = torch.Generator().manual_seed(0)
    full = torch.cat([rank_probs, (1 - rank_probs.sum(1, keepdim=True))], 1)  # last column: rank >= K
    n = 40_000
    draws = torch.stack([torch.multinomial(full[d], n, replacement=True, generator=g) for d in range(4)], 1)
    chain = tree_acc = 0
    for row in draws.tolist():
        k = 0
        while k < 4 and row[k] == 0:
            k += 1
        chain += 1 + k
        d = 0
        while d < 4 and tuple(row[: d + 1]) in nodes:
            d += 1
        tree_acc += 1 + d
    assert abs(chain / n - e["chain"]) < 0.03
    assert abs(tree_acc / n - e["tree"]) < 0.03
    assert e["tree"] > e["chain"]


def test_decode_walk_visits_the_anchors_where_each_step_stopped():
    # anchor 0 commits 3 (next at 3), anchor 3 commits 2 (next at 5), anchor 5 commits 1 (next at 6: past the row)
    w = markov.decode_walk([[3, 9, 9, 2, 9, 1]])
    assert (w["tokens"], w["steps"]) == (6, 3)
    assert (w["anchor_tokens"], w["anchors"]) == (33, 6)
    assert markov.decode_walk(torch.tensor([[3, 9, 9, 2, 9, 1], [1, 1, 1, 1, 1, 1]])) == {
        "tokens": 12, "steps": 9, "anchor_tokens": 39, "anchors": 12}


def test_decode_walk_is_below_the_every_anchor_mean_when_stretches_differ():
    """An easy stretch (every anchor accepts 8) is crossed in one step per 8 tokens, a hard one (1) in one step per
    token: a server's accept length weights the hard stretch by its steps, the every-anchor mean by its length."""
    row = [8] * 64 + [1] * 64
    w = markov.decode_walk([row])
    assert w["anchor_tokens"] / w["anchors"] == 4.5
    assert (w["tokens"], w["steps"]) == (128, 8 + 64)  # 128 / 72 = 1.78 tokens a step
    flat = markov.decode_walk([[4] * 128])  # the same drafter quality everywhere: both figures agree
    assert flat["tokens"] / flat["steps"] == flat["anchor_tokens"] / flat["anchors"] == 4


def test_decode_walk_refuses_a_step_that_commits_nothing():
    with pytest.raises(ValueError, match="at least its bonus"):
        markov.decode_walk([[2, 0, 1]])

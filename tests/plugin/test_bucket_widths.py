"""A budget schedule's target verify graphs, each batch-size bucket at its own width (SGLang 0.5.17,
``sglang_ddtree.adapters.v0_5_17_graph_widths``), checked on CPU against the installed SGLang's real methods:
its decode graph runner admits and captures a bucket at that bucket's width (and the drafter's runner keeps its
own), and its hybrid linear-attention backend builds each bucket's verify ``query_start_loc`` and tree-link
buffers at the bucket's width. The GPU capture and replay themselves run in ``device.sh bench`` on the H200."""

from importlib.metadata import version
from types import SimpleNamespace

import pytest
import torch

from sglang_ddtree import contract

pytestmark = pytest.mark.skipif(version("sglang") != "0.5.17",
                                reason="per-bucket verify graph widths are an SGLang 0.5.17 adapter feature")

SCHEDULE = contract.parse_budget("1:31,4:15,8:chain")
BLOCK = 8
D = contract.draft_tokens("tree-verify", SCHEDULE, BLOCK)


def _width_of(bucket):
    return contract.step_width(SCHEDULE, int(bucket), BLOCK)


@pytest.fixture
def widths():
    from sglang_ddtree.adapters import v0_5_17_graph_widths as gw

    gw.install(_width_of, set(contract.schedule_widths(SCHEDULE, BLOCK).values()))
    try:
        yield gw
    finally:
        gw.uninstall()


def _runner(draft=False):
    """A DecodeCudaGraphRunner with the state its admission check reads (no GPU, nothing captured)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    r = object.__new__(DecodeCudaGraphRunner)
    r.model_runner = SimpleNamespace(is_draft_worker=draft, spec_algorithm=SimpleNamespace(is_ngram=lambda: False),
                                     server_args=SimpleNamespace(debug_cuda_graph=False))
    r.capture_forward_mode = ForwardMode.TARGET_VERIFY
    r.ragged_verify_mode = False
    r.require_mlp_tp_gather = r.require_mlp_sync = False
    r.capture_bs = [1, 2, 4, 8]
    r.max_bs = 8
    r.captured_req_width = 32
    r.disable_padding = r.enable_pdmux = r.is_encoder_decoder = r.enable_two_batch_overlap = False
    return r


def _batch(bs, width):
    return SimpleNamespace(batch_size=bs, replace_embeds=None, spec_info=SimpleNamespace(num_tokens_per_req=width))


def test_schedule_widths_are_the_buckets_widths():
    assert D == 32
    assert [_width_of(b) for b in (1, 2, 3, 4, 7, 8, 64)] == [32, 32, 32, 16, 16, 8, 8]


def test_runner_admits_each_bucket_at_its_own_width(widths):
    r = _runner()
    assert r.can_run_graph(_batch(1, 32)) and r.can_run_graph(_batch(2, 32))
    assert r.can_run_graph(_batch(3, 16)) and r.can_run_graph(_batch(4, 16))  # 3 pads to bucket 4
    assert not r.can_run_graph(_batch(3, 32))  # not bucket 4's width
    assert r.can_run_graph(_batch(5, 8)) and r.can_run_graph(_batch(8, 8))
    assert not r.can_run_graph(_batch(9, 8))  # past the largest bucket: eager
    assert r.captured_req_width == 32  # the runner's own width outside each call
    assert widths.bucket_of(r, 3) == 4 and widths.bucket_of(r, 9) is None
    drafter = _runner(draft=True)  # the drafter's runner keeps one width
    assert drafter.can_run_graph(_batch(3, 32)) and not drafter.can_run_graph(_batch(3, 16))


def test_without_install_the_runner_has_one_width():
    r = _runner()
    assert r.can_run_graph(_batch(3, 32)) and not r.can_run_graph(_batch(3, 16))


def test_capture_runs_each_bucket_at_its_width(widths):
    """The real capture_one_shape computes its token count (and from it the capture batch) at the bucket's width:
    its first call out, capture_prepare, sees num_tokens = bucket x width and the runner's width set to it."""
    seen = []

    class Probe(Exception):
        pass

    r = _runner()

    def capture_prepare(bs, stream_idx=None, num_tokens=None):
        seen.append((bs, num_tokens, r.captured_req_width))
        raise Probe

    r.capture_prepare = capture_prepare
    for bucket in reversed(r.capture_bs):
        with pytest.raises(Probe):
            r.capture_one_shape(bucket, forward=None)
    assert seen == [(8, 64, 8), (4, 64, 16), (2, 64, 32), (1, 32, 32)]
    assert r.captured_req_width == 32


def test_wider_than_d_is_refused(widths):
    widths.install(lambda b: 64, {64})
    with pytest.raises(RuntimeError, match="outside"):
        _runner().can_run_graph(_batch(1, 64))


def _hybrid_backend(max_bs=8):
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase

    b = object.__new__(MambaAttnBackendBase)
    b.pad_slot_id, b.device, b.topk, b._fused_state_indices_ok = -1, torch.device("cpu"), 4, False
    b.req_to_token_pool = SimpleNamespace(mamba_pool=None, get_mamba_indices=lambda idx: idx.to(torch.int32),
                                          translate_mamba_indices=lambda idx: idx)
    b.state_indices_list, b.query_start_loc_list = [], []
    b.retrieve_next_token_list, b.retrieve_next_sibling_list, b.retrieve_parent_token_list = [], [], []
    b.replayssm_write_pos_list = b.replayssm_force_flush_list = None
    b.init_cuda_graph_state(max_bs, max_bs * D)
    return b


def test_hybrid_backend_builds_each_bucket_at_its_width(widths):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    b = _hybrid_backend()
    for bucket in (1, 2, 4, 8):
        w = _width_of(bucket)
        spec = SimpleNamespace(draft_token_num=w, ragged_verify_layout=None)
        md = b._capture_metadata(bucket, torch.arange(bucket), ForwardMode.TARGET_VERIFY, spec)
        assert md.query_start_loc.tolist() == list(range(0, (bucket + 1) * w, w))
        assert tuple(md.retrieve_next_token.shape) == (bucket, w)
        assert tuple(md.retrieve_next_sibling.shape) == (bucket, w)
        assert tuple(md.retrieve_parent_token.shape) == (bucket, w)
    assert b.cached_cuda_graph_verify_query_start_loc.tolist() == list(range(0, 8 * D + 1, D))  # restored


def test_hybrid_backend_replay_pads_at_the_buckets_width(widths):
    """A replay of 3 requests in bucket 4 (width 16): the real start locations of the 3, the padded row at 3 x 16,
    and the tree links copied into the bucket's own [4, 16] buffers."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    b = _hybrid_backend()
    links = torch.arange(3 * 16, dtype=torch.int32).view(3, 16)
    spec = SimpleNamespace(draft_token_num=16, ragged_verify_layout=None, retrieve_next_token=links,
                           retrieve_next_sibling=links + 1)
    md = b._replay_metadata(4, torch.arange(4), ForwardMode.TARGET_VERIFY, spec, None, num_padding=1)
    assert md.query_start_loc.tolist() == [0, 16, 32, 48, 48]
    assert torch.equal(md.retrieve_next_token[:3], links) and torch.equal(md.retrieve_next_sibling[:3], links + 1)


def test_without_install_the_hybrid_backend_has_one_width():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    b = _hybrid_backend()
    spec = SimpleNamespace(draft_token_num=D, ragged_verify_layout=None)
    md = b._capture_metadata(4, torch.arange(4), ForwardMode.TARGET_VERIFY, spec)
    assert md.query_start_loc.tolist() == list(range(0, 5 * D, D))
    assert tuple(md.retrieve_next_token.shape) == (4, D)


def test_the_env_switch():
    from sglang_ddtree.adapters import v0_5_17_graph_widths as gw

    assert gw.enabled({}) and gw.enabled({gw.ENV: "1"}) and not gw.enabled({gw.ENV: "0"})
    with pytest.raises(ValueError, match=gw.ENV):
        gw.enabled({gw.ENV: "maybe"})


def _is_chain(bucket):
    return contract.budget_for(SCHEDULE, int(bucket)) == contract.CHAIN


@pytest.fixture
def chain_widths():
    from sglang_ddtree.adapters import v0_5_17_graph_widths as gw

    gw.install(_width_of, set(contract.schedule_widths(SCHEDULE, BLOCK).values()), _is_chain)
    try:
        yield gw
    finally:
        gw.uninstall()


def test_a_chain_buckets_graph_is_captured_the_way_dflash_captures_it(chain_widths):
    """The real capture_one_shape of each bucket: while the chain bucket (8) is captured the mask policy is told
    it is a chain bucket, while a tree bucket is captured it is not, and nothing is left marked after."""
    seen = []

    class Probe(Exception):
        pass

    r = _runner()

    def capture_prepare(bs, stream_idx=None, num_tokens=None):
        seen.append((bs, chain_widths.capturing_chain()))
        raise Probe

    r.capture_prepare = capture_prepare
    for bucket in reversed(r.capture_bs):
        with pytest.raises(Probe):
            r.capture_one_shape(bucket, forward=None)
    assert seen == [(8, True), (4, False), (2, False), (1, False)]
    assert not chain_widths.capturing_chain()
    assert chain_widths.is_chain_bucket(8) and not chain_widths.is_chain_bucket(4)


def test_without_chain_buckets_no_capture_is_a_chain_one(widths):
    assert not widths.is_chain_bucket(8) and not widths.capturing_chain()


def test_the_mask_policy_answers_dflashs_own_way_for_a_chain_bucket(chain_widths):
    """0.5.17's worker's mask policy: the tree-mask buffer for a tree bucket's capture, SGLang's own answer
    (causal on Triton) for a chain bucket's, since DFLASH's verify input carries no mask to refill it with."""
    import importlib

    from sglang.srt.speculative import dflash_utils

    mod = importlib.import_module("sglang_ddtree.adapters.v0_5_17_worker")
    triton_like = type("TritonAttnBackend", (), {})()
    original = dflash_utils.resolve_dflash_verify_mask_policy
    try:
        mod._install_tree_mask_capture()
        patched = dflash_utils.resolve_dflash_verify_mask_policy
        assert patched(triton_like) == ("TritonAttnBackend", True)
        chain_widths._STATE["capturing"] = 8
        assert patched(triton_like) == original(triton_like) == ("TritonAttnBackend", False)
        chain_widths._STATE["capturing"] = 4
        assert patched(triton_like) == ("TritonAttnBackend", True)
    finally:
        chain_widths._STATE["capturing"] = None
        dflash_utils.resolve_dflash_verify_mask_policy = original
        mod._TREE_MASK_CAPTURE["installed"] = False


def test_a_chain_buckets_tree_links_are_the_chains_and_a_dflash_replay_keeps_them(chain_widths):
    """The hybrid backend's chain bucket holds the chain's links from the start; a DFLASH verify input (no links)
    replays without touching them, and they are the links the plugin's own one-branch tree has."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    from sglang_ddtree.step import tree_verify_inputs

    b = _hybrid_backend()
    w = _width_of(8)
    want = chain_widths.chain_links(8, w)
    assert want[0].tolist() == list(range(1, w)) + [-1]
    assert torch.equal(b.retrieve_next_token_list[7].to(torch.int64), want)
    assert (b.retrieve_next_sibling_list[7] == -1).all()
    assert not (b.retrieve_next_token_list[3] == chain_widths.chain_links(4, _width_of(4))).all()  # a tree bucket
    spec = DFlashVerifyInput(draft_token=None, positions=None, draft_token_num=w, custom_mask=None)
    md = b._replay_metadata(8, torch.arange(8), ForwardMode.TARGET_VERIFY, spec, None, num_padding=2)
    assert torch.equal(md.retrieve_next_token.to(torch.int64), want)
    # the plugin's own chain step (a sampled batch in a chain bucket) writes the same links
    depths, k = BLOCK - 1, 1
    lp = torch.log_softmax(torch.randn(2, depths, 5), -1).topk(k, dim=-1)
    _, vin = tree_verify_inputs(lp.values.double(), lp.indices, torch.tensor([3, 4]), torch.tensor([10, 20]),
                                BLOCK - 1, 2)  # the topk SGLang is told (>= 2: its tree paths)
    assert torch.equal(vin.retrieve_next_token.view(2, w).to(torch.int64), chain_widths.chain_links(2, w))
    assert (vin.retrieve_next_sibling == -1).all()

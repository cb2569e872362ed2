"""Each adapter's worker calls its SGLang release through the names below: check
them against the INSTALLED SGLang source (AST), for whichever supported version
this interpreter has (the main venv: 0.5.23; .venv-sglang-0.5.17: 0.5.17 - both
run in CI, see tests/test_plugin_sglang_versions.py).  A version's worker is two
files: the shared step (adapters/worker.py, class DDTreeWorkerBase) and that
version's hooks and overrides (adapters/v<version>_worker.py, class DDTreeWorker);
every check reads both.  On 0.5.17 the worker modules also import on a CPU host,
and every attribute they read is checked on the real class hierarchy."""

import ast
import importlib
import inspect
from importlib.metadata import version
from pathlib import Path

import pytest
import sglang

import sglang_ddtree

pytestmark = pytest.mark.sglang_api

ROOT = Path(sglang.__file__).parent
SGLANG = version("sglang")
ADAPTERS = Path(sglang_ddtree.__file__).parent / "adapters"
SHARED = ADAPTERS / "worker.py"  # the step, written once (DDTreeWorkerBase)
VERSIONED = ADAPTERS / f"v{SGLANG.replace('.', '_')}_worker.py"  # this version's DDTreeWorker
WORKER_FILES = (SHARED, VERSIONED)


def _mod(rel):
    return ast.parse((ROOT / rel).read_text())


def _find(tree, qualname):
    node = tree
    for part in qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.name == part)
    return node


def _params(fn):
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def _fields(cls_node):
    return {n.target.id for n in cls_node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


COMMON_CALLS = [
    ("kernels/ops/speculative/cache_locs.py", "assign_extend_cache_locs_func",
     ["req_pool_indices", "req_to_token", "start_offset", "end_offset", "batch_size", "draft_token_num", "device"]),
    ("srt/speculative/eagle_utils.py", "_verify_coins",
     ["sampling_info", "seq_lens", "draft_token_num", "candidates", "device"]),
    ("srt/speculative/dflash_utils.py", "parse_dflash_draft_config", ["draft_hf_config"]),
    ("srt/speculative/draft_worker_common.py", "build_block_pos_offsets", ["length", "device"]),
    ("srt/speculative/draft_worker_common.py", "make_draft_block_spec_info", ["draft_token_num", "device"]),
    ("srt/speculative/dflash_info.py", "DFlashVerifyInput.prepare_for_verify", ["batch", "target_worker"]),
    ("srt/speculative/dflash_info_v2.py", "DFlashDraftInputV2.create_idle_input", ["device"]),
    ("srt/managers/tp_worker.py", "TpModelWorker.forward_batch_generation",
     ["batch", "forward_batch", "is_verify", "skip_attn_backend_init"]),
    ("srt/layers/attention/hybrid_linear_attn_backend.py", "HybridLinearAttnBackend.update_mamba_state_after_mtp_verify",
     ["last_correct_step_indices", "mamba_track_indices", "mamba_steps_to_track", "model", "req_pool_indices"]),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._greedy_sample_from_vocab_parallel_head",
     ["hidden_states", "lm_head", "chunk_size"]),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc",
     ["target_hidden", "cache_loc", "positions", "cache_loc_2d", "commit_lens"]),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._make_next_draft_input_decode",
     ["bonus_tokens", "new_seq_lens"]),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._maybe_build_draft_sampler", []),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2.init_cuda_graphs", []),
]

VERSIONS = {
    "0.5.17": {
        "calls": COMMON_CALLS + [
            ("srt/speculative/eagle_utils.py", "verify_tree_greedy_func",
             ["predicts", "accept_index", "accept_token_num", "candidates", "retrieve_index", "retrieve_next_token",
              "retrieve_next_sibling", "target_predict", "topk"]),
            ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2.forward_batch_generation",
             ["batch", "on_publish", "grammar_barrier"]),
        ],
        "forward_batch_fields": {"forward_mode", "batch_size", "input_ids", "req_pool_indices", "seq_lens",
                                 "out_cache_loc", "seq_lens_sum", "seq_lens_cpu", "positions", "input_embeds",
                                 "spec_algorithm", "spec_info", "capture_hidden_mode"},
        "verify_fields": {"draft_token", "positions", "draft_token_num", "topk", "custom_mask",
                          "capture_hidden_mode"},
        "overrides": {"__init__", "init_cuda_graphs", "_maybe_build_draft_sampler",
                      "_greedy_sample_from_vocab_parallel_head", "forward_batch_generation"},
        "draft_input_fields": {"bonus_tokens", "reserved_seq_lens_cpu", "reserved_seq_lens_sum"},
        # the sgl_kernel ops the sampling path imports, as SGLang 0.5.17 itself imports them
        "sgl_kernel_names": ("top_k_renorm_prob", "top_p_renorm_prob", "tree_speculative_sampling_target_only"),
        "triton_per_forward_width": "num_draft_tokens = int(spec_info.draft_token_num)",
    },
    "0.5.23": {
        "calls": COMMON_CALLS + [
            ("kernels/ops/speculative/spec_tree.py", "verify_tree_greedy_func",
             ["predicts", "accept_index", "accept_token_num", "candidates", "retrieve_index", "retrieve_next_token",
              "retrieve_next_sibling", "target_predict", "topk"]),
            ("kernels/ops/speculative/sampling.py", "tree_speculative_sampling_target_only",
             ["predicts", "accept_index", "accept_token_num", "candidates", "retrive_index", "retrive_next_token",
              "retrive_next_sibling", "uniform_samples", "uniform_samples_for_final_sampling", "target_probs",
              "draft_probs", "threshold_single", "threshold_acc", "deterministic"]),
            ("srt/speculative/dflash_utils.py", "is_dense_head_weight", []),
            ("srt/speculative/dflash_worker_v2.py", "_is_all_greedy", ["sampling_info"]),
            ("srt/speculative/dflash_worker_v2.py", "_resolve_dflash_embedding_module", ["draft_model", "target_model"]),
            ("srt/mem_cache/kv_index_translator.py", "KVIndexTranslator.plan",
             ["req_pool_indices", "seq_lens", "seq_lens_cpu", "write_virtual", "read_extent"]),
            ("srt/mem_cache/kv_loc_plan.py", "KVLocPlan.bind", ["batch", "reader", "cols"]),
            ("srt/speculative/spec_tp_sync.py", "SpecTpSync.sync", ["site", "values"]),
            ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._accept_block",
             ["candidates", "next_token_logits", "sampling_info", "draft_input", "prefix_lens", "bs",
              "target_predict"]),
            ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._draft_write_ids", ["plan"]),
            ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._can_skip_verify_logits",
             ["batch", "sampling_info"]),
            ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._update_target_mamba_state_after_verify",
             ["batch", "seq_lens_pre_verify", "seq_lens_post_verify", "commit_lens"]),
            ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2.forward_batch_generation",
             ["batch", "on_publish", "grammar_barrier", "pp_proxy_tensors"]),
            ("srt/layers/logits_processor.py", "LogitsProcessor.is_deferred_shard", []),
            ("srt/layers/logits_processor.py", "LogitsProcessor.deferred_argmax", []),
            ("srt/layers/logits_processor.py", "LogitsProcessor.finish_deferred_gather", []),
        ],
        "forward_batch_fields": {"forward_mode", "batch_size", "input_ids", "req_pool_indices", "seq_lens",
                                 "out_cache_loc", "seq_lens_sum", "seq_lens_cpu", "positions", "input_embeds",
                                 "spec_algorithm", "spec_info", "capture_hidden_mode", "num_token_non_padded",
                                 "global_num_token_non_padded_cpu", "can_run_decode_cuda_graph"},
        "verify_fields": {"draft_token", "positions", "draft_token_num", "topk", "custom_mask",
                          "capture_hidden_mode", "kv_loc_plan", "kv_loc_cols"},
        "overrides": {"__init__", "init_cuda_graphs", "_maybe_build_draft_sampler",
                      "_update_target_mamba_state_after_verify", "_greedy_sample_from_vocab_parallel_head",
                      "_accept_block", "forward_batch_generation"},
        "draft_input_fields": {"bonus_tokens", "nxt_kv_lens_cpu", "nxt_kv_lens_sum"},
        "sgl_kernel_names": (),
        "triton_per_forward_width": "return spec_info.num_tokens_per_req",
    },
}
V = VERSIONS[SGLANG]


@pytest.mark.parametrize("rel,qualname,names", V["calls"], ids=[c[1] for c in V["calls"]])
def test_called_signatures(rel, qualname, names):
    fn = _find(_mod(rel), qualname)
    assert set(names) <= set(_params(fn)), (qualname, sorted(set(names) - set(_params(fn))))


def test_dataclass_fields_the_worker_sets():
    fb = _fields(_find(_mod("srt/model_executor/forward_batch_info.py"), "ForwardBatch"))
    assert V["forward_batch_fields"] <= fb
    vi = _fields(_find(_mod("srt/speculative/dflash_info.py"), "DFlashVerifyInput"))
    assert V["verify_fields"] <= vi
    di = _fields(_find(_mod("srt/speculative/dflash_info_v2.py"), "DFlashDraftInputV2"))
    assert V["draft_input_fields"] <= di, sorted(V["draft_input_fields"] - di)
    gr = _fields(_find(_mod("srt/managers/utils.py"), "GenerationBatchResult"))
    assert {"logits_output", "next_token_ids", "accept_lens", "can_run_cuda_graph", "next_draft_input",
            "speculative_num_draft_tokens", "new_seq_lens", "cap_lens"} <= gr


def test_sglang_reads_what_the_worker_provides():
    hyb = (ROOT / "srt/layers/attention/hybrid_linear_attn_backend.py").read_text()
    assert "forward_batch.spec_info.retrieve_next_token" in hyb and "if self.topk > 1:" in hyb
    fbi = (ROOT / "srt/model_executor/forward_batch_info.py").read_text()
    assert "ret.positions = ret.spec_info.positions" in fbi  # depth positions reach the eager verify
    proc = (ROOT / "srt/managers/scheduler_components/batch_result_processor.py").read_text()
    assert "next_token_ids[i * stride : i * stride + accept_lens[i]]" in proc
    assert "req.spec_num_cap_tokens += cap_lens[i]" in proc  # shadow-linear report channel
    # the admission hook's target: the scheduler checks every DFLASH-family request with it
    sched = (ROOT / "srt/managers/scheduler.py").read_text()
    assert "validate_dflash_request(req, self.enable_overlap)" in sched
    assert "def validate_dflash_request(req" in (ROOT / "srt/speculative/dflash_utils.py").read_text()
    # the triton backend sizes each TARGET_VERIFY by that forward's own draft_token_num and reads its mask
    tri = (ROOT / "srt/layers/attention/triton_backend.py").read_text()
    assert V["triton_per_forward_width"] in tri


def test_sgl_kernel_names_sglang_imports_too():
    """The sampling path imports these from sgl_kernel exactly as this SGLang does."""
    text = (ROOT / "srt/speculative/eagle_utils.py").read_text() + (ROOT / "srt/speculative/dflash_utils.py").read_text()
    for n in V["sgl_kernel_names"]:
        assert n in text, n


@pytest.mark.parametrize("worker_file", WORKER_FILES, ids=[f.name for f in WORKER_FILES])
def test_worker_imports_resolve_in_sglang_source(worker_file):
    """Every `from sglang... import X` in the worker (shared and this version's) names something
    defined in that module."""
    tree = ast.parse(worker_file.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang."):
            try:  # a real import where this host can (0.5.17 imports on CPU) ...
                mod = importlib.import_module(node.module)
            except Exception:  # ... else the module's source text (0.5.23 needs CUDA-only packages)
                mod = None
            if mod is not None:
                for alias in node.names:
                    assert hasattr(mod, alias.name), (node.module, alias.name)
                continue
            parts = node.module.split(".")[1:]
            path = ROOT.joinpath(*parts)
            f = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
            text = f.read_text()
            for alias in node.names:
                n = alias.name
                assert (f"def {n}" in text or f"class {n}" in text or f"\n{n} =" in text
                        or f"import {n}" in text or f" {n}," in text or f"{n}\n" in text), (node.module, n)


def _worker_classes():
    """The AST class nodes of this version's worker: the shared DDTreeWorkerBase and the version's
    DDTreeWorker, checked to be DFlashWorkerV2 <- DDTreeWorkerBase <- DDTreeWorker."""
    for f in WORKER_FILES:
        compile(f.read_text(), f.name, "exec")
    shared = _find(ast.parse(SHARED.read_text()), "DDTreeWorkerBase")
    versioned = _find(ast.parse(VERSIONED.read_text()), "DDTreeWorker")
    assert [ast.unparse(b) for b in shared.bases] == ["DFlashWorkerV2"]
    assert [ast.unparse(b) for b in versioned.bases] == ["DDTreeWorkerBase"]
    return shared, versioned


def _methods(cls_node) -> dict:
    return {f.name: f for f in cls_node.body if isinstance(f, ast.FunctionDef)}


def test_worker_overrides_match_base_signatures():
    classes = _worker_classes()
    own = set().union(*(_methods(c) for c in classes))
    base = _find(_mod("srt/speculative/dflash_worker_v2.py"), "DFlashWorkerV2")
    base_names = {f.name for f in base.body if isinstance(f, ast.FunctionDef)}
    overrides = own & base_names
    assert overrides == V["overrides"]
    for name in overrides - {"__init__"}:
        theirs = _params(next(f for f in base.body if isinstance(f, ast.FunctionDef) and f.name == name))
        for cls in classes:  # every definition of it, shared or this version's
            if name in _methods(cls):
                assert _params(_methods(cls)[name]) == theirs, (cls.name, name)


def test_every_hook_the_shared_worker_calls_is_this_versions():
    """The shared step reaches the version only through `self._ddtree_*` names: each one it reads
    is defined by this version's DDTreeWorker (or by the shared class itself), also where the
    worker cannot be imported (0.5.23 on CPU); the tree-mask capture hooks exist exactly where the
    adapter's capability allows tree-verify CUDA graphs."""
    from sglang_ddtree.capabilities import load_capabilities

    shared, versioned = _worker_classes()
    hooks = {a for a in _self_attrs_read(shared) if a.startswith("_ddtree_")}
    defined = set(_methods(shared)) | set(_methods(versioned)) | _self_attrs_set(versioned) | {
        t.id for n in versioned.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    graphs = load_capabilities()["per_version"][SGLANG]["tree_verify_cuda_graphs"]
    # called only where the capability allows graphs (the shared step checks it first)
    capture = {"_ddtree_install_tree_mask_capture", "_ddtree_tree_mask_capture_installed"}
    assert capture <= hooks
    required = hooks if graphs else hooks - capture
    assert not sorted(required - defined), sorted(required - defined)
    assert (capture <= set(_methods(versioned))) is graphs
    assert not capture & set(_methods(shared))
    adapter = [ast.unparse(n.value) for n in versioned.body if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "_ddtree_adapter" for t in n.targets)]
    assert adapter == [f"v{SGLANG.replace('.', '_')}"]  # this version's adapter module, not another's


def _self_attrs_read(cls_node) -> set:
    return {n.attr for n in ast.walk(cls_node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
            and isinstance(n.ctx, ast.Load)}


def _self_attrs_set(cls_node) -> set:
    out = set()
    for n in ast.walk(cls_node):
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                for e in ast.walk(t):
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                        out.add(e.attr)
    return out


@pytest.mark.skipif(SGLANG != "0.5.17", reason="only SGLang 0.5.17's DFlash worker imports on a CPU host; "
                    "0.5.23 is checked by the AST tests above")
def test_0517_worker_imports_and_every_attribute_it_reads_exists():
    """On a CPU host with SGLang 0.5.17 the worker module imports for real; every
    `self.X` it reads is set by DFlashWorkerV2.__init__ / BaseSpecWorker, set by the
    DDTree worker itself, or is a method/property of the real class hierarchy."""
    mod = importlib.import_module("sglang_ddtree.adapters.v0_5_17_worker")
    shared_mod = importlib.import_module("sglang_ddtree.adapters.worker")
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    assert issubclass(mod.DDTreeWorker, shared_mod.DDTreeWorkerBase)
    assert issubclass(mod.DDTreeWorker, DFlashWorkerV2)
    classes = _worker_classes()
    base_src = ast.parse((ROOT / "srt/speculative/dflash_worker_v2.py").read_text())
    base_set = _self_attrs_set(_find(base_src, "DFlashWorkerV2"))
    known = base_set | set().union(*(_self_attrs_set(c) for c in classes)) | {
        n for k in mod.DDTreeWorker.__mro__ for n in vars(k)}
    # DFlashWorkerV2.__getattr__ delegates the rest to the target worker: name those explicitly
    delegated = {"target_worker"}
    missing = sorted(set().union(*(_self_attrs_read(c) for c in classes)) - known - delegated)
    assert not missing, missing
    # the verify input carries the tree links the hybrid backend reads
    fields = {f for f in shared_mod.DDTreeVerifyInput.__dataclass_fields__}
    assert {"retrieve_index", "retrieve_next_token", "retrieve_next_sibling", "custom_mask", "topk"} <= fields


@pytest.mark.skipif(SGLANG != "0.5.17", reason="tree-verify CUDA graphs are an SGLang 0.5.17 adapter feature "
                    "(capabilities.json: tree_verify_cuda_graphs); 0.5.23 refuses them (test_plugin.py)")
def test_0517_tree_verify_graph_capture_carries_the_tree_mask():
    """What the 0.5.17 worker relies on to replay tree-verify under CUDA graphs, read from the installed
    SGLang: the decode graph runner asks dflash_utils.resolve_dflash_verify_mask_policy (imported at call
    time, so the worker's policy takes effect) whether to capture with the mask buffer; the Triton backend
    refills that buffer from spec_info.custom_mask at replay and the hybrid backend refills the tree links."""
    runner = (ROOT / "srt/model_executor/runner/decode_cuda_graph_runner.py").read_text()
    get_spec_info = ast.get_source_segment(runner, _find(ast.parse(runner), "DecodeCudaGraphRunner.get_spec_info"))
    assert "from sglang.srt.speculative.dflash_utils import" in get_spec_info
    assert "resolve_dflash_verify_mask_policy(" in get_spec_info and "else self.buffers.custom_mask" in get_spec_info
    tri = (ROOT / "srt/layers/attention/triton_backend.py").read_text()
    assert "custom_mask[: spec_info.custom_mask.shape[0]] = spec_info.custom_mask" in tri
    assert "def verify_mask(self)" in tri
    hyb = (ROOT / "srt/layers/attention/hybrid_linear_attn_backend.py").read_text()
    assert "self.retrieve_next_token_list[bs - 1][:bs_without_pad].copy_(" in hyb

    from sglang.srt.speculative import dflash_utils

    mod = importlib.import_module("sglang_ddtree.adapters.v0_5_17_worker")
    shared_mod = importlib.import_module("sglang_ddtree.adapters.worker")
    triton_like = type("TritonAttnBackend", (), {})()
    hybrid_like = type("HybridLinearAttnBackend", (), {"full_attn_backend": triton_like})()
    original = dflash_utils.resolve_dflash_verify_mask_policy
    assert original(hybrid_like) == ("TritonAttnBackend", False)  # SGLang's own answer: capture causal
    try:
        mod._install_tree_mask_capture()
        mod._install_tree_mask_capture()  # idempotent: wrapped once
        patched = dflash_utils.resolve_dflash_verify_mask_policy
        assert patched(hybrid_like) == ("TritonAttnBackend", True)
        assert patched.__wrapped__ is original
        assert shared_mod._full_attn_backend(hybrid_like) is triton_like
    finally:
        dflash_utils.resolve_dflash_verify_mask_policy = original
        mod._TREE_MASK_CAPTURE["installed"] = False


@pytest.mark.skipif(SGLANG != "0.5.17", reason="only SGLang 0.5.17's DFlash worker imports on a CPU host")
def test_0517_default_glue_level_follows_the_targets_config_not_dflashs_late_flag():
    """The unset glue level is 2 on a dense target and 1 on a hybrid one, decided at __init__ from SGLang's own
    mambaish_config of the target's config: DFlash's _need_mamba_verify_commit is still False there (set when the
    scheduler initialises attention backends), so reading it would put a hybrid target on level 2."""
    from types import SimpleNamespace

    from transformers import Qwen3Config

    from sglang.srt.configs import Qwen3NextConfig
    from sglang_ddtree.glue_graphs import glue_graph_level

    mod = importlib.import_module("sglang_ddtree.adapters.v0_5_17_worker")

    def hybrid(model_config):
        w = object.__new__(mod.DDTreeWorker)
        w.model_runner = SimpleNamespace(model_config=model_config)
        w._need_mamba_verify_commit = False  # as DFlashWorkerV2.__init__ leaves it
        return w._target_has_recurrent_layers()

    dense = SimpleNamespace(hf_config=Qwen3Config(num_hidden_layers=2), linear_attn_registry_result=None)
    gdn = SimpleNamespace(hf_config=Qwen3NextConfig(num_hidden_layers=4), linear_attn_registry_result=None)
    assert hybrid(dense) is False and hybrid(gdn) is True
    assert hybrid(None) is True  # a config it cannot read: the conservative (hybrid) default
    assert glue_graph_level({}, recurrent=hybrid(dense)) == 2 and glue_graph_level({}, recurrent=hybrid(gdn)) == 1
    src = inspect.getsource(mod.DDTreeWorker.__init__) if "__init__" in vars(mod.DDTreeWorker) else \
        inspect.getsource(importlib.import_module("sglang_ddtree.adapters.worker"))
    assert "glue_graph_level(recurrent=hybrid)" in src and "hybrid = self._target_has_recurrent_layers()" in src


@pytest.mark.skipif(SGLANG != "0.5.17", reason="only SGLang 0.5.17's DFlash worker imports on a CPU host; glue "
                    "level 2's recurrent indices are a 0.5.17 adapter feature (0.5.23's hook says None)")
def test_0517_glue_level_two_commits_the_same_recurrent_state_as_level_one():
    """The real 0.5.17 DDTreeWorker's accept (_glue_commit_fn) and recurrent commit (its adapter hook), on CPU with
    a recording stand-in for the hybrid backend and the greedy accept's torch reference for the CUDA kernel: at
    glue level 2 the indices computed in the accept reach update_mamba_state_after_mtp_verify equal to level 1's
    (computed in the commit), int32, also where a track boundary falls inside the accepted path."""
    from types import SimpleNamespace

    import torch

    from sglang_ddtree import step as S
    from sglang_ddtree.tree import rank_draft_tokens

    mod = importlib.import_module("sglang_ddtree.adapters.v0_5_17_worker")
    calls = []

    class RecordingBackend:  # stands in for SGLang's HybridLinearAttnBackend (its Triton scatter needs CUDA)
        def update_mamba_state_after_mtp_verify(self, **kw):
            calls.append(kw)

    def worker(level):
        w = object.__new__(mod.DDTreeWorker)  # no SGLang server behind it: the attributes the two methods read
        w._target_worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=RecordingBackend(), model="M"))
        w.model_runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(
            req_to_token=torch.zeros(4, 256, dtype=torch.int32)))
        w.block_size, w.ddtree = 8, SimpleNamespace(budget=15, topk=2)
        w.accept_stats = S.TreeAcceptStats(7, 1000)
        w._need_mamba_verify_commit = True
        w._glue_track_interval = 4 if level >= 2 else None  # what __init__ sets from the level and the hook
        w._ddtree_mamba_track_interval = lambda batch: 4
        w._ddtree_verify_tree_greedy = lambda **kw: S.tree_accept_greedy_reference(
            kw["candidates"], kw["retrieve_index"], kw["retrieve_next_token"], kw["retrieve_next_sibling"],
            kw["target_predict"], kw["accept_index"].shape[1])
        return w

    g = torch.Generator().manual_seed(3)
    lp = torch.log_softmax(torch.randn(2, 7, 50, generator=g) * 3, -1).double()
    vals, ids = rank_draft_tokens(lp, 15)
    prefix = torch.tensor([10, 13])
    tree, vin = S.tree_verify_inputs(vals, ids, torch.tensor([3, 4]), prefix, 15, 2)
    d = vin.draft_token_num
    window = torch.arange(2 * d).view(2, d) + 100
    pred = torch.roll(vin.draft_token.view(2, d), -1, 1)  # the first branch is right for a while: deep accepts
    batch = SimpleNamespace(mamba_track_indices=torch.tensor([5, 6]), req_pool_indices=torch.tensor([0, 1]))
    commits = []
    for level in (1, 2):
        w = worker(level)
        assert w._recurrent_commit_args() == ({} if level == 1 else {"recurrent": True, "track_interval": 4})
        *_, c = w._glue_commit_fn(pred, vin.draft_token.view(-1, d), vin.retrieve_index, vin.retrieve_next_token,
                                  vin.retrieve_next_sibling, tree.ranks, prefix, window, window,
                                  batch.req_pool_indices)
        w._seq_lens_pre_verify = prefix.clone() if level == 1 else None  # as _tree_verify leaves it
        w._ddtree_commit_recurrent_state(batch, c.new_seq_lens, c)
        commits.append(c)
    one, two = calls
    assert commits[0].recurrent_step is None and two["last_correct_step_indices"] is commits[1].recurrent_step
    assert two["last_correct_step_indices"].dtype == torch.int32 and two["mamba_steps_to_track"].dtype == torch.int32
    for k in ("last_correct_step_indices", "mamba_steps_to_track"):
        assert torch.equal(one[k].long(), two[k].long()), k
    assert (two["mamba_steps_to_track"] >= 0).any()  # a boundary inside the accepted path: the case that matters
    assert one["mamba_track_indices"] is two["mamba_track_indices"] and one["model"] == two["model"] == "M"
    # a commit without the accept's indices (an accept outside graph 2) and no kept pre-verify lengths (level 2
    # keeps none): the commit computes the same indices from the lengths it has
    w = worker(2)
    _, bare = S.accept_commit(*S.tree_accept_greedy_reference(
        vin.draft_token.view(2, d), vin.retrieve_index, vin.retrieve_next_token, vin.retrieve_next_sibling, pred,
        vin.max_tree_depth + 1), tree.ranks, prefix, window, window, vin.max_tree_depth)
    w._seq_lens_pre_verify = None
    w._ddtree_commit_recurrent_state(batch, bare.new_seq_lens, bare)
    for k in ("last_correct_step_indices", "mamba_steps_to_track"):
        assert torch.equal(calls[-1][k].long(), one[k].long()), k
    w._need_mamba_verify_commit = False  # a dense target: no recurrent indices in the accept
    assert w._recurrent_commit_args() == {}
    # where SGLang cannot say at start (its exec config not published: what get_exec() raises then), level 2
    # keeps the indices in the commit instead of failing the server's start
    w = worker(2)

    def unpublished():
        raise ValueError("config namespace 'exec' not published")

    w._ddtree_glue_track_interval = unpublished
    assert w._glue_track_interval_or_none() is None
    got = worker(2)._glue_track_interval_or_none()  # the real hook: an int where published, else None
    assert got is None or (type(got) is int and got >= 0)


@pytest.mark.skipif(SGLANG != "0.5.17", reason="only SGLang 0.5.17's DFlash worker imports on a CPU host")
def test_a_request_is_checked_for_unsupported_features_in_its_first_step_only():
    """The tree-verify step's guard against a request admission should have refused looks at each request once
    (its features are fixed at admission): a batch of requests already seen costs nothing, a new one is looked at,
    and one with an unsupported feature is reported once however many steps it stays."""
    from types import SimpleNamespace

    mod = importlib.import_module("sglang_ddtree.adapters.v0_5_17_worker")
    w = object.__new__(mod.DDTreeWorker)
    w._warned_unsupported = False
    looked = []

    class Req:
        def __init__(self, name, **sp):
            self.name, self.return_logprob, self.sampling_params = name, False, SimpleNamespace(**sp)

        def __getattribute__(self, attr):
            if attr == "sampling_params":
                looked.append(object.__getattribute__(self, "name"))
            return object.__getattribute__(self, attr)

    a, b = Req("a"), Req("b")
    for _ in range(5):
        w._unsupported_in_batch(SimpleNamespace(reqs=[a, b]))
    assert looked == ["a", "b"] and not w._warned_unsupported
    c = Req("c", frequency_penalty=0.5)
    w._unsupported_in_batch(SimpleNamespace(reqs=[a, b, c]))
    assert looked == ["a", "b", "c"] and w._warned_unsupported


@pytest.mark.skipif(SGLANG != "0.5.17", reason="only SGLang 0.5.17's DFlash worker imports on a CPU host; overlap "
                    "scheduling is its adapter's (capabilities.json overlap_schedule)")
def test_0517_overlap_step_orders_the_schedulers_stream_after_its_writes_and_never_syncs_the_mask():
    """Under SGLang's overlap scheduler (what its own DFLASH runs): (1) the FULL mask is sized from the host's
    lengths or the scheduler's reservation, never a device .item(); (2) the target runner's read-done event - what
    the scheduler's stream waits on before it frees or reallocates req_to_token rows - is recorded after the
    accept's window write into req_to_token and the commit's recurrent-state and drafter-KV writes (the end of the
    step), not at the verify graph's load where SGLang records it (a request that finished a step ago is still in
    this batch under overlap); (3) a drafter block wider than D is refused."""
    from types import SimpleNamespace

    import torch

    mod = importlib.import_module("sglang_ddtree.adapters.v0_5_17_worker")

    class NoItem(torch.Tensor):  # a "device" length tensor whose host read would be a sync
        def item(self):
            raise AssertionError("device sync: .item() of the prefix lengths")

    w = object.__new__(mod.DDTreeWorker)
    draft_input = SimpleNamespace(reserved_seq_lens_cpu=torch.tensor([40, 52]), reserved_seq_lens_sum=92)
    exact = SimpleNamespace(seq_lens_cpu=torch.tensor([10, 13]), seq_lens_sum=23)
    assert w._host_prefix_sum(exact, draft_input) == 23
    assert w._host_prefix_sum(SimpleNamespace(seq_lens_cpu=torch.tensor([10, 13]), seq_lens_sum=None),
                              draft_input) == 23
    assert w._host_prefix_sum(SimpleNamespace(seq_lens_cpu=None, seq_lens_sum=None), draft_input) == 92
    from sglang_ddtree.compile import full_mask_layout

    dev_prefix = torch.tensor([10, 13]).as_subclass(NoItem)
    tree_mask = torch.eye(4, dtype=torch.bool).expand(2, 4, 4).contiguous()
    exact_mask = full_mask_layout(tree_mask, torch.tensor([10, 13]))
    bound_mask = full_mask_layout(tree_mask, dev_prefix, 92)  # the reservation: longer, equal where read
    assert torch.equal(bound_mask[: exact_mask.numel()], exact_mask) and bound_mask[exact_mask.numel():].all()
    with pytest.raises(AssertionError, match="device sync"):  # what a missing host sum would cost
        full_mask_layout(tree_mask, dev_prefix)

    # (2) the event, and where the step records it
    runner = SimpleNamespace(war_fastpath_read_done_event="set at the verify graph's load")
    w._target_worker = SimpleNamespace(model_runner=runner)
    w.device = "cpu"
    w._overlap = False
    w._shared_writes_done()
    assert runner.war_fastpath_read_done_event == "set at the verify graph's load"  # synchronous: untouched
    w._overlap = True
    w._shared_writes_done()
    assert isinstance(runner.war_fastpath_read_done_event, torch.cpu.Event)

    order = []
    d = 4
    vin = SimpleNamespace(draft_token_num=d, draft_token=torch.zeros(2 * d, dtype=torch.long), retrieve_index=None,
                          retrieve_next_token=None, retrieve_next_sibling=None)
    batch = SimpleNamespace(spec_info=object(), seq_lens=torch.tensor([10, 13]), req_pool_indices=torch.tensor([0, 1]),
                            reqs=[], sampling_info=None)
    batch.seq_lens.record_stream = lambda s: None
    w._warned_unsupported = True
    w._tree_draft = lambda b: SimpleNamespace(window=torch.zeros(2, 2 * d, dtype=torch.long))
    w._tree_verify = lambda b, dr: (SimpleNamespace(ranks=None), vin, SimpleNamespace(logits_output=None), None)
    w._ddtree_draft_window_ids = lambda dr, win: win
    w._greedy_target_predict = lambda *a: torch.zeros(2, d, dtype=torch.long)
    w._glue_commit = lambda *a: order.append("accept + window write into req_to_token") or (None,) * 4 + ("c",)
    w.accept_stats = SimpleNamespace(add=lambda counts: None)
    real = mod.DDTreeWorker._shared_writes_done.__get__(w)
    w._shared_writes_done = lambda: order.append("read-done event") or real()
    w._tree_commit = lambda *a: order.append("commit (publish, drafter KV)") or "result"
    assert w._forward_tree_verify(batch, None) == "result"
    assert order == ["accept + window write into req_to_token", "commit (publish, drafter KV)", "read-done event"]

    # (3) the worker refuses what the validator would not have allowed
    w.ddtree = SimpleNamespace(num_draft_tokens=8, drafter_block_size=16)
    with pytest.raises(ValueError, match=r"drafter block \(16\) <= D = 8"):
        w._init_tree_verify()


@pytest.mark.skipif(SGLANG != "0.5.17", reason="only SGLang 0.5.17's DFlash worker imports on a CPU host; chain "
                    "buckets captured DFLASH's way are its adapter's (v0_5_17_graph_widths)")
def test_a_schedules_chain_steps_are_dflashs_own_step_where_their_graph_was_captured_for_it():
    """A decode step whose batch's schedule entry is chain, in a captured chain bucket, all greedy, is SGLang's own
    DFlashWorkerV2 step; a tree entry, a sampled batch, or a batch past the largest bucket (eager) is the
    plugin's tree-verify step; SGLANG_DDTREE_CHAIN_STEP=plugin keeps every step the plugin's."""
    from types import SimpleNamespace

    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_ddtree import contract
    from sglang_ddtree.adapters import v0_5_17_graph_widths as gw

    mod = importlib.import_module("sglang_ddtree.adapters.v0_5_17_worker")
    shared_mod = importlib.import_module("sglang_ddtree.adapters.worker")
    sched = contract.parse_budget("1:31,4:15,16:chain")
    w = object.__new__(mod.DDTreeWorker)
    w.ddtree = SimpleNamespace(mode=shared_mod.TREE_VERIFY, schedule=sched)
    w.block_size, w._chain_dflash, w._bucket_widths_on = 8, True, True
    w._graph_buckets = (1, 2, 4, 8, 16, 32)
    w.chain_steps = {"dflash": 0, "plugin": 0}
    calls = []
    w._forward_tree_verify = lambda batch, on_publish: calls.append(("plugin", len(batch.seq_lens))) or "plugin"
    original = DFlashWorkerV2.forward_batch_generation

    def dflash(self, batch, on_publish=None, grammar_barrier=None):
        calls.append(("dflash", len(batch.seq_lens)))
        return "dflash"

    def batch(bs, greedy=True):
        return SimpleNamespace(seq_lens=[0] * bs, forward_mode=SimpleNamespace(is_extend=lambda: False,
                               is_idle=lambda: False), is_extend_in_batch=False,
                               sampling_info=SimpleNamespace(is_all_greedy=greedy))

    gw.install(w._width_at, set(contract.schedule_widths(sched, 8).values()), w._chain_at)
    DFlashWorkerV2.forward_batch_generation = dflash
    try:
        got = [w.forward_batch_generation(batch(bs)) for bs in (1, 4, 9, 16, 20, 32, 40)]
        # 9 pads to bucket 16 (a chain bucket); 40 is past the largest bucket (eager: the plugin's chain)
        assert got == ["plugin", "plugin", "dflash", "dflash", "dflash", "dflash", "plugin"]
        assert w.forward_batch_generation(batch(16, greedy=False)) == "plugin"  # sampled: the plugin's chain
        assert w.chain_steps == {"dflash": 4, "plugin": 2}
        w._chain_dflash = False
        assert w.forward_batch_generation(batch(16)) == "plugin"
    finally:
        DFlashWorkerV2.forward_batch_generation = original
        gw.uninstall()
    # unset: the adapter's default (capabilities.json dflash_chain_step); set: what it says
    assert shared_mod.chain_step_from_env({}) == "plugin"
    assert shared_mod.chain_step_from_env({}, default="dflash") == "dflash"
    assert shared_mod.chain_step_from_env({shared_mod.CHAIN_STEP_ENV: "plugin"}, default="dflash") == "plugin"
    assert shared_mod.chain_step_from_env({shared_mod.CHAIN_STEP_ENV: "DFlash "}) == "dflash"
    from sglang_ddtree.adapters import v0_5_17
    from sglang_ddtree.capabilities import load_capabilities

    assert v0_5_17.DFLASH_CHAIN_STEP is bool(load_capabilities()["per_version"]["0.5.17"]["dflash_chain_step"])
    with pytest.raises(ValueError, match=shared_mod.CHAIN_STEP_ENV):
        shared_mod.chain_step_from_env({shared_mod.CHAIN_STEP_ENV: "eagle"})

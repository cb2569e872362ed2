"""The worker (unrun: it does not import on a CPU host) calls SGLang 0.5.23 through
the names below; check each against the installed SGLang source (AST only)."""

import ast
from pathlib import Path

import pytest
import sglang

import sglang_ddtree

ROOT = Path(sglang.__file__).parent
WORKER = Path(sglang_ddtree.__file__).with_name("worker.py")


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


CALLS = [  # (file, qualname, keyword/positional names the worker passes)
    ("kernels/ops/speculative/cache_locs.py", "assign_extend_cache_locs_func",
     ["req_pool_indices", "req_to_token", "start_offset", "end_offset", "batch_size", "draft_token_num", "device"]),
    ("kernels/ops/speculative/spec_tree.py", "verify_tree_greedy_func",
     ["predicts", "accept_index", "accept_token_num", "candidates", "retrieve_index", "retrieve_next_token",
      "retrieve_next_sibling", "target_predict", "topk"]),
    ("kernels/ops/speculative/sampling.py", "tree_speculative_sampling_target_only",
     ["predicts", "accept_index", "accept_token_num", "candidates", "retrive_index", "retrive_next_token",
      "retrive_next_sibling", "uniform_samples", "uniform_samples_for_final_sampling", "target_probs",
      "draft_probs", "threshold_single", "threshold_acc", "deterministic"]),
    ("kernels/ops/sampling/__init__.py", "softmax", ["logits", "temperatures"]),
    ("srt/speculative/eagle_utils.py", "_verify_coins",
     ["sampling_info", "seq_lens", "draft_token_num", "candidates", "device"]),
    ("srt/speculative/dflash_utils.py", "is_dense_head_weight", []),
    ("srt/speculative/dflash_utils.py", "parse_dflash_draft_config", ["draft_hf_config"]),
    ("srt/speculative/dflash_worker_v2.py", "_is_all_greedy", ["sampling_info"]),
    ("srt/speculative/dflash_worker_v2.py", "_resolve_dflash_embedding_module", ["draft_model", "target_model"]),
    ("srt/speculative/draft_worker_common.py", "build_block_pos_offsets", ["length", "device"]),
    ("srt/speculative/draft_worker_common.py", "make_draft_block_spec_info", ["draft_token_num", "device"]),
    ("srt/speculative/dflash_info.py", "DFlashVerifyInput.prepare_for_verify", ["batch", "target_worker"]),
    ("srt/speculative/dflash_info_v2.py", "DFlashDraftInputV2.create_idle_input", ["device"]),
    ("srt/mem_cache/kv_index_translator.py", "KVIndexTranslator.plan",
     ["req_pool_indices", "seq_lens", "seq_lens_cpu", "write_virtual", "read_extent"]),
    ("srt/mem_cache/kv_loc_plan.py", "KVLocPlan.bind", ["batch", "reader", "cols"]),
    ("srt/managers/tp_worker.py", "TpModelWorker.forward_batch_generation",
     ["batch", "forward_batch", "is_verify", "skip_attn_backend_init"]),
    ("srt/layers/attention/hybrid_linear_attn_backend.py", "HybridLinearAttnBackend.update_mamba_state_after_mtp_verify",
     ["last_correct_step_indices", "mamba_track_indices", "mamba_steps_to_track", "model", "req_pool_indices"]),
    ("srt/speculative/spec_tp_sync.py", "SpecTpSync.sync", ["site", "values"]),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._greedy_sample_from_vocab_parallel_head",
     ["hidden_states", "lm_head", "chunk_size"]),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._accept_block",
     ["candidates", "next_token_logits", "sampling_info", "draft_input", "prefix_lens", "bs", "target_predict"]),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc",
     ["target_hidden", "cache_loc", "positions", "cache_loc_2d", "commit_lens"]),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._make_next_draft_input_decode",
     ["bonus_tokens", "new_seq_lens"]),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._draft_write_ids", ["plan"]),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._can_skip_verify_logits", ["batch", "sampling_info"]),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._maybe_build_draft_sampler", []),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2._update_target_mamba_state_after_verify",
     ["batch", "seq_lens_pre_verify", "seq_lens_post_verify", "commit_lens"]),
    ("srt/speculative/dflash_worker_v2.py", "DFlashWorkerV2.forward_batch_generation",
     ["batch", "on_publish", "grammar_barrier", "pp_proxy_tensors"]),
    ("srt/layers/logits_processor.py", "LogitsProcessor.is_deferred_shard", []),
    ("srt/layers/logits_processor.py", "LogitsProcessor.deferred_argmax", []),
    ("srt/layers/logits_processor.py", "LogitsProcessor.finish_deferred_gather", []),
]


@pytest.mark.parametrize("rel,qualname,names", CALLS, ids=[c[1] for c in CALLS])
def test_called_signatures(rel, qualname, names):
    fn = _find(_mod(rel), qualname)
    assert set(names) <= set(_params(fn)), (qualname, sorted(set(names) - set(_params(fn))))


def test_renorm_names_exported():
    # conditional imports (flashinfer / triton), called positionally like eagle_utils does
    text = (ROOT / "kernels/ops/sampling/renorm.py").read_text()
    assert "top_k_renorm_prob =" in text and "top_p_renorm_prob =" in text


def test_dataclass_fields_the_worker_sets():
    fb = _fields(_find(_mod("srt/model_executor/forward_batch_info.py"), "ForwardBatch"))
    assert {"forward_mode", "batch_size", "input_ids", "req_pool_indices", "seq_lens", "out_cache_loc",
            "seq_lens_sum", "seq_lens_cpu", "positions", "input_embeds", "spec_algorithm", "spec_info",
            "capture_hidden_mode", "num_token_non_padded", "global_num_token_non_padded_cpu",
            "can_run_decode_cuda_graph"} <= fb
    vi = _fields(_find(_mod("srt/speculative/dflash_info.py"), "DFlashVerifyInput"))
    assert {"draft_token", "positions", "draft_token_num", "topk", "custom_mask", "capture_hidden_mode",
            "kv_loc_plan", "kv_loc_cols"} <= vi
    gr = _fields(_find(_mod("srt/managers/utils.py"), "GenerationBatchResult"))
    assert {"logits_output", "next_token_ids", "accept_lens", "can_run_cuda_graph", "next_draft_input",
            "speculative_num_draft_tokens", "new_seq_lens", "routed_experts_output", "indexer_topk_output",
            "cap_lens"} <= gr


def test_worker_attributes_exist_on_dflash_worker():
    src = (ROOT / "srt/speculative/dflash_worker_v2.py").read_text()
    for attr in ("selector", "lilicorr", "_is_domino", "use_compact_draft_cache", "block_size", "draft_model",
                 "_mask_token_id", "_full_embed_gpu", "_noise_embed_scale", "_block_pos_offsets",
                 "_draft_block_spec_info", "speculative_num_draft_tokens", "_target_logits_processor",
                 "_tp_sync", "draft_parallel_layout", "draft_model_runner", "_need_mamba_verify_commit"):
        assert f"self.{attr} =" in src, attr
    assert "def set_block_size" in (ROOT / "srt/models/dflash.py").read_text()


def test_sglang_reads_what_the_worker_provides():
    hyb = (ROOT / "srt/layers/attention/hybrid_linear_attn_backend.py").read_text()
    assert "forward_batch.spec_info.retrieve_next_token" in hyb and "if self.topk > 1:" in hyb
    fbi = (ROOT / "srt/model_executor/forward_batch_info.py").read_text()
    assert "ret.positions = ret.spec_info.positions" in fbi  # depth positions reach the eager verify
    sites = (ROOT / "srt/speculative/spec_tp_sync.py").read_text()
    assert "DFLASH_ACCEPT_GREEDY" in sites and "DFLASH_ACCEPT_SAMPLE" in sites
    proc = (ROOT / "srt/managers/scheduler_components/batch_result_processor.py").read_text()
    assert "next_token_ids[i * stride : i * stride + accept_lens[i]]" in proc
    assert "req.spec_num_cap_tokens += cap_lens[i]" in proc  # shadow-linear report channel
    for name in ("mamba_track_grid", "get_parallel"):
        assert f"def {name}" in (ROOT / "srt/runtime_context.py").read_text()
    assert "def draft_tp_context" in (ROOT / "srt/speculative/spec_utils.py").read_text()


def test_worker_imports_resolve_in_sglang_source():
    """Every `from sglang... import X` in worker.py names something defined in that module."""
    tree = ast.parse(WORKER.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang."):
            parts = node.module.split(".")[1:]
            path = ROOT.joinpath(*parts)
            f = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
            text = f.read_text()
            for alias in node.names:
                n = alias.name
                assert (f"def {n}" in text or f"class {n}" in text or f"\n{n} =" in text
                        or f"import {n}" in text or f" {n}," in text or f"{n}\n" in text), (node.module, n)


def test_worker_compiles_and_overrides_exist():
    src = WORKER.read_text()
    compile(src, "worker.py", "exec")
    cls = _find(ast.parse(src), "DDTreeWorker")
    own = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    base = _find(_mod("srt/speculative/dflash_worker_v2.py"), "DFlashWorkerV2")
    base_names = {f.name for f in base.body if isinstance(f, ast.FunctionDef)}
    overrides = own & base_names
    assert overrides == {"__init__", "_maybe_build_draft_sampler", "_update_target_mamba_state_after_verify",
                         "_greedy_sample_from_vocab_parallel_head", "_accept_block", "forward_batch_generation"}
    for name in overrides - {"__init__"}:
        mine = _params(next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == name))
        theirs = _params(next(f for f in base.body if isinstance(f, ast.FunctionDef) and f.name == name))
        assert mine == theirs, name

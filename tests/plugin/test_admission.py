"""Request admission for DDTREE (sglang_ddtree.admission, adapters.common): pure rules, and the hook
on the real SGLang's validate_dflash_request that the scheduler calls for every new request."""

import types

import pytest

from sglang_ddtree import admission
from sglang_ddtree.adapters import common


def _req(return_logprob=False, custom_logit_processor=None, max_new_tokens=8, **sp):
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, **sp)
    return types.SimpleNamespace(sampling_params=params, return_logprob=return_logprob,
                                 custom_logit_processor=custom_logit_processor, grammar=None,
                                 return_hidden_states=False)


SERVED = [dict(), dict(temperature=0.0), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=20),
          dict(temperature=1.0, min_p=0.05), dict(stop_token_ids=[5])]
REJECTED = [
    (dict(return_logprob=True), "return_logprob"),
    (dict(frequency_penalty=0.5), "frequency_penalty"),
    (dict(presence_penalty=-0.2), "presence_penalty"),
    (dict(repetition_penalty=1.1), "repetition_penalty"),
    (dict(min_new_tokens=4), "min_new_tokens"),
    (dict(logit_bias={"7": 2.0}), "logit_bias"),
    (dict(json_schema='{"type": "object"}'), "grammar (json_schema)"),
    (dict(regex="[ab]+"), "grammar (regex)"),
    (dict(custom_logit_processor="serialized"), "custom_logit_processor"),
]


@pytest.mark.parametrize("sp", SERVED)
def test_tree_verify_serves_plain_sampling(sp):
    assert admission.tree_verify_rejection(_req(**sp)) is None


@pytest.mark.parametrize("kw,what", REJECTED, ids=[r[1] for r in REJECTED])
def test_tree_verify_rejects_chain_only_features_with_the_reason(kw, what):
    msg = admission.tree_verify_rejection(_req(**kw))
    assert msg and msg.startswith("DDTREE tree-verify does not support ") and what in msg


def test_several_features_named_together_and_other_modes_admit():
    msg = admission.rejection("tree-verify", _req(return_logprob=True, frequency_penalty=0.3))
    assert "return_logprob" in msg and "frequency_penalty" in msg
    assert admission.rejection("shadow-linear", _req(frequency_penalty=0.3)) is None
    assert admission.rejection(None, _req(frequency_penalty=0.3)) is None  # no DDTREE worker here


def test_after_hook_keeps_sglangs_own_verdict():
    common.set_active_mode("tree-verify")
    try:
        assert common.admission_after_hook("SGLang says no", _req()) == "SGLang says no"
        assert common.admission_after_hook(None, _req()) is None
        assert "frequency_penalty" in common.admission_after_hook(None, _req(frequency_penalty=1.0), False)
    finally:
        common.set_active_mode(None)


DFLASH_NO = "DFLASH speculative decoding does not support return_logprob yet."


def test_prefill_only_logprob_request_is_admitted_in_every_mode():
    """max_new_tokens 0 with return_logprob (the gate canary's re-score: the target's own forward) is served;
    logprobs with generation stay refused, in tree-verify by DDTREE and elsewhere by SGLang's DFLASH verdict."""
    prefill = _req(return_logprob=True, max_new_tokens=0)
    assert admission.prefill_only_logprob(prefill) and not admission.prefill_only_logprob(_req(return_logprob=True))
    assert admission.tree_verify_rejection(prefill) is None
    assert "return_logprob" in admission.tree_verify_rejection(_req(return_logprob=True))
    assert "frequency_penalty" in admission.tree_verify_rejection(
        _req(return_logprob=True, max_new_tokens=0, frequency_penalty=0.5))
    for mode in ("tree-verify", "shadow-linear", None):
        common.set_active_mode(mode)
        try:
            assert common.admission_after_hook(DFLASH_NO, prefill, False) is None, mode
            assert common.admission_after_hook(DFLASH_NO, _req(return_logprob=True), False) is not None, mode
        finally:
            common.set_active_mode(None)
    hidden = _req(return_logprob=True, max_new_tokens=0)
    hidden.return_hidden_states = True  # SGLang's other refusal still holds under the overlap scheduler
    assert admission.dflash_verdict(DFLASH_NO, hidden, True) == DFLASH_NO
    assert admission.dflash_verdict(DFLASH_NO, hidden, False) is None


@pytest.mark.sglang_api
def test_hook_admits_the_prefill_only_logprob_request_through_sglangs_validator():
    """Through SGLang's real validate_dflash_request (0.5.17's refuses every return_logprob) with the hook
    `register` installs: the prefill-only request passes, logprobs with generation are refused in tree-verify."""
    import subprocess
    import sys

    code = (
        "import types\n"
        "from sglang_ddtree.adapters import common\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry, HookType\n"
        "HookRegistry.register(common.ADMISSION_TARGET, common.admission_around_hook, HookType.AROUND)\n"
        "HookRegistry.apply_hooks()\n"
        "import sglang.srt.speculative.dflash_utils as du\n"
        "from sglang.srt.sampling.sampling_params import SamplingParams\n"
        "def req(n):\n"
        "    return types.SimpleNamespace(sampling_params=SamplingParams(max_new_tokens=n), return_logprob=True,\n"
        "                                 custom_logit_processor=None, grammar=None, return_hidden_states=False)\n"
        "common.set_active_mode('tree-verify')\n"
        "print('prefill', du.validate_dflash_request(req(0), False))\n"
        "print('generate', du.validate_dflash_request(req(4), False))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("prefill", "generate")))
    assert lines["prefill"] == "None"
    assert "return_logprob" in lines["generate"]


@pytest.mark.sglang_api
def test_hook_patches_the_function_the_scheduler_calls():
    """Through SGLang's real HookRegistry: the scheduler module's validate_dflash_request
    (what Scheduler.handle_generate_request calls) carries DDTREE's rule once registered."""
    import subprocess
    import sys

    code = (
        "import types\n"
        "from sglang_ddtree.adapters import common\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry, HookType\n"
        "HookRegistry.register(common.ADMISSION_TARGET, common.admission_after_hook, HookType.AFTER)\n"
        "HookRegistry.apply_hooks()\n"
        "import sglang.srt.speculative.dflash_utils as du\n"
        "from sglang.srt.sampling.sampling_params import SamplingParams\n"
        "req = types.SimpleNamespace(sampling_params=SamplingParams(frequency_penalty=0.5), return_logprob=False,\n"
        "                            custom_logit_processor=None, grammar=None, return_hidden_states=False)\n"
        "print('before', du.validate_dflash_request(req, False))\n"
        "common.set_active_mode('tree-verify')\n"
        "print('after', du.validate_dflash_request(req, False))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("before", "after")))
    assert lines["before"] == "None"
    assert "DDTREE tree-verify does not support frequency_penalty" in lines["after"]


class _Target:
    def __init__(self):
        self.seen = []

    def forward_batch_generation(self, batch, *args, **kwargs):
        self.seen.append(batch.return_logprob)
        return "target out"


def _dflash_prefill(batch, target):
    """SGLang 0.5.17's DFlashWorkerV2.forward_batch_generation of a prefill, reduced to what matters here."""
    if getattr(batch, "return_logprob", False):
        raise ValueError("DFLASH speculative decoding does not support return_logprob yet.")
    return target.forward_batch_generation(batch, capture_hidden_mode="FULL")


def test_a_prefill_with_logprobs_reaches_the_targets_forward_past_dflashs_check():
    target = _Target()
    batch = types.SimpleNamespace(return_logprob=True)
    with pytest.raises(ValueError):
        _dflash_prefill(batch, target)
    with admission.logprobs_past_dflash(batch, target):
        assert _dflash_prefill(batch, target) == "target out"
    assert target.seen == [True] and batch.return_logprob is True  # the target computed the logprobs
    assert "forward_batch_generation" not in vars(target)  # the method is the class's again
    plain = types.SimpleNamespace(return_logprob=False)
    with admission.logprobs_past_dflash(plain, target):
        _dflash_prefill(plain, target)
    assert target.seen == [True, False] and plain.return_logprob is False
    with pytest.raises(RuntimeError):  # an error inside still puts everything back
        with admission.logprobs_past_dflash(batch, target):
            raise RuntimeError("boom")
    assert batch.return_logprob is True and "forward_batch_generation" not in vars(target)


def test_sglangs_own_dflash_prefill_reaches_the_target_with_logprobs():
    """SGLang's real DFlashWorkerV2.forward_batch_generation (0.5.17's raises on return_logprob), run on a stand-in
    worker and batch up to the target's forward: under logprobs_past_dflash the target gets the batch with
    return_logprob set (what happens after the target's forward needs a GPU)."""
    try:
        from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    except Exception as exc:  # noqa: BLE001 - 0.5.23's worker does not import on a CPU host
        pytest.skip(f"SGLang's DFlash worker does not import here: {type(exc).__name__}")

    class Stop(Exception):
        pass

    class Target:
        seen = []

        def forward_batch_generation(self, batch, *args, **kwargs):
            self.seen.append(batch.return_logprob)
            raise Stop

    mode = types.SimpleNamespace(is_extend=lambda: True, is_idle=lambda: False)
    batch = types.SimpleNamespace(return_logprob=True, forward_mode=mode, is_extend_in_batch=True)
    worker = types.SimpleNamespace(target_worker=Target(), _validate_phase1_sampling_support=lambda b: None)
    try:
        DFlashWorkerV2.forward_batch_generation(worker, batch)
    except ValueError as exc:
        assert "return_logprob" in str(exc)
    except Exception:  # noqa: BLE001 - a DFlash worker that does not refuse logprobs (0.5.23) goes on
        pytest.skip("this SGLang's DFlash worker does not refuse logprobs")
    with pytest.raises(Stop):
        with admission.logprobs_past_dflash(batch, worker.target_worker):
            DFlashWorkerV2.forward_batch_generation(worker, batch)
    assert Target.seen == [True] and batch.return_logprob is True

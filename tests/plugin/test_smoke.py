"""The smoke test's pure parts (sglang_ddtree_tools.smoke), and its refusal on a host without a GPU."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from sglang_ddtree_tools import smoke


def test_lossless_stats_counts_violations_beyond_the_margin():
    outs = [[5, 6, 7], [8, 9]]
    rescored = [[(-0.1, -0.1, 5), (-0.52, -0.50, 4), (-3.0, -1.0, 1)],  # exact, near-tie (0.02), violation (2.0)
                [(-0.2, -0.2, 8), (-0.3, -0.3, 9)]]
    st = smoke.lossless_stats(outs, rescored, margin=0.05)
    assert (st["tokens"], st["off_argmax"], st["violations"]) == (5, 2, 1)
    assert st["worst_violation"] == {"prompt": 0, "position": 2, "token": 7, "argmax": 1, "gap": 2.0}
    assert smoke.lossless_stats(outs, rescored, margin=3.0)["violations"] == 0
    assert st["off_argmax_gaps"] == {"<=0.01": 0, "<=0.07": 1, "<=0.5": 0, ">0.5": 1}
    with pytest.raises(ValueError, match="re-scored"):
        smoke.lossless_stats(outs, [rescored[0][:2], rescored[1]])


def test_gap_buckets_tell_one_bf16_step_from_a_wrong_token():
    outs = [[1, 2, 3, 4]]
    # off by 0.0 (a tie), by 0.0625 (one bf16 step of a logit in [8, 16)), by 0.3, by 4.0
    rescored = [[(-1.0, -1.0, 9), (-1.0625, -1.0, 9), (-1.3, -1.0, 9), (-5.0, -1.0, 9)]]
    st = smoke.lossless_stats(outs, rescored, margin=0.05)
    assert st["off_argmax_gaps"] == {"<=0.01": 1, "<=0.07": 1, "<=0.5": 1, ">0.5": 1}
    assert st["violations"] == 3 and sum(st["off_argmax_gaps"].values()) == st["off_argmax"] == 4


def test_exact_match_and_prompts():
    assert smoke.exact_match([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == {
        "identical": 1, "prompts": 2, "mean_first_divergence": 1.0}
    assert smoke.make_prompts(3, seed=9) == smoke.make_prompts(3, seed=9) != smoke.make_prompts(3, seed=8)
    assert all(len(p) == 12 and all(100 <= t < 31000 for t in p) for p in smoke.make_prompts(4))


@pytest.mark.sglang_api
@pytest.mark.parametrize("mode", smoke.MODES)
def test_server_argv_parses_with_sglangs_real_parser(mode):
    from sglang.srt.server_args import ServerArgs

    spec = smoke.ServerSpec(mode, "/m/target", None if mode == "plain" else "/m/drafter", budget=31,
                            max_total_tokens=65536, max_mamba_cache=48)
    argv = smoke.server_argv("/venv/bin/python", spec, 31234)
    assert argv[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(argv[3:])
    assert (ns.host, ns.port, ns.attention_backend, ns.skip_tokenizer_init) == ("127.0.0.1", 31234, "triton", True)
    assert (ns.max_total_tokens, ns.max_mamba_cache_size) == (65536, 48)
    want = {"plain": None, "dflash": ("DFLASH", 8), "linear": ("DFLASH", 8), "shadow-linear": ("DDTREE", 8),
            "tree-verify": ("DDTREE", 32)}[mode]
    width = ns.speculative_num_draft_tokens if mode == "tree-verify" else ns.speculative_dflash_block_size
    got = None if ns.speculative_algorithm is None else (ns.speculative_algorithm, width)
    assert got == want
    env = smoke.server_env(spec, 3, base={"PATH": "/bin", "SGLANG_DDTREE_BUDGET": "99"})
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    if mode in ("tree-verify", "shadow-linear"):
        assert (env["SGLANG_PLUGINS"], env["SGLANG_DDTREE_MODE"], env["SGLANG_DDTREE_BUDGET"]) == ("ddtree", mode, "31")
    else:
        assert "SGLANG_DDTREE_BUDGET" not in env and "SGLANG_DDTREE_MODE" not in env


def test_server_argv_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="needs a drafter"):
        smoke.server_argv("python", smoke.ServerSpec("tree-verify", "/m"), 1)
    with pytest.raises(ValueError, match="unknown mode"):
        smoke.server_argv("python", smoke.ServerSpec("beam", "/m", "/d"), 1)


def test_gpu_device_problem(tmp_path):
    assert "no GPU device" in smoke.gpu_device_problem(0, dev=str(tmp_path))
    (tmp_path / "nvidiactl").touch()
    (tmp_path / "nvidia1").touch()
    assert smoke.gpu_device_problem(1, dev=str(tmp_path)) is None
    assert "nvidia0" in smoke.gpu_device_problem(0, dev=str(tmp_path))


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="this host has a GPU; the refusal is for hosts without one")
def test_cli_on_a_host_without_gpu_says_so_and_exits_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sglang_ddtree_tools.smoke", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == smoke.EXIT_CANNOT_RUN == 2
    assert "cannot run: no GPU device /dev/nvidiactl or /dev/nvidia0" in out.stderr
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is False


def test_shared_gpu_fraction_covers_what_others_use():
    assert smoke.shared_gpu_fraction(0, 143771) == round(4096 / 143771, 3) or smoke.shared_gpu_fraction(0, 143771) == 0.1
    f = smoke.shared_gpu_fraction(0.85 * 143771, 143771)
    assert 0.85 < f <= 0.97 and (f * 143771 - 0.85 * 143771) >= 4000
    assert smoke.shared_gpu_fraction(140000, 143771) == 0.97


def test_pool_caps_reach_the_command_line():
    spec = smoke.ServerSpec("tree-verify", "/m", "/d", max_total_tokens=65536, max_mamba_cache=48)
    argv = smoke.server_argv("python", spec, 1)
    assert argv[argv.index("--max-total-tokens") + 1] == "65536"
    assert argv[argv.index("--max-mamba-cache-size") + 1] == "48"
    assert "--max-mamba-cache-size" not in smoke.server_argv("python", smoke.ServerSpec("plain", "/m"), 1)


def test_a_lost_port_race_is_told_from_a_servers_own_failure():
    """Two matrices side by side on one host: a server can lose the port free_port() found to a server of the
    other process. That start is retried on a new port (serve_matrix); any other start failure is not."""
    from sglang_ddtree_tools.servers import lost_port_race

    # the tail of that server's log, as captured on the H200
    lost = ("[2026-12-03 11:54:23] INFO:     Application startup complete.\n"
            "[2026-12-03 11:54:23] ERROR:    [Errno 98] error while attempting to bind on address "
            "('127.0.0.1', 37923): address already in use\n"
            "[2026-12-03 11:54:23] INFO:     Waiting for application shutdown.")
    assert lost_port_race("server exited during start-up:\n" + lost)
    own = ("RuntimeError: Not enough GPU memory for hybrid (mamba/linear-attention) state cache. Computed "
           "max_mamba_cache_size=-137")
    assert not lost_port_race("server exited during start-up:\n" + own)
    assert not lost_port_race("server not healthy after 300s:\n[Errno 98] somewhere else")


def test_a_failed_run_writes_its_error_into_the_report_file(tmp_path, monkeypatch):
    """The host agent reads the --json file, not stdout: a server that fails to start must still say why there."""
    def fails(**_kw):
        raise RuntimeError("server exited during start-up: OSError: [Errno 13] Permission denied: '/models'")
    monkeypatch.setattr(smoke, "gpu_device_problem", lambda gpu: None)
    monkeypatch.setattr(smoke, "run_smoke", fails)
    report = tmp_path / "report.json"
    assert smoke.main(["--json", str(report), "--mode", "linear"]) == smoke.EXIT_FAILED
    doc = json.loads(report.read_text())
    assert doc["ok"] is False and "Permission denied: '/models'" in doc["error"], doc

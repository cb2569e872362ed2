"""SGLang's Prometheus /metrics (served with --enable-metrics), read with prometheus_client's own text parser.

One parser for both sides: the drain on the host (is a GPU's server idle?) and `fab status` on the control
machine (tokens/s, running and queued requests, accept length). On a host it is the prometheus_client package the
agent zipapp carries (ddtree_agent/vendor/, see deploy/remote/zipapp.py); on the control machine the installed
one. Names are SGLang 0.5.17's (sglang/srt/observability/metrics_collector.py):

    sglang:num_running_reqs, sglang:num_queue_reqs     gauges, one sample per scheduler (tp/pp/dp rank)
    sglang:gen_throughput                              gauge, tokens/s, per scheduler
    sglang:spec_accept_length                          gauge, per scheduler
    sglang:generation_tokens_total, prompt_tokens_total, num_requests_total   counters (tokenizer side)

A server runs one scheduler per rank: running/queued/throughput are summed over samples, the accept length is
the mean of the schedulers that report one.
"""
try:
    from .vendor.prometheus_client.parser import text_string_to_metric_families
except ImportError:  # the control machine, or the host package run from the repo (tests): the installed one
    from prometheus_client.parser import text_string_to_metric_families

SUMMED = {"sglang:num_running_reqs": "running", "sglang:num_queue_reqs": "queued",
          "sglang:gen_throughput": "tokens_per_s", "sglang:generation_tokens_total": "generation_tokens",
          "sglang:prompt_tokens_total": "prompt_tokens", "sglang:num_requests_total": "requests"}
MEAN = {"sglang:spec_accept_length": "accept_length"}


class MetricsError(ValueError):
    """/metrics text that prometheus_client cannot parse."""


def serving(text):
    """{running, queued, tokens_per_s, accept_length, generation_tokens, prompt_tokens, requests} from /metrics
    text; a figure the server does not export is None. Raises MetricsError on unparseable text."""
    sums, means = {}, {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                # a counter's family is `sglang:x`, its sample `sglang:x_total` (prometheus_client strips it)
                if s.name in SUMMED:
                    sums[SUMMED[s.name]] = sums.get(SUMMED[s.name], 0.0) + float(s.value)
                elif s.name in MEAN:
                    means.setdefault(MEAN[s.name], []).append(float(s.value))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsError("unparseable /metrics: %s" % exc)
    out = dict((k, sums.get(k)) for k in SUMMED.values())
    for k in MEAN.values():
        vals = [v for v in means.get(k, []) if v > 0]  # 0: a scheduler that has not decoded yet
        out[k] = round(sum(vals) / len(vals), 4) if vals else None
    return out


def in_flight(figures):
    """Requests a server still holds (running + queued), or None when it exports neither."""
    r, q = figures.get("running"), figures.get("queued")
    if r is None and q is None:
        return None
    return int((r or 0) + (q or 0))

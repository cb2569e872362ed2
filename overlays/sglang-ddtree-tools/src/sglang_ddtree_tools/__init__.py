"""The DDTree plugin's measurement and training tools: a second distribution beside the serving plugin.

The serving wheel (``sglang_ddtree``) holds what an SGLang server imports; these modules measure and exercise it
and are never installed into a serving venv. ``fab bench`` and ``fab smoke`` carry this wheel to a host for one
run (installed into the run's private work directory, on ``PYTHONPATH`` of that run's processes only).

* :mod:`sglang_ddtree_tools.report`       - the bench report (``ddtree-bench/1``): schema, checks, run names; pure,
  stdlib only, read by the control side (``deploy/bench.py``) too
* :mod:`sglang_ddtree_tools.bench`        - ``python -m sglang_ddtree_tools.bench``: throughput and latency per mode
* :mod:`sglang_ddtree_tools.smoke`        - ``python -m sglang_ddtree_tools.smoke``: serve a tiny model, check lossless
* :mod:`sglang_ddtree_tools.servers`      - transient SGLang servers on one GPU, shared by smoke and bench
* :mod:`sglang_ddtree_tools.paired`       - a mode against its peer round by round
* :mod:`sglang_ddtree_tools.hostload`     - what the host's CPUs and a server's processes did over a level
* :mod:`sglang_ddtree_tools.spy`          - py-spy captures of a server, summarized
* :mod:`sglang_ddtree_tools.profile_step` - a torch profile of the decode step, summarized
* :mod:`sglang_ddtree_tools.tiny`         - tiny seeded models
* :mod:`sglang_ddtree_tools.markov`       - a seeded synthetic language with known branching; exact accept estimator
* :mod:`sglang_ddtree_tools.trainkit`     - ``python -m sglang_ddtree_tools.trainkit``: trained tiny pairs
* :mod:`sglang_ddtree_tools.replay`       - ``python -m sglang_ddtree_tools.replay``: a kit's prompts decoded as a
  server does, step by step: the accept length a server should report with that pair
"""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("sglang-ddtree-tools")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

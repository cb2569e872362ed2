"""Runnable correctness checks for the DDTree plugin.

Each check is a module that can be run as ``python -m sglang_ddtree.checks.<name>``
on a GPU host where SGLang (or at least its Triton kernels) is importable.  The
pure-torch reference parts of the checks import no SGLang and run on a CPU, so
they are unit-tested in CI; the parts that launch SGLang's kernels need a GPU.
"""

"""The lab's drift knobs as data: ways to make one lab host incoherent on purpose (`fab lab.drift HOST KIND`), all
from real captured metadata, so refusals can be tested on real pins; "coherent" puts the host back as lab.up built
it. fleet.py applies them. A module of its own so that `fab`'s task list imports no lab machinery (start-up time)."""

DRIFTS = {
    "coherent": "the host as lab.up built it: its persona's torch build (ct200: +cu128, the seed's ABI drift), "
                "SGLang 0.5.17 and sglang-kernel 0.4.5 (the default; what a `fab provision` changed is put back)",
    "sglang-kernel-0.4.10": "sglang-kernel 0.4.10: its real metadata (torch==2.14.1) and common_ops stand-ins "
                            "importing its real torch symbols, which the lab's torch 2.11 does not export",
    "sglang-0.5.16": "SGLang 0.5.16's real metadata: a version the plugin does not support (and unmet pins)",
    "sglang-0.5.23": "SGLang 0.5.23's real metadata: supported by the plugin, but it pins torch==2.14.1, "
                     "sglang-kernel==0.4.10, flashinfer-python==0.7.2",
}

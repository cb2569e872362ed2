"""ddtree-deploy: take a GPU fleet from drifted to serving DDTree speculative decoding with SGLang."""
__version__ = "0.1.0"

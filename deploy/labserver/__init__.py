"""The lab's named stand-in for SGLang's HTTP server (see server.py); used only on CPU lab hosts."""

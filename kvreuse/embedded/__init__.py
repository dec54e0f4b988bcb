"""The embedded default model: the GGUF file that kvreuse's own wheel carries (`pin.py` says which)."""

"""The one error of reading a model: its files, its metadata, its tokenizer or its name."""


class ModelLoadError(RuntimeError):
    """A model that cannot be served, with the file and the key or value at fault named in the message."""

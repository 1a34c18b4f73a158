"""Data preparation (tokenizer, shards, manifest) and the streaming training loader with its objectives."""


class DataError(ValueError):
    """Bad or inconsistent data (input files, shards, manifest, tokenizer); the message says which and why."""

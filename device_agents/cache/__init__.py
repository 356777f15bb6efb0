"""The device's local result cache: a request whose answer is known is answered without the model.

    key.py      exact keys (model identity + version + inputs + answer-changing parameters; xxh3-128 index)
    tensors.py  output tensors as bytes (no pickle)
    store.py    ResultCache: an in-memory LRU tier in front of a durable SQLite tier under <store>/cache/

Imports numpy, xxhash and sqlite3 only; loaded by the pipeline when a model has a cache configured.
"""

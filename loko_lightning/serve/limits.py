"""The default bounds of ``loko serve``, in a module that imports nothing.

``loko serve --help`` and its refusals of bad options read them without importing torch.
"""

#: A request's body, at most (``--max_body_bytes``, 413 beyond).
MAX_BODY_BYTES = 8 * 1024 * 1024
#: An input image's width x height, at most, read from its header before decoding (``--max_pixels``, 413 beyond).
MAX_PIXELS = 4096 * 4096
#: Bytes of the kept predictions' inputs, at most (``--pending_bytes``: the oldest forgotten first).
PENDING_BYTES = 256 * 1024 * 1024
#: Bytes of the queued feedback's inputs, at most (``--queue_bytes``, 429 beyond).
QUEUE_BYTES = 256 * 1024 * 1024

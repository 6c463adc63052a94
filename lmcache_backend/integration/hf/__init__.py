"""CacheBlend in a small HF-transformers serving loop (:mod:`.engine`): the demo's and the
benchmark's in-process engine."""

"""The connector's worker side (one per vLLM worker): the pieces built once the model is
known, then per step the blends into the request's blocks and the segments stored."""

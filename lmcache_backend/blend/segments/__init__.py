"""A prompt's cached units: how prompts are cut (separator or blocks), the segments looked
up in and stored to the store, and LMCache's retriever over them."""

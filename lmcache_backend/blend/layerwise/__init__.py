"""The layer loop of a blend: the cached K/V re-rotated, and every layer's fresh rows put
into the cached ones."""

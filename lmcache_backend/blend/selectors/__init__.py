"""Which reusable tokens a blend recomputes: the selectors and their scorers, the preview
of the question over the cached K/V, and the fidelity knob."""

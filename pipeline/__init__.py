"""hidden-harvest: hidden-state training data for EAGLE-3 draft models, as a Ray Data job."""

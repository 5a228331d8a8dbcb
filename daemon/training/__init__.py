"""Training speculator weights for a model: ``codespec train-eagle`` (and its data)."""

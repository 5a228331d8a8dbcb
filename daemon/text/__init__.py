"""Token ids to text and back: incremental detokenization, stop rules, token healing.

Knows the tokenizer, never the model.
"""

"""Documents to prompts: completion and edit prompts, FIM layouts, cross-file snippets.

Pure functions of text and a tokenizer; no decoding, no sockets.
"""

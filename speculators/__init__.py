"""codespec.speculators: drafts, proposers and lossless verification.

Proposers answer ``begin`` / ``propose`` / ``observe`` (see ``draft.py``);
``verify.py`` accepts drafts without changing the output; ``registry.py``
resolves ``speculation`` names. Nothing here touches sockets or documents.
"""

"""codespec.speculators: drafts, proposers, the speculation policy and lossless verification.

Proposers answer ``begin`` / ``propose`` / ``observe`` / ``follow`` (see ``draft.py``)
and only propose: ``policy.py``'s controller is the one the engine drives, and the one
that measures, cuts drafts, chooses and backs off (``book.py``, ``acceptance.py``,
``costs.py``); ``verify.py`` accepts drafts without changing the output;
``registry.py`` resolves ``speculation`` names. What proposers read from the model is
``target.py``'s interface, which the engine implements: nothing here imports the
daemon, touches sockets or documents.
"""

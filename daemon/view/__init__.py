"""``codespec view``: a live page of speculation at work, served by the daemon.

Owns the page and its data: :mod:`.recorder` (a bounded ring of per-request records,
filled on the worker thread while the view is open), :mod:`.snapshot` (the records as
JSON, text decoded on the event loop), :mod:`.server` (aiohttp on 127.0.0.1, a random port
and token), :mod:`.service` (open / close, the ``view`` socket method), :mod:`.page` and
``static/`` (the page; uPlot vendored), :mod:`.command` (the subcommand).
Must not touch: the engine, the scheduler's queue, documents. The scheduler knows only
``Scheduler.view`` (a recorder or None) and calls its ``wrap`` and ``finish``.
"""

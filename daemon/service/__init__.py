"""``codespec serve``: the socket daemon (connections, handlers, scheduler, documents,
workspace). The model work it schedules runs in :mod:`codespec.daemon.engine`."""

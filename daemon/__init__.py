"""codespec.daemon: the process that owns the model.

The engine (model, KV cache slots, decode loop), the runners, the socket
server with its document store and scheduler, the CLI, the trainers and the
benchmarks. The shipped model lives in ``embedded/``.
"""

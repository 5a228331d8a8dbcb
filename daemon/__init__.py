"""codespec.daemon: the process that owns the model.

The engine (model, KV cache slots, decode loop), the runners, the socket
server with its document store and scheduler, the CLI, the trainers and the
benchmarks. The default model (SmolLM2-135M-Instruct) is fetched once into
the model cache by ``models.py``; nothing model-sized ships in the package.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("codespec")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

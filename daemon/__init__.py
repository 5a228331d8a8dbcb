"""codespec.daemon: the process that owns the model.

The engine (model, KV cache slots, decode loop), the runners, the socket
server with its document store and scheduler, the CLI, the trainers and the
benchmarks. The default model (Qwen2.5-Coder-0.5B-Instruct; ``$CODESPEC_MODEL``
names another) and the other named models are fetched once into the model cache
by ``models.py``; nothing model-sized ships in the package.
"""

import os
from importlib.metadata import PackageNotFoundError, version

# OpenMP threads that wait at a barrier sleep instead of spinning, unless the user chose
# otherwise. Read by libgomp when torch loads it, so it is set before anything imports
# torch. With the cores busy with other work, threads that spin make a decode step
# several times slower than threads that sleep (`codespec bench runner --threads 2`): a
# waiter that spins holds the core the thread it waits for needs.
# Programs codespec starts that are not codespec (the llama.cpp peers of the benchmarks)
# get the environment without it (see child_env): the setting is codespec's, not theirs.
OMP_WAIT_POLICY_OURS = "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
if OMP_WAIT_POLICY_OURS:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def child_env() -> dict[str, str]:
    """The environment for another program: os.environ without what codespec itself set
    in it (OMP_WAIT_POLICY, where the user had not chosen one). llama.cpp's OpenMP threads
    would inherit it and sleep at every barrier, decoding several times slower than the
    same binary started from a shell."""
    env = dict(os.environ)
    if OMP_WAIT_POLICY_OURS and env.get("OMP_WAIT_POLICY") == "PASSIVE":
        del env["OMP_WAIT_POLICY"]
    return env


try:
    __version__ = version("codespec")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

"""Backends: an inference server that decodes the daemon's prompts in place of its engine.

``serve --backend vllm`` (``[backend] kind = "vllm"``) makes the daemon a client of a
vLLM server's OpenAI-compatible API. The daemon keeps everything it owns — documents,
the n-gram index, prompts (the same token ids the local engine would get), stop rules,
post-processing, cancellation, telemetry — and sends only prompt ids out; tokens come
back as ids and are read back as text by the daemon's own tokenizer.

- :mod:`.openai_http`: the HTTP client (streamed completions, errors, the API key).
- :mod:`.remote`: :class:`~.remote.RemoteEngine`, the engine's face for the scheduler.
- :mod:`.vllm_args`: the server command line that matches a model and its head.

Must not touch: sockets to editors, documents, the local engine's insides.
"""

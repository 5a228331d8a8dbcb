"""The engine: a resident model and its KV caches, fed token ids, giving token ids.

``engine`` (the decode loop: prefill, plain and speculative steps, cache slots),
``runner`` (the runner contract and the Hugging Face runner), ``lean`` (the
hand-written Llama-family runner), ``cpu_gemm`` / ``quant_gemm`` and ``csrc/``
(the CPU kernels), ``models`` (where model folders come from). Knows nothing about
text, documents or sockets.
"""

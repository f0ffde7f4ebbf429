"""Serving an ensemble in-process: shared ensembles, option policy, cancellable runs, replies.

What both framework adapters and the HTTP server stand on (:mod:`.runtime`).
"""

"""Rendering results that are data first: rich tables (:mod:`.tables`), capacity tables and
PNG plots (:mod:`.capacity`).  Data in, text or files out; no computation.

May import every stage below the CLI.
"""

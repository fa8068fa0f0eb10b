"""Plumbing every stage may use: atomic writes (:mod:`.io`), strict config parsing
(:mod:`.validate`), progress bars (:mod:`.progress`), forked window-parallel workers
(:mod:`.parallel`), glibc heap trimming (:mod:`.heap`) and lockstep coroutines (:mod:`.lockstep`).

Imports nothing of lowbit's.
"""

"""Imported last by the SGLang forkserver (process_start.PRELOAD), never by anything else: what the server
holds once SGLang is imported (its modules, torch's, transformers') is moved out of the cyclic collector's
passes, so every scheduler and detokenizer forked from it starts with that heap frozen.

A collection in a forked child otherwise walks the whole inherited heap (hundreds of thousands of
objects) and, by touching each object's header, copies every page of it out of the server's
copy-on-write memory. CPython documents the pattern (gc.freeze: "disable gc early in the parent
process, freeze just before fork"). Nothing here is collected anyway: the server only forks.
"""

from __future__ import annotations

import gc

gc.collect()
gc.freeze()

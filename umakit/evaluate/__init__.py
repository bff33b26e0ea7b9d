"""Quality measured: perplexity on real text (`perplexity`), and the corpora it is measured on (`corpora`).

`perplexity` is written against the engine protocol only (`Engine.logits` and the KV cache), so every engine
is scored by the same code; `corpora` fetches and caches Jane Austen's novels and Wikipedia leads.
Imports `core` and numpy; never an engine.
"""

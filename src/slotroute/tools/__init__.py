"""Tools built on slotroute, not part of the library or the vLLM plugin.

``demo`` (``slotroute demo``: a tiny MoE served by vLLM, every request's routing
checked), ``bench`` (``slotroute bench``: the store and wire benchmarks), ``tiny_model``
(the checkpoint the demo and the tests serve), ``engine`` (the in-process engine
driver the demo and ``benchmarks/vllm_e2e.py`` share) and ``cuda_graph`` (a function
recorded into a CUDA graph, for the GPU tests and benchmarks). Nothing in ``slotroute`` or
``slotroute.vllm`` imports them.
"""

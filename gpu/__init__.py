"""The dense path on any torch device (``cuda:N``, or ``cpu`` where no GPU exists).

Norms, RoPE, attention with a KV cache, dense/shared SwiGLU FFNs, routers, GPU-resident
experts and GGUF→torch dequantization. Imports torch, numpy, gguf and ``placement.limits``
only (never ``offload``, never ``cpu_kernels``): projections are plain callables, so the
caller may hand in a projection that runs elsewhere (e.g. raw GGUF blocks through Numba).
"""

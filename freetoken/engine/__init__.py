"""The engine: one batched forward over the paged KV cache, and sampling.

Owns model loading (through freetoken.models), the KV cache and its block allocator, the
ForwardBatch a forward reads, and the sampler. May import freetoken.models and triton_kernels;
knows nothing of requests' lifecycles (freetoken.scheduler) or HTTP (freetoken.server).
"""

"""Model families, one file each, with Hugging Face module and parameter names.

Owns: parsing a checkpoint's config.json into a ModelConfig, building the family's modules,
and loading safetensors weights into them (loader.py). May import triton_kernels and
freetoken.engine.batch (the batch metadata a forward reads); never the scheduler or server.
"""

"""Quantized checkpoints: which format each weight is in, and the canonical form it is kept in.

Owns reading `quantization_config` (config.json) or `hf_quant_config.json` into a QuantScheme
(`scheme.py`), converting each method's on-disk tensors into the canonical in-memory form the
kernels read (`convert.py`: triton_kernels.dequant's QuantFormat, a weight a dict of q/s/z/g),
swapping a meta-built model's linears and expert banks for quantized ones (`apply.py`), and the
other direction, float weights into each method's real layout (`quantize.py`, `encode.py`: what
tools/make_tiny_model.py --quant writes). May import torch, triton_kernels and freetoken.moe.
"""

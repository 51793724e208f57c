"""Experts off the device: the host-RAM expert store, the GPU expert cache (one slot pool shared
by every layer, with its replacement policy), the copies that fill it, and CPU expert compute.

Owns MoeConfig and its startup resolution (which backend, how many slots, which layers on the
CPU). May import torch and triton_kernels; never freetoken.models, scheduler or server: the
engine hands it routers and expert banks as plain callables and tensors.
"""

"""Small shared utilities: environment variables (the one place FREETOKEN_* is read),
logging setup, and later the checkpoint prefetcher. Imports nothing from other layers.
"""

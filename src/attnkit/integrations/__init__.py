"""attnkit inside other libraries (optional dependencies, imported on demand).

`attnkit.integrations.transformers.register()` makes `attn_implementation="attnkit"` work
in Hugging Face transformers, keeping the mask's structure.
"""

"""Lookahead decoding as a transformers custom_generate folder:

    model.generate(**inputs, custom_generate="path/to/lookahead", trust_remote_code=True)

transformers copies this file into its modules cache and calls generate(model, **generate's
arguments); it hands them back to model.generate with the backend's decoding loop. The backend
is this repository's code (hf_backend.py and the engine), imported from it, so the repository
must be importable: run from its root, or put it on PYTHONPATH (README.md here says more).
"""
from functools import partial

from hf_backend import lookahead_generate


def generate(model, *args, **kwargs):
    # generate hands a custom_generate callable no streamer: it goes in bound
    return model.generate(*args, custom_generate=partial(lookahead_generate, streamer=kwargs.get("streamer")), **kwargs)

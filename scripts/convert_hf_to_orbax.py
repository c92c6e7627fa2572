#!/usr/bin/env python
"""Convert a Hugging Face model directory or a .gguf file to a jaxserve (Orbax) model directory.

Same as `jaxserve convert SRC DST [--dtype float32|bfloat16]`.
"""
import sys

from jaxserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))

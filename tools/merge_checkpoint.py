#!/usr/bin/env python
"""Merge a sharded trainer checkpoint into a Hugging Face model folder.

Same as ``chatlearn merge``::

    python tools/merge_checkpoint.py CKPT_DIR OUT_DIR [--hf-config DIR]
        [--dtype float32|bfloat16|float16] [--max-shard-size 5GB] [--merged] [--base DIR]

(``--merged``, ``--base``: a LoRA checkpoint, written as peft's adapter folder unless ``--merged``.)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from chatlearn.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["merge", *sys.argv[1:]]))

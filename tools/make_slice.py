"""Write a GLM-5-shaped slice checkpoint: GLM-5's full attention and indexer widths, few layers and
experts, random weights, in the Hugging Face layout `glm53.models.load_weights` reads.

    PYTHONPATH=. python tools/make_slice.py OUT_DIR [--layers 4] [--experts 16] [--vocab V] ...

The command line of `glm53.support.glm5_slice` (the widths, the weight law, the tokenizer copied
in, `--width KEY=VALUE` overrides: see there); `--help` lists the arguments.
"""

from glm53.support.glm5_slice import main

if __name__ == "__main__":
    main()

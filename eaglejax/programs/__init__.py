"""The compiled decoding loops as programs for devices this host may not have.

`reference` holds the shapes they are built for (Llama-3.1-8B and its public EAGLE-3 head),
`hlo` reads the text XLA compiles them to, `export` lowers and serialises them for "cuda"
and "tpu" (and counts their collectives on a mesh), and `roofline` predicts their speed on
an accelerator from XLA's cost analysis. This package sits above the decoding loops; no
module below it imports it.
"""

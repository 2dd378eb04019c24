"""A model's weights: quantization (int8w, int4, bitsandbytes), what `--quant auto`
chooses, GGUF files and their blocks, memory pages and fit, the fingerprint that ties
checkpoints to weights, and Quickdraft's CPU kernels (kernels/). Imports the foundation
and engine.decode (quant auto times and answers with the decode loop's pieces).
"""

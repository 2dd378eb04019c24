"""What a user or CI runs beside the app, each as `python -m scripts.NAME` from the
repository root: gpu_check and bench_gpu (a CUDA machine), lock (the pinned environments),
build_datastore (the shipped datastore), quality_gate (perplexity of every weight choice),
scaled_gguf (a bigger model to time against llama.cpp) and screenshot (the README's image)."""

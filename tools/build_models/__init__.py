"""The model build: export, quantisation, the minilm-lite fallback, tensor-parallel shard sets
and their verification, writing the repository that services/model_server/ serves.

The only code that imports torch, transformers, sentence-transformers and the weights package;
nothing under services/ imports it (tests/test_runtime_imports.py)."""

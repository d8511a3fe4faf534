"""The lab: tools to study the served model beyond what llama.cpp exposes, and the
approximate serving strategies built on them (never the default serving path).

- ``reference``: the served Gemma-3 model in PyTorch, from the very same GGUF weights
  (layer-by-layer forward, KV cache, hidden states, custom attention masks).
- ``state_blob``: llama.cpp's per-sequence state bytes, parsed and written.
- ``truncate``: a GGUF of the model's first k blocks (an auxiliary model llama.cpp runs).
- ``kv_prediction``: seed 001's KV prediction as a board strategy.
- ``anchors``: seed 004's anchor inference (finished sequences pruned to their anchor token)
  as the board strategies ``anchors`` and ``anchors-tuned``.
- ``anchor_tune``: seed 004's anchor fine-tuning (LoRA under the anchor mask), exported to GGUF.

Needs the optional ``lab`` extra (torch, gguf) for the reference engine and for fitting;
serving a fitted predictor needs only numpy and llama.cpp.
"""

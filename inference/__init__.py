"""What runs on every edge board: the llama.cpp engine and the cached-inference pipeline."""
